"""Selection that knows time and energy: ``[coordinator] selection = "oort"`` and ``"energy"`` (issue 44).

Both rank the online devices by a utility and explain every decision (:class:`Choice.why`, the round report's
``selection``). Deterministic in (seed, round, the candidates and their facts), whatever their order.

* ``oort`` (Lai et al., "Oort: Efficient Federated Learning via Guided Participant Selection", OSDI 2021): a
  device's *statistical utility* is its training samples × its last reported training loss (Oort uses
  |B| × sqrt(mean of squared per-sample losses); a device reports its mean loss, the stand-in here), times a
  *system penalty* (T ÷ t)^α when its expected task time t exceeds the round's preferred duration T
  (``preferred_round_s``; 0: the median of the candidates' expected times) with α ``straggler_penalty``. A share
  ``explore`` of the slots goes to devices that never trained (their utility is unknown), drawn at random; the
  rest are drawn, with probability ∝ utility, among the devices whose utility is at least :data:`CUTOFF` × the
  k-th highest (Oort's cut-off exploitation).
* ``energy``: the same statistical utility per joule of the device's expected task (no time penalty: joules are
  power × time already), the same exploration and cut-off; a battery device whose task would take its charge below
  its floor is never tasked.

Plain Python and numpy: the coordinator builds :class:`DeviceFacts` from what the devices reported and what it
knows of their speed and energy (:mod:`fedge.coordinator.selecting`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedge.common.heat import HeatReading
from fedge.errors import ConfigError

UTILITY_SELECTIONS: dict[str, str] = {
    "oort": "by statistical utility (samples x training loss) x a penalty for devices slower than the preferred "
            "round (Lai et al., OSDI 2021), exploring untried devices",
    "energy": "by statistical utility per joule of the device's task, never taking a battery below its floor",
}
UTILITY_KEYS = ("explore", "preferred_round_s", "straggler_penalty", "thermal_guard")
CUTOFF = 0.95
"""Oort's exploitation cut-off: devices within this share of the k-th highest utility are drawn from."""
UNKNOWN_LOSS = 1.0
"""The loss a device that trained but reported none is taken to have (a method without a loss)."""


@dataclass(frozen=True)
class UtilitySettings:
    """``explore`` (ε: the share of a round's slots for devices that never trained), ``preferred_round_s`` (Oort's
    T; 0: the median of the candidates' expected task times), ``straggler_penalty`` (α) and ``thermal_guard``."""

    explore: float = 0.2
    preferred_round_s: float = 0.0
    straggler_penalty: float = 2.0
    thermal_guard: bool = False
    """Never task a device that is hot (throttling, or at its thermal limit) until it has cooled
    (:mod:`fedge.common.heat`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.explore <= 1:
            raise ConfigError(f"[coordinator] explore = {self.explore:g}: must be a share in [0, 1]",
                              hint="the share of each round's slots for devices that never trained, e.g. 0.2")
        if not 0 <= self.preferred_round_s < math.inf:
            raise ConfigError(f"[coordinator] preferred_round_s = {self.preferred_round_s:g}: must be >= 0 seconds",
                              hint="Oort's preferred round duration T in seconds; 0: the median expected task time")
        if not 0 <= self.straggler_penalty < math.inf:
            raise ConfigError(f"[coordinator] straggler_penalty = {self.straggler_penalty:g}: must be >= 0",
                              hint="Oort's α: a device slower than T weighs (T / t) ** α, e.g. 2 (0: no penalty)")


@dataclass(frozen=True)
class DeviceFacts:
    """What selection knows of one candidate."""

    samples: int
    loss: float | None = None
    """Its last reported training loss (None: it never trained)."""
    trained: bool = False
    """Whether it delivered an update before (an untried device is explored)."""
    task_s: float | None = None
    """Expected seconds of a task (None: unknown)."""
    task_j: float | None = None
    """Expected joules of a task (None: unknown)."""
    battery_j: float | None = None
    """Charge left, J (None: mains powered or unknown)."""
    floor_j: float = 0.0
    hot: str = ""
    """Why it is too hot to task now (the thermal guard); empty: it is not."""


@dataclass(frozen=True)
class SystemFacts:
    """What a transport that knows the devices' clock tells selection (the simulator: the virtual clock)."""

    task_s: float | None
    task_j: float | None
    battery_j: float | None = None
    floor_j: float = 0.0
    heat: HeatReading | None = None
    """Its temperature and throttling flags, for the thermal guard (None: no thermal model)."""


