"""The update gate: everything a device sends passes here before it may touch the engine's state.

The gate registers devices from their hellos and admits updates: envelope, the
sender the transport vouches for, registration, the round (late, stale, future),
duplicates and replays, the exact tensor schema. It is also the coordinator's
one **error boundary** for device input: whatever a device's bytes make go
wrong — in decoding, in the gate's checks, in the strategy's ``accumulate`` or
in building the round report — rejects that one message with a reason, counted
per device and logged with the device id, and the coordinator carries on.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.tensorcodec import OversizeError
from fedge.common.transport import Inbound
from fedge.coordinator.config import EngineConfig
from fedge.coordinator.strategy import Strategy
from fedge.coordinator.validation import Rejected, check_arrays
from fedge.errors import PayloadError

log = logging.getLogger(__name__)

HELLO_MAX_BYTES = 1 << 20
UNKNOWN_SENDER = "?"  # rejections whose sender nobody vouches for and the envelope does not name


def reason_of(exc: BaseException) -> str:
    """The counter key of a refusal: typed errors carry theirs; anything unexpected is ``error``."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    if isinstance(exc, OversizeError):
        return "oversize"
    if isinstance(exc, PayloadError):
        return "malformed"
    return "error"


@dataclass
class Rejections:
    """Refusals since the last :meth:`UpdateGate.drain`, by reason and by device."""

    by_reason: Counter[str] = field(default_factory=Counter)
    by_device: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, device: str, reason: str) -> None:
        self.by_reason[reason] += 1
        self.by_device.setdefault(device, Counter())[reason] += 1


