"""The fleet's energy in virtual time: what each device's work and idling cost, per round and up to a moment.

A piece of work costs the joules the clock charged it (:meth:`fedge.fleet.clock.DeviceClock.task_j`: compute at the
profile's busy power, transfers at idle power plus the radio per byte); a device online without work draws its idle
power; offline it draws nothing. A device whose profile has no ``[power]`` table has no joules (None), and the
fleet's totals leave it out (``devices_without_power`` says how many). A task counts in full from its start.

:class:`EnergyLedger` reads a clock as it stands (a finished run's report asks it many questions: it keeps each
device's list of work); :func:`selection_facts` asks a live one at a round's start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fedge.common.heat import HeatReading
from fedge.common.selection import SystemFacts
from fedge.fleet.clock import DeviceClock, DeviceRound, FleetClock, RoundTime

THROTTLED_NOW = 0x6
"""The flags a simulated device's firmware reports while it throttles: frequency capped and throttled (bits 1, 2)."""


class EnergyLedger:
    """Joules of a fleet clock's devices, as the clock stands now (make a new one after the clock moves on)."""

    def __init__(self, clock: FleetClock) -> None:
        self.clock = clock
        self._work: dict[str, list[tuple[DeviceRound, float]]] = {}

    def work(self, device_id: str) -> list[tuple[DeviceRound, float]]:
        """:meth:`FleetClock.work`, read once per device."""
        if device_id not in self._work:
            self._work[device_id] = self.clock.work(device_id)
        return self._work[device_id]

    def idle_j(self, device_id: str, t0: float, t1: float) -> float | None:
        """Joules ``device_id`` idled between ``t0`` and ``t1``: online, not working (None: no ``[power]``)."""
        c = self.clock.devices[device_id]
        if c.power is None:
            return None
        if t1 <= t0:
            return 0.0
        online = c.availability.online_share(t0, t1) * (t1 - t0)
        busy = sum(max(0.0, min(stop, t1) - max(w.start_s, t0)) for w, stop in self.work(device_id))
        return c.power.idle_j(online - busy)

    def device_j(self, device_id: str, until: float | None = None) -> float | None:
        """Joules ``device_id`` spent from the start up to ``until`` (default: the run's end): its tasks started
        before then and its idling (None: no ``[power]``)."""
        t = self.clock.now if until is None else until
        idle = self.idle_j(device_id, 0.0, t)
        if idle is None:
            return None
        return idle + sum(w.joules or 0.0 for w, _ in self.work(device_id) if w.start_s < t)

    def battery_left_j(self, device_id: str, at: float | None = None) -> float | None:
        """Charge left in ``device_id``'s battery at ``at`` (default now), J: its capacity less what it spent
        (None: mains powered, or no ``[power]``)."""
        power = self.clock.devices[device_id].power
        cap = None if power is None else power.battery_j
        if cap is None:
            return None
        return cap - (self.device_j(device_id, self.clock.now if at is None else at) or 0.0)

    def round_j(self, rnd: RoundTime) -> dict[str, float]:
        """Each device's joules in one round: its task of the round, if any, and its idling over the round's span
        (only devices with a ``[power]`` model)."""
        out = {}
        for dev in self.clock.devices:
            idle = self.idle_j(dev, rnd.start_s, rnd.end_s)
            if idle is None:
                continue
            rec = rnd.devices.get(dev)
            out[dev] = idle + ((rec.joules or 0.0) if rec is not None else 0.0)
        return out

    def fleet_j(self, until: float | None = None) -> float:
        """The fleet's joules up to ``until`` (default: the run's end), over the devices with a ``[power]`` model."""
        return sum(j for dev in self.clock.devices if (j := self.device_j(dev, until)) is not None)

    def task_j(self, until: float | None = None) -> float:
        """The joules of the fleet's work alone (no idling) up to ``until``: what the tasks handed out cost."""
        t = self.clock.now if until is None else until
        return sum(w.joules or 0.0 for dev in self.clock.devices for w, _ in self.work(dev) if w.start_s < t)

    def without_power(self) -> int:
        """Devices whose profile has no ``[power]`` model (left out of every total)."""
        return sum(c.power is None for c in self.clock.devices.values())


def selection_facts(clock: FleetClock, rnd: int, moved: Mapping[str, tuple[int, int]]) -> dict[str, SystemFacts]:
    """What ``selection = "oort"`` / ``"energy"`` knows of each device at round ``rnd``'s start: its task's expected
    seconds and joules (the clock without jitter: a coordinator knows the model, not the dice), with the bytes
    ``moved`` in its last task (down, up; none yet: the link's round trip only), and its battery's charge now."""
    ledger = EnergyLedger(clock)
    out = {}
    for dev, c in clock.devices.items():
        down, up = moved.get(dev, (0, 0))
        t = dataclasses.replace(c, jitter=0.0).timing(rnd, bytes_down=down, bytes_up=up, work=c.work, start=clock.now)
        out[dev] = SystemFacts(t.total_s, c.task_j(t, bytes_down=down, bytes_up=up), ledger.battery_left_j(dev),
                               c.power.floor_j if c.power is not None else 0.0, heat_reading(c, clock.now))
    return out


def heat_reading(c: DeviceClock, now: float) -> HeatReading | None:
    """What the thermal guard (:class:`fedge.common.heat.HeatGuard`) knows of ``c`` now, as a real device's heartbeat
    would tell it: its temperature and, while its firmware throttles it, the Pi's flags (None: no thermal model)."""
    temp, th = c.temperature(now), c.thermal
    if temp is None or th is None:
        return None
    return HeatReading(temp, th.limits, flags=THROTTLED_NOW if c.throttled(now) else 0)