@dataclass
class Choice:
    """The devices chosen, sorted, and why each candidate was or was not."""

    chosen: list[str]
    why: dict[str, str] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    """The candidates the thermal guard held back (too hot), sorted."""


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def select(policy: str, rnd: int, k: int, candidates: Sequence[str], facts: Mapping[str, DeviceFacts],
           settings: UtilitySettings, seed: int) -> Choice:
    """``k`` of ``candidates`` (the online devices) for round ``rnd`` by ``policy`` (oort or energy)."""
    rng = np.random.default_rng([seed & 0xFFFF_FFFF, rnd, 0x0027])
    pool = sorted(candidates)
    why: dict[str, str] = {}
    held = [d for d in pool if facts[d].hot] if settings.thermal_guard else []
    for d in held:  # a hot device waits until it has cooled
        why[d] = f"{facts[d].hot}: not tasked until it cools"
        pool.remove(d)
    if policy == "energy":
        pool = _above_floor(pool, facts, why)
    times = [t for d in pool if (t := facts[d].task_s) is not None]
    preferred = settings.preferred_round_s or (statistics.median(times) if times else 0.0)
    joules = [j for d in pool if (j := facts[d].task_j) is not None and j > 0]
    typical_j = statistics.median(joules) if joules else 1.0
    untried = [d for d in pool if not facts[d].trained]
    tried = [d for d in pool if facts[d].trained]
    k = min(k, len(pool))
    n_explore = min(len(untried), max(1 if settings.explore > 0 and untried else 0, round(settings.explore * k)))
    if len(tried) < k - n_explore:  # too few known devices: the untried fill the rest
        n_explore = k - len(tried)
    explored = sorted(untried[i] for i in rng.choice(len(untried), size=n_explore, replace=False)) if n_explore else []
    for d in untried:
        why[d] = ("explored: never trained" if d in explored else
                  "not explored this round: never trained, its exploration slot went to another")
    utility = {}
    for d in tried:
        utility[d], why[d] = _utility(policy, facts[d], preferred, settings.straggler_penalty, typical_j)
    exploit = _exploit(tried, utility, k - n_explore, rng, why)
    return Choice(sorted(explored + exploit), why, held)


def _above_floor(pool: list[str], facts: Mapping[str, DeviceFacts], why: dict[str, str]) -> list[str]:
    """The candidates a task leaves above their battery's floor; the others get their reason."""
    out = []
    for d in pool:
        f = facts[d]
        if f.battery_j is not None and f.battery_j - (f.task_j or 0.0) < f.floor_j:
            why[d] = (f"battery: {_fmt(f.battery_j)} J left, a task of {_fmt(f.task_j or 0.0)} J would take it "
                      f"below its floor of {_fmt(f.floor_j)} J")
        else:
            out.append(d)
    return out


def _utility(policy: str, f: DeviceFacts, preferred: float, alpha: float, typical_j: float) -> tuple[float, str]:
    """A tried device's utility and the sentence that explains it."""
    loss = UNKNOWN_LOSS if f.loss is None or not math.isfinite(f.loss) else max(f.loss, 0.0)
    stat = f.samples * loss
    text = f"{f.samples} samples x loss {_fmt(loss)}"
    if policy == "energy":
        j = f.task_j if f.task_j is not None and f.task_j > 0 else typical_j
        known = "" if f.task_j is not None and f.task_j > 0 else " (unknown: the median)"
        return stat / j, f"utility {_fmt(stat / j)} per J = {text} / {_fmt(j)} J a task{known}"
    penalty = 1.0
    if f.task_s is not None and preferred > 0 and f.task_s > preferred:
        penalty = (preferred / f.task_s) ** alpha
        text += f" x penalty {_fmt(penalty)} ({_fmt(f.task_s)} s expected > preferred {_fmt(preferred)} s)"
    return stat * penalty, f"utility {_fmt(stat * penalty)} = {text}"


def _exploit(tried: list[str], utility: Mapping[str, float], k: int, rng: np.random.Generator,
             why: dict[str, str]) -> list[str]:
    """``k`` of ``tried`` by Oort's cut-off: drawn ∝ utility among those within :data:`CUTOFF` of the k-th best."""
    if k <= 0:
        for d in tried:
            why[d] += "; not chosen: every slot went to exploration"
        return []
    ranked = sorted(tried, key=lambda d: (-utility[d], d))
    bar = CUTOFF * utility[ranked[k - 1]]
    eligible = [d for d in ranked if utility[d] >= bar] or ranked[:k]
    weights = np.array([max(utility[d], 1e-12) for d in eligible])
    picked = list(rng.choice(eligible, size=k, replace=False, p=weights / weights.sum())) if len(eligible) > k \
        else list(eligible)
    for d in tried:
        if d in picked:
            why[d] += "; chosen"
        elif d in eligible:
            why[d] += f"; within the cut-off {_fmt(bar)}, not drawn"
        else:
            why[d] += f"; below the cut-off {_fmt(bar)}"
    return [str(d) for d in picked]
