"""The coordinator's book of device statuses and of its own connection's outages: who is offline.

A device's retained ``status`` says ``online`` or ``offline`` (its last-will). An ``offline`` is
believed only once it is ``offline_confirm_s`` old, and not at all while it falls in the window of an
outage of the coordinator's own connection — from ``offline_confirm_s`` before the outage began until
``status_grace_s`` after it ended: a broker that shuts down publishes every device's last-will just
before it drops the coordinator (and, with persistence, keeps those statuses across the restart), so
those ``offline`` statuses count only once the devices have had the grace period to come back.

No paho, no broker and no lock (the transport holds its own around every call); time comes from
``clock``, so a test runs it on a fake one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class StatusBook:
    """Each device's latest status, the recent outages of our own connection, and what they make believable."""

    def __init__(self, offline_confirm_s: float, status_grace_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.offline_confirm_s = offline_confirm_s
        self.status_grace_s = status_grace_s
        self.clock = clock
        self._status: dict[str, tuple[bool, float]] = {}  # device id -> (online, time received)
        # devices whose latest status is ``offline``: what :meth:`offline` looks at, so that asking (the engine
        # asks twice per round or version) costs the offline devices, not the fleet
        self._down: set[str] = set()
        # Recent outages of our own connection: [start, end], end None while it lasts (a list: a second drop
        # soon after a reconnection must not make the first one's last-wills believable).
        self._outages: list[list[float | None]] = []

    def record(self, device_id: str, online: bool) -> None:
        """A status message from ``device_id`` arrived now."""
        self._status[device_id] = (online, self.clock())
        if online:
            self._down.discard(device_id)
        else:
            self._down.add(device_id)

    def connection_lost(self) -> None:
        """Our own connection to the broker dropped: an outage begins (unless one is already going on)."""
        now = self.clock()
        grace = self.status_grace_s
        self._outages = [o for o in self._outages if o[1] is None or o[1] + grace > now]
        if not self._outages or self._outages[-1][1] is not None:
            self._outages.append([now, None])

    def connection_back(self) -> None:
        """Our own connection is up again: the current outage, if any, ends now."""
        if self._outages and self._outages[-1][1] is None:
            self._outages[-1][1] = self.clock()

    def offline(self) -> set[str]:
        """Devices whose latest status is a believable ``offline`` (see the module's docstring)."""
        gone = self._offline_test()
        return {d for d in self._down if gone(d)}

    def all_offline(self, devices: Iterable[str]) -> bool:
        """Whether every one of ``devices`` is in :meth:`offline` — stopping at the first that is not, where
        :meth:`offline` looks at every device (the coordinator asks whenever it has no update to hand over)."""
        gone = self._offline_test()
        return all(gone(d) for d in devices)

    def _offline_test(self) -> Callable[[str], bool]:
        """A test of one device id against the outage windows in force now."""
        now = self.clock()
        confirm, grace = self.offline_confirm_s, self.status_grace_s
        # (from, to) windows still in force: [start - confirm, end + grace] while now < end + grace
        windows = []
        for start, end in self._outages:
            assert start is not None
            to = float("inf") if end is None else end + grace
            if now < to:
                windows.append((start - confirm, to))
        status = self._status

        def gone(device_id: str) -> bool:
            seen = status.get(device_id)
            if seen is None:
                return False
            up, at = seen
            return not up and now - at >= confirm and not any(lo <= at <= hi for lo, hi in windows)

        return gone

    def online(self) -> set[str]:
        """Devices whose latest status is ``online``."""
        return {d for d, (up, _) in self._status.items() if up}
