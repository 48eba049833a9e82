"""The fleet's energy in virtual time: what each device's work and idling cost, per round and up to a moment.

A piece of work costs the joules the clock charged it (:meth:`fedge.fleet.clock.DeviceClock.task_j`: compute at the
profile's busy power, transfers at idle power plus the radio per byte); a device online without work draws its idle
power; offline it draws nothing. A device whose profile has no ``[power]`` table has no joules (None), and the
fleet's totals leave it out (``devices_without_power`` says how many). A task counts in full from its start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fedge.common.selection import SystemFacts
from fedge.fleet.clock import FleetClock, RoundTime


def idle_j(clock: FleetClock, device_id: str, t0: float, t1: float) -> float | None:
    """Joules ``device_id`` idled between ``t0`` and ``t1``: online, not working (None: no ``[power]``)."""
    c = clock.devices[device_id]
    if c.power is None or t1 <= t0:
        return None if c.power is None else 0.0
    online = c.availability.online_share(t0, t1) * (t1 - t0)
    return c.power.idle_j(online - clock.busy_within(device_id, t0, t1))


def device_j(clock: FleetClock, device_id: str, until: float | None = None) -> float | None:
    """Joules ``device_id`` spent from the start up to ``until`` (default: the run's end): its tasks started
    before then and its idling (None: no ``[power]``)."""
    t = clock.now if until is None else until
    idle = idle_j(clock, device_id, 0.0, t)
    if idle is None:
        return None
    return idle + sum(w.joules or 0.0 for w, _ in clock.work(device_id) if w.start_s < t)


def battery_left_j(clock: FleetClock, device_id: str, at: float | None = None) -> float | None:
    """Charge left in ``device_id``'s battery at ``at`` (default now), J: its capacity less what it spent (None:
    mains powered, or no ``[power]``)."""
    power = clock.devices[device_id].power
    cap = None if power is None else power.battery_j
    if cap is None:
        return None
    spent = device_j(clock, device_id, clock.now if at is None else at) or 0.0
    return cap - spent


def round_j(clock: FleetClock, rnd: RoundTime) -> dict[str, float]:
    """Each device's joules in one round: its task of the round, if any, and its idling over the round's span (only
    devices with a ``[power]`` model)."""
    out = {}
    for dev in clock.devices:
        idle = idle_j(clock, dev, rnd.start_s, rnd.end_s)
        if idle is None:
            continue
        rec = rnd.devices.get(dev)
        out[dev] = idle + ((rec.joules or 0.0) if rec is not None else 0.0)
    return out


def fleet_j(clock: FleetClock, until: float | None = None) -> float:
    """The fleet's joules up to ``until`` (default: the run's end), over the devices with a ``[power]`` model."""
    return sum(j for dev in clock.devices if (j := device_j(clock, dev, until)) is not None)


def task_j(clock: FleetClock, until: float | None = None) -> float:
    """The joules of the fleet's work alone (no idling) up to ``until``: what the tasks the run handed out cost."""
    t = clock.now if until is None else until
    return sum(w.joules or 0.0 for dev in clock.devices for w, _ in clock.work(dev) if w.start_s < t)


def without_power(clock: FleetClock) -> int:
    """Devices whose profile has no ``[power]`` model (left out of every total)."""
    return sum(c.power is None for c in clock.devices.values())


def selection_facts(clock: FleetClock, rnd: int, moved: Mapping[str, tuple[int, int]]) -> dict[str, SystemFacts]:
    """What ``selection = "oort"`` / ``"energy"`` knows of each device at round ``rnd``'s start: its task's expected
    seconds and joules (the clock without jitter: a coordinator knows the model, not the dice), with the bytes
    ``moved`` in its last task (down, up; none yet: the link's round trip only), and its battery's charge now."""
    out = {}
    for dev, c in clock.devices.items():
        down, up = moved.get(dev, (0, 0))
        t = dataclasses.replace(c, jitter=0.0).timing(rnd, bytes_down=down, bytes_up=up, work=c.work)
        out[dev] = SystemFacts(t.total_s, c.task_j(t, bytes_down=down, bytes_up=up), battery_left_j(clock, dev),
                               c.power.floor_j if c.power is not None else 0.0)
    return out
