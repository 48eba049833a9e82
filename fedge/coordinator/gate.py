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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.common.messages import MAX_INFO_BYTES, Message
from fedge.common.rounds import DeviceInfo
from fedge.common.tensorcodec import OversizeError, TensorSpec, max_encoded_bytes
from fedge.common.transport import Inbound
from fedge.coordinator.config import EngineConfig
from fedge.coordinator.strategy import Strategy
from fedge.coordinator.validation import Rejected, check_arrays, parse_device, parse_update_info
from fedge.errors import PayloadError

log = logging.getLogger(__name__)

HELLO_MAX_BYTES = 64 * 1024  # a hello holds no tensors: its envelope and info.device
# Header bytes allowed beyond an update's tensors: the envelope with its info, plus ~128 bytes of
# header per tensor (name, dtype, shape, offsets).
ENVELOPE_BYTES = MAX_INFO_BYTES + 4096
HEADER_BYTES_PER_TENSOR = 256
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
class Admitted:
    """An update that passed the gate, with its info split into checked parts."""

    msg: Message
    device: DeviceInfo
    size: int
    metrics: dict[str, float]
    bytes_down: int
    info: dict[str, Any]
    staleness: int = 0  # asynchronous mode: versions between the one it trained from and the one being built
    raw: bytes = b""  # the update as received (asynchronous mode persists it before it counts)


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

    def __init__(self, strategy: Strategy, config: EngineConfig,
                 refuse: Callable[[str, str, str], None] | None = None,
                 observe: Callable[[str, str, str, str], None] | None = None,
                 registered: Callable[[DeviceInfo], None] | None = None) -> None:
        self.strategy = strategy
        self.config = config
        # (device id, reason, message) for a refused hello; (device id, "", "") when one is accepted
        self._refuse = refuse
        self._observe = observe  # (device id, "hello" | "update", reason key, message) of every refusal
        self._registered = registered  # each device a valid hello registered
        self._refused: set[str] = set()
        self.hellos_accepted = 0  # valid hellos registered (or re-registered) since start
        self.devices: dict[str, DeviceInfo] = {}
        # How many registered devices announce each embedding size: the shared-feature check of every hello reads
        # it instead of walking every device (per hello that walk made registering N devices quadratic: 18 of 20
        # CPU-seconds for 10,000 hellos). register() and restore_devices() are the writers of ``devices``.
        self._dims: Counter[int] = Counter()
        self._slot_dims: tuple[object, frozenset[int]] | None = None  # (the config's slots, their sizes)
        self.rejections = Rejections()
        # Message ids accepted in this round and the previous one (replay guard; older rounds are
        # refused by their round number anyway).
        self._recent_ids: set[str] = set()
        self._previous_ids: set[str] = set()
        self.last_missing: set[str] = set()  # devices that missed the previous round's deadline
        self._round = 0
        self._final = False
        self._seen: set[str] = set()
        self._sampled: set[str] | None = None  # devices sampled for this round (None: all)
        # Asynchronous mode (config.asynchronous): device -> the task (version) it was asked to train for; an
        # update is admitted only from a device with a task, once. The engine owns and updates the mapping.
        self.assigned: dict[str, int] = {}
        self._async_ids: dict[str, int] = {}  # message ids accepted -> version, kept for max_staleness versions

    @property
    def refused(self) -> set[str]:
        """Devices whose latest hello was refused (a copy)."""
        return set(self._refused)

    # -- counting -------------------------------------------------------------------------
    def reject(self, device: str | None, exc: BaseException, what: str) -> None:
        """Count and log one refused message (``what``: "hello", "update")."""
        reason = reason_of(exc)
        device = device or UNKNOWN_SENDER
        key = f"hello-{reason}" if what == "hello" else reason
        self.rejections.add(device, key)
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        article = "an" if what[0] in "aeiou" else "a"
        # reason "error" is not a check of ours: keep the traceback for whoever debugs it
        log.warning("round %d: refused %s %s from %s (%s): %s", self._round, article, what, device, key, message,
                    exc_info=exc if reason == "error" else None)
        if self._observe is not None:
            self._observe(device, what, key, message)

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
                if sender is not None and self._refuse is not None:
                    self._refused.add(sender[:64])
                    self._refuse(sender[:64], reason_of(exc), getattr(exc, "message", None) or str(exc)[:500])
                continue
            if self._refuse is not None and (dev.device_id not in self.devices or dev.device_id in self._refused):
                self._refuse(dev.device_id, "", "")  # clears a refusal left by an earlier hello or process
            self._refused.discard(dev.device_id)
            self.hellos_accepted += 1
            if dev.device_id not in self.devices:
                new.append(dev.device_id)
            self._put(dev.device_id, dev)
            if self._registered is not None:
                self._registered(dev)
        return new

    def restore_devices(self, devices: Mapping[str, DeviceInfo]) -> None:
        """Register ``devices`` (id → info: a restarted coordinator's saved registry) without their hellos."""
        for device_id, dev in devices.items():
            self._put(device_id, dev)

    def _put(self, device_id: str, dev: DeviceInfo) -> None:
        old = self.devices.get(device_id)
        if old is not None:
            self._dims[old.feature_dim] -= 1
            if not self._dims[old.feature_dim]:
                del self._dims[old.feature_dim]
        self._dims[dev.feature_dim] += 1
        self.devices[device_id] = dev

    def _fleet_dims(self, device_id: str) -> set[int] | frozenset[int]:
        """The embedding sizes a hello of ``device_id`` must match: its slots' (computed once per config), else
        those the other registered devices announce."""
        slots = self.config.slots
        if slots:
            if self._slot_dims is None or self._slot_dims[0] is not slots:
                self._slot_dims = (slots, frozenset(s.info.feature_dim for s in slots.values()))
            return self._slot_dims[1]
        dims = set(self._dims)
        old = self.devices.get(device_id)
        if old is not None and self._dims[old.feature_dim] == 1:
            dims.discard(old.feature_dim)  # its own earlier hello does not count
        return dims

    def _check_hello(self, msg: Message, item: Inbound) -> DeviceInfo:
        if msg.kind != "hello":
            raise Rejected("kind", f"expected a hello, got {msg.kind}")
        dev = parse_device(msg.info.get("device"))
        if dev.device_id != msg.sender:
            raise Rejected("spoofed", f"hello sender {msg.sender!r} != device id {dev.device_id!r}")
        if item.origin is not None and item.origin != msg.sender:
            raise Rejected("spoofed", f"hello on {item.origin}'s topic claims to be {msg.sender!r}")
        allowed = self.config.allowed_devices
        if allowed is not None and dev.device_id not in allowed:
            raise Rejected("unauthorized", f"{dev.device_id!r} is not a device of this fleet")
        slot = self.config.slots.get(dev.device_id) if self.config.slots is not None else None
        if slot is not None:
            wrong = slot.mismatches(dev)
            if wrong:
                raise Rejected("slot", f"{dev.device_id}'s hello contradicts its slot in the fleet config: "
                                       + "; ".join(wrong))
        if self.strategy.settings.shares_features:
            # Prototypes and statistics live in one feature space: one embedding size fleet-wide. The
            # fleet config's slots say which; without them the devices registered so far do (whichever
            # hello came first, so a coordinator run from a fleet config always passes slots).
            dims = self._fleet_dims(dev.device_id)
            if dims and dev.feature_dim not in dims:
                raise Rejected("feature_dim", f"{dev.device_id} announces embedding size {dev.feature_dim}; "
                                              f"this {self.config.method} fleet uses {min(dims)}")
        return dev

    # -- rounds ---------------------------------------------------------------------------
    def begin_round(self, rnd: int, *, final: bool, sampled: Iterable[str] | None = None) -> None:
        """Start admitting updates for round ``rnd`` (only from ``sampled`` devices, when given)."""
        self._round, self._final, self._seen = rnd, final, set()
        self._sampled = None if sampled is None else set(sampled)

    def sampled(self, device_id: str) -> bool:
        """Whether ``device_id`` owes an update this round (every device, unless the round samples)."""
        return self._sampled is None or device_id in self._sampled

    def end_round(self, missing: Iterable[str]) -> None:
        """Round over: ``missing`` devices' updates for it will be refused as ``late``."""
        self.last_missing = set(missing)
        self._previous_ids, self._recent_ids = self._recent_ids, set()
        a = self.config.asynchronous
        if a is not None:  # a replayed message id is remembered as long as its round could still be accepted
            self._async_ids = {i: v for i, v in self._async_ids.items() if v >= self._round - a.max_staleness}

    def remember(self, msg_id: str) -> None:
        """An accepted update restored from the buffer of a restarted coordinator: its id is a replay now."""
        self._recent_ids.add(msg_id)
        self._async_ids[msg_id] = self._round

    def admit(self, item: Inbound, accept: Callable[[Admitted], None],
              hellos: Callable[[], list[Inbound]] | None = None) -> bool:
        """Check one inbound update and hand it to ``accept``; False (counted) if refused.

        ``accept`` runs inside the error boundary too: if it raises, the update is refused
        (reason ``error``, or the reason a :class:`Rejected` carries). ``hellos`` fetches hellos
        that may have arrived during the round, for an update from a device not registered yet.
        """
        named: list[str] = []  # the envelope's sender, once it parsed (the transport may vouch for none)

        def expect(m: Message) -> TensorSpec:
            named.append(m.sender)
            return self._expect(m, item, hellos)

        try:
            if item.reject is not None:
                raise Rejected(*item.reject)
            msg = Message.from_bytes(item.data, max_bytes=self.config.max_update_bytes, expect=expect)
            device = self.devices[msg.sender]
            check_arrays(msg.tensors, None, msg.sender, device)  # values: finite floats, counts in range
            self._check_classes(msg, device)
            metrics, down, info = parse_update_info(msg.info, device)
            staleness = self._round - msg.round if self.config.asynchronous is not None and not self._final else 0
            accept(Admitted(msg, device, len(item.data), metrics, down, info, staleness, item.data))
        except Exception as exc:
            self.reject(item.origin or (named[0][:64] if named else None), exc, "update")
            return False
        self._seen.add(msg.sender)
        self.remember(msg.msg_id)
        return True

    def admit_stage(self, item: Inbound, accept: Callable[[Inbound], bool]) -> bool:
        """A secure-aggregation stage message, inside the error boundary: the transport's refusal or
        ``accept``'s (reasons ``secagg-*``) counted, never raised. Returns what ``accept`` returned (False if
        refused)."""
        try:
            if item.reject is not None:
                raise Rejected(f"secagg-{item.reject[0]}", item.reject[1])
            return accept(item)
        except Exception as exc:
            self.reject(item.origin, exc, "stage message")
            return False

    def restore(self, raw: bytes, accept: Callable[[Admitted], None]) -> Admitted:
        """An update this coordinator accepted (and persisted) before it restarted: decoded without the round
        checks it passed then, handed to ``accept`` again, and its message id remembered (a resent copy is a
        replay). Raises if the bytes no longer decode (the state directory is damaged)."""
        msg = Message.from_bytes(raw, max_bytes=self.config.max_update_bytes)
        device = self.devices[msg.sender]
        metrics, down, info = parse_update_info(msg.info, device)
        up = Admitted(msg, device, len(raw), metrics, down, info, self._round - msg.round, raw)
        accept(up)
        self._seen.add(msg.sender)
        self.remember(msg.msg_id)
        return up

    def _check_version(self, msg: Message, rnd: int) -> None:
        """Asynchronous mode: the version an update trained from (its round) against version ``rnd`` being built,
        and the sender's task (it trains from the version current when it starts: never before its task's)."""
        a = self.config.asynchronous
        assert a is not None
        if msg.msg_id in self._async_ids:
            raise Rejected("replay", f"{msg.sender} reused message id {msg.msg_id} (accepted into version "
                                     f"{self._async_ids[msg.msg_id]})")
        if msg.round > rnd:
            raise Rejected("future", f"{msg.sender} sent an update from version {msg.round} while version {rnd} is "
                                     "the latest")
        task = self.assigned.get(msg.sender)
        if task is None or msg.round < task:
            raise Rejected("unassigned", f"{msg.sender} has no task its update from version {msg.round} answers: "
                                         "that task's update was already accepted, or it was not asked to train")
        staleness = rnd - msg.round
        phase_now, phase_then = self.strategy.phase(rnd), self.strategy.phase(max(msg.round, 1))
        if staleness > a.max_staleness or phase_then != phase_now:
            del self.assigned[msg.sender]  # its task is over, its work unusable: the engine gives it a new one
        if staleness > a.max_staleness:
            raise Rejected("stale", f"{msg.sender}'s update trained from version {msg.round} is {staleness} versions "
                                    f"old while building version {rnd}: more than max_staleness = {a.max_staleness}")
        if phase_then != phase_now:
            raise Rejected("stale", f"{msg.sender}'s update trained from version {msg.round} in phase "
                                    f"{phase_then!r}; the fleet is in phase {phase_now!r} now")

    def _check_classes(self, msg: Message, device: DeviceInfo) -> None:
        """Class counts only for the classes its slot says the device holds."""
        slot = self.config.slots.get(device.device_id) if self.config.slots is not None else None
        if slot is None or slot.classes is None:
            return
        outside = np.ones(self.strategy.num_classes, dtype=bool)
        outside[[c for c in slot.classes if 0 <= c < self.strategy.num_classes]] = False
        for name, arr in msg.tensors.items():
            if np.issubdtype(arr.dtype, np.integer) and arr.shape == outside.shape and arr[outside].any():
                bad = [int(c) for c in np.flatnonzero(outside & (arr > 0))[:5]]
                raise Rejected("classes", f"{device.device_id} counts samples of classes {bad} in {name!r}; "
                                          f"its slot holds only classes {list(slot.classes)}")

    def _expect(self, msg: Message, item: Inbound, hellos: Callable[[], list[Inbound]] | None) -> TensorSpec:
        """Envelope checks, then the exact tensors this update must hold (before any is read)."""
        rnd = self._round
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
        if self.config.asynchronous is not None and not self._final:
            self._check_version(msg, rnd)
        elif msg.round < rnd:
            if msg.round == rnd - 1 and msg.sender in self.last_missing:
                raise Rejected("late", f"{msg.sender}'s update for round {msg.round} came after its deadline; dropped")
            raise Rejected("stale", f"{msg.sender} sent round {msg.round} during round {rnd}")
        elif msg.round > rnd:
            raise Rejected("future", f"{msg.sender} sent round {msg.round} during round {rnd}")
        if self._sampled is not None and msg.sender not in self._sampled:
            raise Rejected("unsampled", f"{msg.sender} was not sampled for round {rnd}: it owes no update")
        if msg.sender in self._seen and self.config.asynchronous is None:
            raise Rejected("duplicate", f"{msg.sender} already sent its update for round {rnd}")
        if msg.msg_id in self._recent_ids or msg.msg_id in self._previous_ids or msg.msg_id in self._async_ids:
            raise Rejected("replay", f"{msg.sender} reused message id {msg.msg_id}")
        device = self.devices[msg.sender]
        # final rounds and secure rounds (the values travel as a secure group sum, fedge.secagg): metrics only
        spec = {} if self._final or self.strategy.secure_sums else self.strategy.expected_update(device, rnd)
        if spec is None:
            raise Rejected("schema", f"the {self.config.method} coordinator declares no update schema for "
                                     f"{msg.sender} in round {rnd}")
        # The size bound comes from the update this device owes, not from the broker's limit.
        limit = max_encoded_bytes(spec, ENVELOPE_BYTES + HEADER_BYTES_PER_TENSOR * len(spec))
        if len(item.data) > limit:
            raise OversizeError(f"{msg.sender}'s update of {len(item.data)} bytes exceeds the {limit} bytes "
                                f"its round-{rnd} update can take")
        return spec
