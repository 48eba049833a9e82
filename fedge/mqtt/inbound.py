"""What arrives over MQTT, classified once: the coordinator transport, the relay and the aggregation worker all
read hellos, updates, partials and round descriptors through :class:`InboundClassifier`.

The rules (docs/protocol.md): a hello is at most :data:`~fedge.mqtt.settings.MAX_HELLO_BYTES`; an empty payload
is a retained message's deletion, not a message; the protocol never retains an update or a partial; a
large message travels as chunk frames, reassembled per source with bounded memory
(:class:`~fedge.mqtt.chunking.Reassembler`); a round descriptor is a message (signed: inside its frame, which
the devices verify) of at most ``MAX_HELLO_BYTES`` whose ``round`` names its phase and deadline.

Every refusal behaves the same wherever it happens: it is counted by reason in the connection's
``TransportStats.rejected`` and logged at a bounded rate (:class:`RefusalLog`: the first of each reason at
once, then at most one line per reason every ``interval_s``, saying how many were refused since), so a
flood of bad messages costs neither memory nor a disk of logs. A refused update or partial is also handed
on as an :class:`~fedge.common.transport.Inbound` with ``reject`` set, so that the round report counts it.

Plain Python, no paho (tested without a broker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedge.common.messages import Message
from fedge.common.rounds import FINAL_PHASE
from fedge.common.signing import unwrap
from fedge.common.transport import Inbound
from fedge.errors import PayloadError
from fedge.mqtt.chunking import ChunkError, Reassembler, frame_kind
from fedge.mqtt.settings import MAX_HELLO_BYTES, TransportStats

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 60.0


class RefusalLog:
    """Refusals counted by reason (into ``stats.rejected``) and logged at a bounded rate per reason."""

    def __init__(self, who: str, stats: TransportStats, *, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.who = who
        self.stats = stats
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}  # reason -> when it was last logged
        self._quiet: dict[str, int] = {}  # reason -> refusals since that line

    def refuse(self, reason: str, message: str) -> None:
        """Count one refusal of ``reason``; log it unless this reason was logged less than ``interval_s`` ago."""
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        quiet = self._quiet.pop(reason, 0)
        self._last[reason] = now
        more = f" ({quiet} more refused since the last such line)" if quiet else ""
        log.warning("%s refused %s: %s%s", self.who, reason, message, more)


@dataclass(frozen=True)
class Descriptor:
    """A round descriptor, read: the message, its ``round`` table, whether it is the final round, its deadline."""

    msg: Message
    round: dict[str, Any] = field(default_factory=dict)
    final: bool = False
    deadline: float = 0.0


@dataclass
class InboundClassifier:
    """One connection's inbound rules (see the module docstring); ``refusals`` counts and logs what it refuses."""

    refusals: RefusalLog
    reassembler: Reassembler
    max_hello_bytes: int = MAX_HELLO_BYTES

    def hello(self, device: str, payload: bytes, received: float) -> Inbound | None:
        """A device's hello, or None: an empty payload (a cleared retained hello), or one refused as too large."""
        if not payload:
            return None
        if len(payload) > self.max_hello_bytes:
            self.refusals.refuse("hello-oversize", f"a {len(payload)}-byte hello from {device} (at most "
                                                   f"{self.max_hello_bytes} bytes)")
            return None
        return Inbound(payload, device, received)

    def upload(self, source: str, payload: bytes, retain: bool, received: float, *, kind: str = "update",
               chunks: bool = True, chunks_refused: str = "") -> Inbound | None:
        """An update (``kind``: or a partial) from ``source``: the whole message, a refusal (``reject`` set),
        or None (an empty payload, or a chunk of a transfer still incomplete). ``chunks`` False: a chunk frame
        is refused (reason ``chunked``, ``chunks_refused`` saying why and what to do)."""
        if not payload:
            return None
        if retain:
            return self._refused(source, received, kind, "retained", f"a retained {kind} from {source} "
                                                                     "(the protocol never retains one)")
        if frame_kind(payload) == "message":
            return Inbound(payload, source, received, kind=kind)
        if not chunks:
            return self._refused(source, received, kind, "chunked", f"{source}'s {kind} arrived in chunks; "
                                                                    f"{chunks_refused}")
        try:
            whole = self.reassembler.add(f"{kind}/{source}", payload)
        except ChunkError as exc:
            return self._refused(source, received, kind, exc.reason, exc.message)
        return None if whole is None else Inbound(whole, source, received, kind=kind)

    def expired(self) -> list[Inbound]:
        """The transfers unfinished after the reassembler's timeout, dropped and refused (``incomplete``)."""
        out = []
        for key, tid in self.reassembler.expire():
            kind, _, source = key.partition("/")
            out.append(self._refused(source, time.time(), kind, "incomplete",
                                     f"transfer {tid[:8]} from {source} never completed"))
        return out

    def _refused(self, source: str, received: float, kind: str, reason: str, message: str) -> Inbound:
        self.refusals.refuse(reason, message)
        return Inbound(b"", source, received, reject=(reason, message), kind=kind)

    def descriptor(self, raw: bytes) -> Descriptor | None:
        """A round descriptor read inside its signed frame (not verified: the devices verify it), or None if
        it is unreadable (refused: ``descriptor``)."""
        try:
            msg = Message.from_bytes(unwrap(raw), max_bytes=self.max_hello_bytes)
            rnd = msg.info.get("round", {})
            rnd = rnd if isinstance(rnd, dict) else {}
            return Descriptor(msg, rnd, rnd.get("phase") == FINAL_PHASE, float(rnd.get("deadline", 0.0)))
        except (PayloadError, TypeError, ValueError) as exc:
            self.refusals.refuse("descriptor", f"a bad round descriptor: {exc}")
            return None
