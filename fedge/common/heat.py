"""When a device is too hot: the one decision, with hysteresis, that the simulation and the coordinator both make.

A device is **hot** once its temperature reaches ``limit_c`` (a profile's ``[thermal] limit_c``; a Raspberry Pi's
firmware caps its clock from its soft limit, 80 °C by default) or, on a Pi, once the firmware says it is capping or
throttling its clock now (:data:`THROTTLING_NOW`); it stays hot until it has **cooled** below ``resume_c``
(``[thermal] resume_c``, default ``limit_c`` − :data:`RESUME_BELOW_C`) with no such flag. Without the gap a device
near its limit would flap between hot and cool on every reading.

Three readers:

* the virtual clock's firmware (:meth:`fedge.fleet.clock.DeviceClock.throttled`): a hot device computes at its
  ``throttle_share`` of its speed (:func:`hot_after`);
* the thermal guard of ``selection = "oort"`` / ``"energy"`` and of asynchronous mode's task assignment
  (``[coordinator] thermal_guard``; :meth:`fedge.coordinator.engine.RoundEngine.thermal_hold`), in simulation and
  over MQTT alike (:class:`HeatGuard`, kept by :class:`fedge.coordinator.selecting.Selector`): a hot device is not
  tasked until it has cooled. It reads what a heartbeat says (``cpu_temp_c``, ``throttled``:
  :mod:`fedge.common.health`), over MQTT from the devices, in simulation from the virtual clock's thermal model. It
  does not predict: a guard that also held a device whose next task would take it to its limit held the slowest
  devices far more often and cost accuracy for nothing (docs/results.md, "The thermal guard").

Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.common.health import HEARTBEAT_S
from fedge.errors import ConfigError

DEFAULT_LIMIT_C = 80.0
"""A device's limit when its profile has no ``[thermal]`` table: a Raspberry Pi's default soft limit (Raspberry Pi's
documentation, "Frequency management and thermal control")."""
RESUME_BELOW_C = 5.0
"""``resume_c``'s default: this many °C below ``limit_c``."""
THROTTLING_NOW = 0b1110
"""The Pi firmware's flags (``get_throttled``) that say it is slowing the ARM now: frequency capped (bit 1),
throttled (bit 2), soft temperature limit (bit 3). Under-voltage (bit 0) is the supply's fault, not heat, and the
"occurred" bits (16-19) only remember the past."""


STALE_AFTER_BEATS = 3
"""A heartbeat older than this many heartbeat intervals says nothing of the device's heat now."""
HEAT_MAX_AGE_S = STALE_AFTER_BEATS * HEARTBEAT_S
"""The coordinator's bound on a heartbeat's age for the thermal guard over a network (30 s: three of the devices'
default 10 s heartbeats; ``fedge coordinator run --heat-max-age``). Past it the reading is **unknown**: the device
is neither held as hot nor known to be cool, and the guard forgets that it was hot (a later fresh reading starts
again from ``limit_c``). Holding it on a stale reading would hold a device whose heartbeats are lost (a congested
link, a restarted agent) for good; silence itself is offline detection's business (the broker's last will), not
the guard's."""


@dataclass(frozen=True)
class HeatLimits:
    """Where a device becomes hot (``limit_c``) and where it has cooled again (``resume_c``, below it; None:
    ``limit_c`` − :data:`RESUME_BELOW_C`). ``where`` names the table in errors (e.g. ``thermal``)."""

    limit_c: float = DEFAULT_LIMIT_C
    resume_c: float | None = None
    where: str = "thermal"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.limit_c) and -50 < self.limit_c <= 150):
            raise ConfigError(f"{self.where}.limit_c = {self.limit_c:g}: must be a temperature in (-50, 150] °C",
                              hint="the temperature at which the device throttles, e.g. 80")
        r = self.resume_c
        if r is not None and not (math.isfinite(r) and r < self.limit_c):
            raise ConfigError(f"{self.where}.resume_c = {r:g}: must be below limit_c = {self.limit_c:g}",
                              hint=f"the temperature a hot device must cool below before it is tasked again, e.g. "
                                   f"{self.limit_c - RESUME_BELOW_C:g} (leave it out: limit_c - {RESUME_BELOW_C:g})")

    @property
    def resume(self) -> float:
        """``resume_c``, resolved."""
        return self.limit_c - RESUME_BELOW_C if self.resume_c is None else self.resume_c


def throttling(flags: int | None) -> bool:
    """Whether a Pi's firmware flags say it is slowing its clock now (:data:`THROTTLING_NOW`)."""
    return bool(flags and flags & THROTTLING_NOW)


def hot_after(was_hot: bool, temp_c: float | None, limits: HeatLimits, *, flags: int | None = None) -> bool:
    """Whether a device is hot now: it reached ``limit_c`` or its firmware throttles; or it was hot and has not yet
    cooled below ``resume_c`` with the flags clear."""
    if throttling(flags):
        return True
    if temp_c is not None and temp_c >= limits.limit_c:
        return True
    if not was_hot:
        return False
    # cooled: below resume_c (a device with no temperature reading cools when its flags clear)
    return temp_c is not None and temp_c >= limits.resume


@dataclass(frozen=True)
class HeatReading:
    """What is known of one device's heat now (what its heartbeat says): its temperature, a Pi's firmware flags, and
    its limits."""

    temp_c: float | None
    limits: HeatLimits
    flags: int | None = None
    stale: str = ""
    """Why the reading is too old to say anything of the device's heat now (:data:`HEAT_MAX_AGE_S`); empty: it is
    fresh."""


class HeatGuard:
    """The thermal guard's memory: which devices are hot, from one reading to the next (the hysteresis)."""

    def __init__(self) -> None:
        self.hot: set[str] = set()

    def judge(self, device_id: str, reading: HeatReading | None) -> str:
        """Why ``device_id`` is too hot to task now (empty: it is not), remembering the answer. No reading (a device
        that never sent a heartbeat) or a stale one (``reading.stale``): not hot, and no longer remembered as hot."""
        if reading is None:
            return ""
        if reading.stale:
            self.hot.discard(device_id)
            return ""
        was = device_id in self.hot
        lim = reading.limits
        if not hot_after(was, reading.temp_c, lim, flags=reading.flags):
            self.hot.discard(device_id)
            return ""
        self.hot.add(device_id)
        temp = "no temperature" if reading.temp_c is None else f"{reading.temp_c:.1f} °C"
        if throttling(reading.flags):
            assert reading.flags is not None
            return f"hot: its firmware throttles (flags {reading.flags:#x}) at {temp}"
        if reading.temp_c is not None and reading.temp_c >= lim.limit_c:
            return f"hot: {temp}, at or above its limit of {lim.limit_c:g} °C"
        return f"hot: {temp}, not yet cooled below {lim.resume:g} °C"