class UpdateGate:
    """Registration and admission of device messages (see the module docstring)."""

    def __init__(self, strategy: Strategy, config: EngineConfig) -> None:
        self.strategy = strategy
        self.config = config
        self.devices: dict[str, DeviceInfo] = {}
        self.rejections = Rejections()
        # Message ids accepted in this round and the previous one (replay guard; older rounds are
        # refused by their round number anyway).
        self._recent_ids: set[str] = set()
        self._previous_ids: set[str] = set()
        self.last_missing: set[str] = set()  # devices that missed the previous round's deadline
        self._round = 0
        self._final = False
        self._seen: set[str] = set()

    # -- counting -------------------------------------------------------------------------
    def reject(self, device: str | None, exc: BaseException, what: str) -> None:
        """Count and log one refused message (``what``: "hello", "update")."""
        reason = reason_of(exc)
        device = device or UNKNOWN_SENDER
        key = f"hello-{reason}" if what == "hello" else reason
        self.rejections.add(device, key)
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        if reason == "error":  # not a check of ours: keep the traceback for whoever debugs it
            log.warning("round %d: refused a %s from %s (%s): %s", self._round, what, device, key, message,
                        exc_info=exc)
        else:
            log.warning("round %d: refused a %s from %s (%s): %s", self._round, what, device, key, message)

    def drain(self) -> Rejections:
        """The refusals counted so far; counting starts again from zero."""
        out, self.rejections = self.rejections, Rejections()
        return out

    # -- registration ---------------------------------------------------------------------
    def register(self, items: Iterable[Inbound]) -> list[str]:
        """Register devices from hellos; returns the ids registered for the first time."""
        new = []
        for item in items:
            sender: str | None = item.origin
            try:
                msg = Message.from_bytes(item.data, max_bytes=HELLO_MAX_BYTES)
                sender = sender or msg.sender
                dev = self._check_hello(msg, item)
            except Exception as exc:  # the error boundary: a hello never stops the coordinator
                self.reject(sender, exc, "hello")
                continue
            if dev.device_id not in self.devices:
                new.append(dev.device_id)
            self.devices[dev.device_id] = dev
        return new

    def _check_hello(self, msg: Message, item: Inbound) -> DeviceInfo:
        if msg.kind != "hello":
            raise Rejected("kind", f"expected a hello, got {msg.kind}")
        try:
            dev = DeviceInfo.from_dict(msg.info["device"])
        except (KeyError, TypeError) as exc:
            raise Rejected("malformed", f"hello from {msg.sender!r} has no valid info.device: {exc}") from exc
        if dev.device_id != msg.sender:
            raise Rejected("spoofed", f"hello sender {msg.sender!r} != device id {dev.device_id!r}")
        if item.origin is not None and item.origin != msg.sender:
            raise Rejected("spoofed", f"hello on {item.origin}'s topic claims to be {msg.sender!r}")
        allowed = self.config.allowed_devices
        if allowed is not None and dev.device_id not in allowed:
            raise Rejected("unauthorized", f"{dev.device_id!r} is not a device of this fleet")
        return dev

    # -- rounds ---------------------------------------------------------------------------
    def begin_round(self, rnd: int, *, final: bool) -> None:
        """Start admitting updates for round ``rnd``."""
        self._round, self._final, self._seen = rnd, final, set()

    def end_round(self, missing: Iterable[str]) -> None:
        """Round over: ``missing`` devices' updates for it will be refused as ``late``."""
        self.last_missing = set(missing)
        self._previous_ids, self._recent_ids = self._recent_ids, set()

    def admit(self, item: Inbound, accept: Callable[[Message], None],
              hellos: Callable[[], list[Inbound]] | None = None) -> bool:
        """Check one inbound update and hand it to ``accept``; False (counted) if refused.

        ``accept`` runs inside the error boundary too: if it raises, the update is refused
        (reason ``error``, or the reason a :class:`Rejected` carries). ``hellos`` fetches hellos
        that may have arrived during the round, for an update from a device not registered yet.
        """
        sender: str | None = item.origin
        try:
            if item.reject is not None:
                raise Rejected(*item.reject)
            msg = self._check_update(item, hellos)
            sender = msg.sender
            accept(msg)
        except Exception as exc:
            self.reject(sender, exc, "update")
            return False
        self._seen.add(msg.sender)
        self._recent_ids.add(msg.msg_id)
        return True

    def _check_update(self, item: Inbound, hellos: Callable[[], list[Inbound]] | None) -> Message:
        rnd = self._round
        msg = Message.from_bytes(item.data, max_bytes=self.config.max_update_bytes)
        if item.origin is not None and msg.sender != item.origin:
            raise Rejected("spoofed", f"an update on {item.origin}'s topic claims to come from {msg.sender!r}")
        if msg.kind != "update":
            raise Rejected("kind", f"expected an update, got a {msg.kind} from {msg.sender}")
        if msg.fleet != self.config.fleet:
            raise Rejected("fleet", f"{msg.sender} sent an update for fleet {msg.fleet!r}")
        if msg.sender not in self.devices and hellos is not None:
            self.register(hellos())  # its hello may have arrived during this round
        if msg.sender not in self.devices:
            raise Rejected("unregistered", f"{msg.sender!r} sent an update without a hello")
        if msg.round < rnd:
            if msg.round == rnd - 1 and msg.sender in self.last_missing:
                raise Rejected("late", f"{msg.sender}'s update for round {msg.round} came after its deadline; dropped")
            raise Rejected("stale", f"{msg.sender} sent round {msg.round} during round {rnd}")
        if msg.round > rnd:
            raise Rejected("future", f"{msg.sender} sent round {msg.round} during round {rnd}")
        if msg.sender in self._seen:
            raise Rejected("duplicate", f"{msg.sender} already sent its update for round {rnd}")
        if msg.msg_id in self._recent_ids or msg.msg_id in self._previous_ids:
            raise Rejected("replay", f"{msg.sender} reused message id {msg.msg_id}")
        spec = {} if self._final else self.strategy.expected_update(self.devices[msg.sender], rnd)
        check_arrays(msg.tensors, spec, msg.sender)
        return msg
