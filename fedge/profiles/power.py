"""A profile's energy model (``[power]``): board power idle and busy, radio energy per byte, a battery.

Joules are power × time (docs/profiles.md, "The energy model")::

    task   = busy_w × compute_s + idle_w × (download_s + upload_s)
             + up_uj_per_byte × bytes_up + down_uj_per_byte × bytes_down      (µJ → J)
    idle   = idle_w × the seconds the device is online and not working
    offline: 0 W (powered down, or out of reach and not counted)

``busy_w`` is the whole board with every core loaded (stress-ng / training), ``idle_w`` the board idle on its link,
both at the supply. A transfer keeps the board at idle power and adds the radio's marginal energy per byte: the
per-byte figures of :data:`LINKS` are the slopes of published power models (the board's idle already holds the
radio's baseline). Each built-in profile cites where its figures come from; a user's profile sets its own.

A battery device (``battery_wh > 0``) starts full and drains by the joules above; ``floor_wh`` is the charge it must
keep (``selection = "energy"`` never gives it a task that would take it below).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

from fedge.errors import ProfileError

JOULES_PER_WH = 3600.0

# Link kind -> (uplink, downlink) radio energy per byte in µJ, and where the figures come from. The marginal energy of
# moving a byte, above the board's idle power (which a transfer's seconds are charged at).
LINKS: dict[str, tuple[float, float, str]] = {
    "ethernet": (0.03, 0.03, "estimate: a 1000BASE-T PHY's ~0.5 W at 1 Gbit/s is ~4 nJ/bit; Energy-Efficient "
                             "Ethernet idles lower (IEEE 802.3az), so this errs high"),
    "wifi": (2.27, 1.10, "Huang et al., MobiSys 2012 (4G LTE power model), Wi-Fi: 283.17 mW/Mbit/s up, "
                         "137.01 mW/Mbit/s down"),
    "lte": (3.51, 0.42, "Huang et al., MobiSys 2012, LTE: 438.39 mW/Mbit/s up, 51.97 mW/Mbit/s down"),
    "lte-m": (15.4, 3.0, "estimate from a Cat-M1 module's datasheet currents (Quectel BG96: ~190 mA at 3.8 V "
                         "transmitting, ~0.72 W, at ~375 kbit/s up; receiving ~1/5 of it per byte)"),
}


def _check(ok: bool, key: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ProfileError(f"power.{key} = {shown}: {problem}", hint=fix)


def _non_negative(key: str, value: float, fix: str) -> None:
    _check(math.isfinite(value) and value >= 0, key, value, "must be a finite number >= 0", fix)


@dataclass(frozen=True)
class Power:
    """``[power]``: what the board draws and what its link costs per byte; a battery, when it runs on one."""

    idle_w: float
    """Board power idle on its link, W (at the supply)."""
    busy_w: float
    """Board power with every core training, W."""
    link: str
    """Link kind for the radio energy per byte (:data:`LINKS`): ethernet, wifi, lte, lte-m."""
    up_uj_per_byte: float | None = None
    """Radio energy per uploaded byte, µJ (default: the link kind's)."""
    down_uj_per_byte: float | None = None
    """Radio energy per downloaded byte, µJ (default: the link kind's)."""
    battery_wh: float = 0.0
    """Battery capacity, Wh (0: mains powered)."""
    floor_wh: float = 0.0
    """Charge a battery device keeps, Wh: never tasked when a task would take it below."""

    def __post_init__(self) -> None:
        _non_negative("idle_w", self.idle_w, "give the board's idle power in W, e.g. 2.7")
        _non_negative("busy_w", self.busy_w, "give the board's power with every core loaded in W, e.g. 6.4")
        _check(self.busy_w >= self.idle_w, "busy_w", self.busy_w, f"is below idle_w = {self.idle_w:g}",
               "busy_w is the board with every core training: at least its idle power")
        if self.link not in LINKS:
            close = difflib.get_close_matches(self.link, LINKS, n=1)
            _check(False, "link", self.link, "unknown link kind",
                   f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(LINKS)}")
        for key in ("up_uj_per_byte", "down_uj_per_byte"):
            v = getattr(self, key)
            if v is not None:
                _non_negative(key, v, "give the radio's energy per byte in µJ (or leave it out: the link's)")
        _non_negative("battery_wh", self.battery_wh, "give the battery's capacity in Wh (0: mains powered)")
        _non_negative("floor_wh", self.floor_wh, "give the charge the battery keeps in Wh")
        _check(not self.floor_wh or self.battery_wh > 0, "floor_wh", self.floor_wh,
               "is set but the device has no battery (battery_wh = 0)", "set battery_wh, or drop floor_wh")
        _check(self.floor_wh < self.battery_wh or not self.battery_wh, "floor_wh", self.floor_wh,
               f"is not below the battery's capacity (battery_wh = {self.battery_wh:g})",
               "the floor is the charge kept in reserve: lower it below battery_wh")

    @property
    def up_j_per_byte(self) -> float:
        uj = LINKS[self.link][0] if self.up_uj_per_byte is None else self.up_uj_per_byte
        return uj * 1e-6

    @property
    def down_j_per_byte(self) -> float:
        uj = LINKS[self.link][1] if self.down_uj_per_byte is None else self.down_uj_per_byte
        return uj * 1e-6

    @property
    def battery_j(self) -> float | None:
        """The battery's capacity in J (None: mains powered)."""
        return self.battery_wh * JOULES_PER_WH if self.battery_wh else None

    @property
    def floor_j(self) -> float:
        return self.floor_wh * JOULES_PER_WH

    def task_j(self, *, compute_s: float, transfer_s: float, bytes_up: int, bytes_down: int) -> float:
        """Joules of one piece of work: compute at busy power, transfers at idle power plus the radio per byte."""
        return (self.busy_w * compute_s + self.idle_w * transfer_s
                + self.up_j_per_byte * bytes_up + self.down_j_per_byte * bytes_down)

    def estimate_w(self, cpu_share: float) -> float:
        """The board's power with ``cpu_share`` (0-1) of its cores busy: idle plus that share of busy − idle (a
        live estimate from a heartbeat's CPU use; a load on part of the cores draws about that part)."""
        return self.idle_w + (self.busy_w - self.idle_w) * min(1.0, max(0.0, cpu_share))

    def idle_j(self, seconds: float) -> float:
        """Joules of ``seconds`` online without work."""
        return self.idle_w * max(0.0, seconds)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"idle_w": self.idle_w, "busy_w": self.busy_w, "link": self.link}
        for key in ("up_uj_per_byte", "down_uj_per_byte"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.battery_wh:
            d["battery_wh"] = self.battery_wh
            d["floor_wh"] = self.floor_wh
        return d
