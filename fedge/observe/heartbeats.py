"""The devices' heartbeats at the coordinator: each one checked with :func:`fedge.common.health.parse_health` and
stored on its device's record, or refused — counted by reason and logged at a bounded rate, never stored.

The fleet monitor (:mod:`fedge.observe.monitor`) owns a :class:`HealthIntake` and drains the transport's
heartbeats into it on its thread. Everything derived from a device's bytes passes :meth:`HealthIntake.add`, the
error boundary: no heartbeat, however malformed, stops the coordinator.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fedge.common.health import HEALTH_KIND, MAX_HEALTH_BYTES, HealthError, parse_health
from fedge.common.messages import Message
from fedge.common.transport import CoordinatorTransport, Inbound
from fedge.coordinator.gate import reason_of
from fedge.observe.fleetrecords import UNKNOWN, DeviceState

log = logging.getLogger(__name__)

HEALTH_LOG_EVERY_S = 60.0  # a device's refused heartbeats are logged at most this often


@dataclass
class LogThrottle:
    """At most one log line every ``every_s`` seconds; the lines held back meanwhile are counted."""

    every_s: float = HEALTH_LOG_EVERY_S
    last: float = float("-inf")
    held: int = 0

    def allow(self, now: float) -> int | None:
        """None: hold this line back (counted); else how many were held back since the last line."""
        if now - self.last < self.every_s:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held


class HealthIntake:
    """Heartbeats into ``devices`` (the monitor's records, guarded by its ``lock``); ``changed`` is called after
    each change the page shows."""

    def __init__(self, *, fleet: str, devices: Mapping[str, DeviceState], lock: threading.RLock,
                 clock: Callable[[], float], changed: Callable[[], None]) -> None:
        self.fleet = fleet
        self.devices = devices
        self._lock = lock
        self.clock = clock
        self._changed = changed
        self.refused: Counter[str] = Counter()  # reason -> heartbeats refused
        self.accepted = 0
        self._logs: dict[str, LogThrottle] = {}  # device -> its refused heartbeats' log lines
        self._stranger_log = LogThrottle()  # refused heartbeats from senders outside the fleet, all together

    def poll(self, transport: CoordinatorTransport | None) -> int:
        """Check and store the heartbeats ``transport`` received since the last call; returns how many were
        accepted. Never raises: a bad record is refused and counted."""
        if transport is None:
            return 0
        try:
            items = transport.health()
        except Exception:
            log.exception("reading heartbeats from the transport failed")
            return 0
        return sum(self.add(item) for item in items)

    def add(self, item: Inbound) -> bool:
        """Check one heartbeat; store it (True) or refuse and count it (False)."""
        origin = item.origin
        try:
            if item.reject is not None:
                raise HealthError(*item.reject)
            msg = Message.from_bytes(item.data, max_bytes=MAX_HEALTH_BYTES)
            if msg.kind != HEALTH_KIND:
                raise HealthError("kind", f"expected a health message, got a {msg.kind}")
            if origin is not None and msg.sender != origin:
                raise HealthError("spoofed", f"a health message on {origin[:64]!r}'s topic names {msg.sender[:64]!r}")
            if msg.fleet != self.fleet:
                raise HealthError("fleet", f"a health message for fleet {msg.fleet[:64]!r}")
            origin = origin or msg.sender
            if origin not in self.devices:
                raise HealthError("unauthorized", f"{origin[:64]!r} is not a device of this fleet")
            rec = parse_health(msg.info.get("health"))
        except Exception as exc:  # the error boundary: device bytes never stop the coordinator
            self._refuse(origin, reason_of(exc), getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
            return False
        with self._lock:
            dev = self.devices[origin]
            if dev.health is not None and rec.seq < dev.health.seq and rec.sent <= dev.health.sent:
                return False  # an older heartbeat overtaken by a newer one (a restarted agent counts from 1 again)
            dev.health, dev.health_at = rec, item.received or self.clock()
            self.accepted += 1
            self._changed()
        return True

    def _refuse(self, origin: str | None, reason: str, message: str) -> None:
        key = f"health-{reason}"
        now = self.clock()
        with self._lock:
            self.refused[key] += 1
            dev = self.devices.get(origin) if origin else None
            if dev is not None:
                dev.health_refused[key] += 1
            # One line per device per minute, and one per minute for all senders outside the fleet together:
            # a device (or a stranger cycling through names) sending garbage every second must not flood the log.
            throttle = self._logs.setdefault(dev.device_id, LogThrottle()) if dev is not None else self._stranger_log
            held = throttle.allow(now)
        if held is None:
            return
        more = f" ({held} more since the last such line)" if held else ""
        # a stranger's name comes from its topic: quoted, so a newline in it cannot forge a log line
        who = dev.device_id if dev is not None else repr(origin[:64]) if origin else UNKNOWN
        log.warning("refused a heartbeat from %s (%s): %s%s", who, key, message[:300], more)
