"""Client sampling for synchronous rounds: ``[coordinator] sample`` and ``selection`` (issue 27, item 3).

Which devices train in a round is a pure function of the run's seed, the round number and the
candidates, so a coordinator that restarts mid-run samples the same devices again, and a simulation
repeats exactly. A device not sampled gets no work: the round descriptor lists the sampled devices
(``round.sampled``), a device not listed sends nothing, and the engine expects, waits for and
accepts updates only from the listed ones.

* ``uniform``: ``k`` devices uniformly from every registered device, online or not (an offline
  device that is drawn misses the round, as in FedAvg with drop-outs);
* ``available``: ``k`` uniformly from the devices online at the round's start;
* ``balanced``: ``k`` from the online devices, spread as evenly as possible over their profiles
  (each profile gets ``k ÷ profiles`` slots, the remainder going to profiles drawn at random; a
  profile with too few devices online gives its slots to the others);
* ``oort`` and ``energy``: ``k`` from the online devices by a utility from what they reported, their speed and
  their energy (:mod:`fedge.common.selection`; the coordinator gathers the facts, :mod:`fedge.coordinator.selecting`).

Shared by the fleet config (checked when it loads) and the coordinator (which samples): plain Python
and numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.common.asyncmode import AsyncSettings
from fedge.common.selection import UTILITY_KEYS, UTILITY_SELECTIONS, UtilitySettings
from fedge.errors import ConfigError

SELECTIONS: dict[str, str] = {
    "uniform": "uniformly from every registered device, online or not",
    "available": "uniformly from the devices online at the round's start",
    "balanced": "from the online devices, spread evenly over their profiles",
    **UTILITY_SELECTIONS,
}
SAMPLING_KEYS = ("sample", "selection", *UTILITY_KEYS)


@dataclass(frozen=True)
class Sampling:
    """How many devices train per round (``sample``: a fraction in (0, 1] or a count >= 1) and how they
    are chosen (``selection``); ``fleet_size`` is the number of devices of the fleet config."""

    sample: float | int
    selection: str = "available"
    fleet_size: int = 0
    seed: int = 0
    utility: UtilitySettings = field(default_factory=UtilitySettings)
    """``oort`` / ``energy``: exploration, preferred round duration, straggler penalty."""

    def __post_init__(self) -> None:
        s = self.sample
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s <= 0:
            raise ConfigError(f"[coordinator] sample = {s!r}: must be a fraction in (0, 1] or a device count >= 1",
                              hint="e.g. sample = 0.1 (10 % of the fleet per round) or sample = 20 (devices)")
        if isinstance(s, float) and s > 1:
            raise ConfigError(f"[coordinator] sample = {s:g}: a fraction must be at most 1",
                              hint=f"write a count as an integer (sample = {round(s)}) or a fraction <= 1")
        if isinstance(s, int) and self.fleet_size and s > self.fleet_size:
            raise ConfigError(f"[coordinator] sample = {s}: more devices than the fleet's {self.fleet_size}",
                              hint=f"sample at most {self.fleet_size} devices, or a fraction such as 0.1")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"[coordinator] selection = {self.selection!r}: unknown selection",
                              hint="use " + "; ".join(f"{k!r} ({v})" for k, v in SELECTIONS.items()))

    @property
    def count(self) -> int:
        """Devices per round: a count as given, a fraction of the fleet rounded (at least 1)."""
        if isinstance(self.sample, int):
            return self.sample
        return max(1, round(self.sample * self.fleet_size))

    @property
    def full(self) -> bool:
        """Whether every candidate trains every round (the count covers the fleet): no sampling at all."""
        return self.count >= self.fleet_size

    def choose(self, rnd: int, registered: Mapping[str, str], online: Iterable[str]) -> list[str]:
        """The devices that train in round ``rnd``, sorted.

        ``registered`` maps every registered device to its profile, ``online`` names those online now.
        Deterministic in (seed, round, the candidates' ids and profiles), whatever their order. ``oort`` and
        ``energy`` need what the devices reported: :func:`fedge.common.selection.select`.
        """
        if self.selection in UTILITY_SELECTIONS:
            raise ValueError(f"selection {self.selection!r} chooses from the devices' facts: use selection.select")
        rng = np.random.default_rng([self.seed & 0xFFFF_FFFF, rnd, 0x5A4D])
        pool = sorted(registered) if self.selection == "uniform" else sorted(set(online) & set(registered))
        k = min(self.count, len(pool))
        if self.selection != "balanced":
            return sorted(pool[i] for i in rng.choice(len(pool), size=k, replace=False))
        by_profile: dict[str, list[str]] = {}
        for d in pool:
            by_profile.setdefault(registered[d], []).append(d)
        for devices in by_profile.values():  # each profile's devices in a random order
            rng.shuffle(devices)
        profiles = sorted(by_profile)
        rng.shuffle(profiles)  # who gets the remainder
        chosen: list[str] = []
        while len(chosen) < k:
            # one pass: every profile with devices left gives one, in the shuffled order, until k are chosen
            for p in profiles:
                if by_profile[p] and len(chosen) < k:
                    chosen.append(by_profile[p].pop())
        return sorted(chosen)


def thermal_guarded(sampling: Sampling | None, asynchronous: AsyncSettings | None) -> bool:
    """Whether ``[coordinator] thermal_guard`` is on: a key of the utility selections in synchronous rounds, of task
    assignment in asynchronous mode (:mod:`fedge.common.heat`)."""
    if asynchronous is not None:
        return asynchronous.thermal_guard
    return sampling is not None and sampling.utility.thermal_guard


def parse_sampling(table: Mapping[str, Any], *, fleet_size: int, seed: int, source: str = "") -> Sampling | None:
    """The ``sample`` / ``selection`` keys of a ``[coordinator]`` table (None: every device, every round)."""
    if "sample" not in table:
        if table.get("thermal_guard") is not None and table.get("mode", "sync") != "async":
            raise ConfigError(f"{source}: [coordinator] thermal_guard without sample: in synchronous rounds the guard "
                              'is a key of selection = "oort" or "energy"',
                              hint='add sample and selection = "oort" (or "energy"), or mode = "async" (the guard '
                                   "then holds hot devices out of task assignment), or drop thermal_guard")
        if "selection" in table:
            raise ConfigError(f"{source}: [coordinator] selection = {table['selection']!r} without sample",
                              hint="add sample = 0.1 (a fraction of the fleet) or a count, or drop selection")
        return None
    sel = table.get("selection", "available")
    if not isinstance(sel, str):
        raise ConfigError(f"{source}: [coordinator] selection must be a string, got {sel!r}",
                          hint=f"use one of {', '.join(SELECTIONS)}")
    given = {k: table[k] for k in UTILITY_KEYS if table.get(k) is not None}
    try:
        if given and sel not in UTILITY_SELECTIONS:
            key = next(iter(given))
            raise ConfigError(f"[coordinator] {key} = {given[key]!r} applies to selection = \"oort\" or \"energy\", "
                              f"not {sel!r}", hint=f"drop {key}, or set selection = \"oort\" or \"energy\"")
        return Sampling(table["sample"], sel, fleet_size=fleet_size, seed=seed, utility=UtilitySettings(**given))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.message}" if source else exc.message, hint=exc.hint) from exc
