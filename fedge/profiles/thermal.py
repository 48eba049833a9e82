"""A profile's thermal model (``[thermal]``, optional): how the board heats with its power and when it throttles.

First order (one thermal mass, one resistance to the air), the board's power from its ``[power]`` table::

    T(t + s) = T_ss + (T(t) − T_ss) × exp(−s ÷ tau_s),     T_ss = ambient_c + c_per_w × P

with ``P`` the busy power while it computes and the idle power otherwise. At or above ``limit_c`` the firmware
throttles: the device computes at ``throttle_share`` of its speed (a Raspberry Pi's firmware caps the ARM clock from
its soft limit, 80 °C on a Pi 4 or 5, 60 °C configurable: Raspberry Pi's documentation, "Frequency management and
thermal control") until it has cooled below ``resume_c`` (default ``limit_c`` − 5 °C): the hysteresis of
:mod:`fedge.common.heat`, the same decision the thermal guard makes over MQTT. The figures depend on the enclosure
and the cooling more than on the board, so no built-in profile has this table: a user's profile sets its own
(measured, e.g., from the heartbeat's temperature under load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedge.common.heat import HeatLimits
from fedge.errors import ConfigError, ProfileError


def _check(ok: bool, key: str, value: float, problem: str, fix: str) -> None:
    if not ok:
        raise ProfileError(f"thermal.{key} = {value:g}: {problem}", hint=fix)


@dataclass(frozen=True)
class Thermal:
    """``[thermal]``: the first-order model above."""

    c_per_w: float
    """Steady-state rise above the air per watt of board power, °C/W."""
    tau_s: float
    """Time constant, s."""
    limit_c: float
    """Temperature at which the firmware throttles, °C."""
    throttle_share: float = 0.6
    """Share of its speed a throttled device computes at."""
    ambient_c: float = 25.0
    """The air around the board, °C; also where a run starts."""
    resume_c: float | None = None
    """Below this a hot (throttled) device has cooled, °C (None: ``limit_c`` − 5; :mod:`fedge.common.heat`)."""

    def __post_init__(self) -> None:
        _check(math.isfinite(self.c_per_w) and self.c_per_w > 0, "c_per_w", self.c_per_w, "must be > 0",
               "°C of steady-state rise per W of board power, e.g. 8")
        _check(math.isfinite(self.tau_s) and self.tau_s > 0, "tau_s", self.tau_s, "must be > 0 seconds",
               "the board's thermal time constant in s, e.g. 120")
        _check(math.isfinite(self.ambient_c) and -50 <= self.ambient_c <= 80, "ambient_c", self.ambient_c,
               "must be between -50 and 80 °C", "the air around the board, e.g. 25")
        _check(math.isfinite(self.limit_c) and self.limit_c > self.ambient_c, "limit_c", self.limit_c,
               f"must be above ambient_c = {self.ambient_c:g}", "the throttling temperature, e.g. 80")
        _check(0 < self.throttle_share <= 1, "throttle_share", self.throttle_share, "must be in (0, 1]",
               "the share of its speed a throttled device keeps, e.g. 0.6")
        try:
            self.limits  # noqa: B018  (resume_c below limit_c)
        except ConfigError as exc:
            raise ProfileError(exc.message, hint=exc.hint) from exc

    @property
    def limits(self) -> HeatLimits:
        """Where it becomes hot and where it has cooled (:mod:`fedge.common.heat`)."""
        return HeatLimits(self.limit_c, self.resume_c)

    def after(self, temp_c: float, power_w: float, seconds: float) -> float:
        """The temperature ``seconds`` later at ``power_w``, from ``temp_c``."""
        steady = self.ambient_c + self.c_per_w * power_w
        return steady + (temp_c - steady) * math.exp(-max(0.0, seconds) / self.tau_s)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"c_per_w": self.c_per_w, "tau_s": self.tau_s, "limit_c": self.limit_c,
                               "throttle_share": self.throttle_share, "ambient_c": self.ambient_c}
        return out if self.resume_c is None else out | {"resume_c": self.resume_c}
