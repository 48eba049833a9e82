"""Which model tier a device trains: the one that reaches the most accuracy within the run's time budget (issue 48).

The planner used to keep the largest tier whose five local epochs fit the profile's round budget — a fixed
budget that, once the speed model made the Pi Zero 2 W's tier-m round 8.3 s against an 8 s budget, silently
cost a device 29 points. Now every tier that fits the memory budget gets a **schedule within the run's time
budget** and an **expected accuracy** from the task's measured curves (:mod:`fedge.profiles.accuracy`):

* the run's time budget ``T`` is ``[run] time_budget_s``, or ``rounds × budgets.round_time_s`` (the device
  owner's per-round grant) when unset;
* **synchronous** rounds wait for their slowest device, so a tier gets ``T / rounds`` per round: as many local
  epochs (up to 5) as fit, every round;
* **asynchronous** mode: a slow device delays nobody, so a tier gets all of ``T``: 5 epochs per update, as many
  updates (up to ``rounds``) as fit;
* expected accuracy = the curve of (tier, local samples) at the epochs of work the schedule gives.

The chosen tier is the one whose expected accuracy is the best reachable (the smallest, fastest, of those
within :data:`ACCURACY_TOLERANCE` of it); without curves for the task, the largest tier whose full schedule
fits (the old rule). A pinned tier (``arch = "tier-m"`` in a fleet's ``[[devices]]``) is kept, and the plan
says what the planner would have chosen. Either way :class:`Trade` records, in words and numbers, the largest
tier memory holds and the tier chosen, with the expected time and accuracy of both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fedge.errors import ProfileError
from fedge.profiles.accuracy import AccuracyCurves

MAX_EPOCHS = 5  # GeFL: T_r = 5 local epochs on real data per round (an update, in asynchronous mode)
DEFAULT_ROUNDS = 10  # `fedge profile plan` without a fleet: GeFL's protocol trains 10 rounds of 5 epochs
# The fastest tier within this many points of the best expected accuracy is kept. 0: the most accurate tier
# (the fastest only among equals). The curves are measured on one draw per cell and are noisy by about a point;
# trading expected points for speed on them moved 9 of issue 48's 12 devices to smaller tiers, so the planner
# does not trade accuracy it cannot measure reliably: time enters through the budget, not through a tolerance.
ACCURACY_TOLERANCE = 0.0
# Issue 48's promise: no device more than this below what the largest tier its memory holds reaches.
PROMISE_POINTS = 2.0


@dataclass(frozen=True)
class RunBudget:
    """What the planner needs of the run: its rounds, time budget, mode and task."""

    rounds: int = DEFAULT_ROUNDS
    time_budget_s: float | None = None
    """Seconds of device time the run may take (None: ``rounds × budgets.round_time_s``)."""
    asynchronous: bool = False
    task: str | None = None
    """The data set whose accuracy curves weigh the tiers (a fleet's ``[run] dataset``). None, or a task without
    curves: the largest tier whose full schedule fits (the rule before issue 48, and what a profile alone gets)."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ProfileError(f"rounds = {self.rounds}: must be at least 1", hint="the run's number of rounds")
        if self.time_budget_s is not None and not 0 < self.time_budget_s < math.inf:
            raise ProfileError(f"time_budget_s = {self.time_budget_s:g}: must be a positive number of seconds",
                               hint="the run's time budget, e.g. 600; leave it out for rounds × the profile's "
                                    "budgets.round_time_s")


@dataclass(frozen=True)
class TierOption:
    """One tier's schedule within the budget, and its expected accuracy."""

    tier: str
    name: str
    """The network's name: ``tier-m``, or another family's ``mobilenet-m-96``."""
    batch: int
    fits_memory: bool
    epoch_s: float
    """Seconds of one epoch over the local data (the speed model's)."""
    epochs_per_round: int
    """Local epochs per round (per update, in asynchronous mode); 0: not even one fits."""
    work_epochs: float
    """Epochs over the local data in the whole run, within the budget."""
    time_s: float
    """Expected training time of that work."""
    acc: float | None
    """Expected local accuracy (%) after that work (None: no curves for the task)."""
    full_time_s: float
    """Training time of the full schedule: rounds × 5 epochs."""
    full_acc: float | None
    fixed_s: float = 0.0
    """Seconds each round (update) costs besides its epochs (the speed model's fixed costs)."""


@dataclass(frozen=True)
class Trade:
    """The trade the planner made for one device: the largest tier memory holds against the tier chosen."""

    mode: str
    budget_s: float
    budget_from: str
    rounds: int
    task: str | None
    samples: int
    largest: TierOption
    chosen: TierOption
    pinned: bool
    budget_met: bool
    """Whether the chosen tier's expected accuracy is within :data:`PROMISE_POINTS` of the largest tier's full
    schedule (without curves: whether it trains its full schedule)."""
    words: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), accuracies in percent and times in seconds rounded for reading."""
        d = asdict(self)
        for side in ("largest", "chosen"):
            d[side] = {k: round(v, 2) if isinstance(v, float) else v for k, v in d[side].items()}
        return d


def _pct(x: float | None) -> str:
    return "no curve" if x is None else f"{x:.1f} %"


def tier_options(per_epoch_s: Mapping[str, float], batch: Mapping[str, int], fits_memory: Sequence[str],
                 samples: int, budget_s: float, run: RunBudget, curves: AccuracyCurves | None, *,
                 names: Mapping[str, str] | None = None, fixed_s: Mapping[str, float] | None = None,
                 ) -> dict[str, TierOption]:
    """Every tier's schedule within ``budget_s`` (``per_epoch_s``: seconds of one epoch over the local data, per
    tier of the family, smallest first; ``names``: each tier's network name, default ``tier-<t>``; ``fixed_s``: the
    seconds each round or update costs besides its epochs, :meth:`fedge.profiles.speed.SpeedModel.round_fixed_s`)."""
    out = {}
    full = run.rounds * MAX_EPOCHS
    for t in per_epoch_s:
        pe, f = per_epoch_s[t], (fixed_s or {}).get(t, 0.0)
        if run.asynchronous:  # the whole budget, in updates of 5 epochs (fewer if one update is all it holds)
            per_round = min(MAX_EPOCHS, math.floor(max(0.0, budget_s - f) / pe))
            updates = budget_s / (MAX_EPOCHS * pe + f)
            work = min(float(full), MAX_EPOCHS * updates) if per_round == MAX_EPOCHS else float(per_round)
            fixed = f * math.ceil(work / MAX_EPOCHS - 1e-9)
            fixed_full = f * run.rounds
        else:  # every round within its share of the budget
            per_round = min(MAX_EPOCHS, math.floor(max(0.0, budget_s / run.rounds - f) / pe))
            work = float(run.rounds * per_round)
            fixed = fixed_full = f * run.rounds

        def acc(epochs: float, tier: str = t) -> float | None:
            return None if curves is None or epochs < 1 else curves.expected(tier, samples, epochs)

        name = names[t] if names is not None else f"tier-{t}"
        out[t] = TierOption(t, name, batch[t], t in fits_memory, pe, per_round, work, work * pe + fixed, acc(work),
                            full * pe + fixed_full, acc(full), f)
    return out


def choose_tier(options: Mapping[str, TierOption], fits_memory: Sequence[str], *, pin: str | None,
                curves: AccuracyCurves | None, where: str, share_s: float) -> TierOption:
    """The option the planner keeps (``fits_memory``: the tiers that fit memory, smallest first)."""
    if pin is not None:
        return options[pin]
    feasible = [options[t] for t in fits_memory if options[t].epochs_per_round >= 1]
    if not feasible:
        small = options[fits_memory[0]]
        one_round = small.epoch_s + small.fixed_s
        raise ProfileError(
            f"{where}: even {small.name} needs {one_round:.1f} s for a round of one epoch, more "
            f"than its share of the time budget ({share_s:.1f} s)",
            hint=f"raise the time budget to at least {math.ceil(one_round * 10) / 10:g} s per round "
                 "(budgets.round_time_s, or [run] time_budget_s / rounds), or train on fewer samples")
    if curves is None:
        full = [o for o in feasible if o.time_s >= o.full_time_s]
        return full[-1] if full else feasible[0]
    best = max(o.acc or 0.0 for o in feasible)
    return next(o for o in feasible if (o.acc or 0.0) >= best - ACCURACY_TOLERANCE)


def describe(largest: TierOption, chosen: TierOption, *, budget_s: float, budget_from: str, run: RunBudget,
             samples: int, pinned: bool, planner_choice: TierOption | None) -> Trade:
    """The :class:`Trade` of ``chosen`` against ``largest`` (the largest tier memory holds), with its words
    (``planner_choice``: what the planner would have kept, when a pin overrode it)."""
    rounds, mode = run.rounds, ("async" if run.asynchronous else "sync")
    per = "update" if run.asynchronous else "round"

    def sched(o: TierOption) -> str:
        n = (f"{o.work_epochs:.0f} epochs" if o.epochs_per_round else "not one epoch")
        return (f"{n} ({o.epochs_per_round} per {per}) over {samples} samples in {o.time_s:.1f} s, "
                f"expected {_pct(o.acc)}")

    if chosen.acc is not None and largest.full_acc is not None:
        met = chosen.acc >= largest.full_acc - PROMISE_POINTS
    else:
        met = chosen.work_epochs >= rounds * MAX_EPOCHS
    budget = f"the {budget_s:.0f} s budget ({budget_from}, {mode})"
    head = f"{chosen.name} (pinned)" if pinned else chosen.name
    words = f"{head}: {sched(chosen)} within {budget}"
    if chosen.tier == largest.tier:
        words += "; it is the largest tier memory holds"
    else:
        words += (f"; the largest tier memory holds, {largest.name} (batch {largest.batch}), needs "
                  f"{largest.full_time_s:.1f} s for its full {rounds} x {MAX_EPOCHS} epochs, expected "
                  f"{_pct(largest.full_acc)}; within the budget: {sched(largest)}")
        if chosen.acc is not None and largest.full_acc is not None:
            words += (f"; trade: {largest.full_acc - chosen.acc:.1f} points of expected accuracy for "
                      f"{largest.full_time_s - chosen.time_s:.1f} s")
    if planner_choice is not None and planner_choice.tier != chosen.tier:
        words += f"; the planner would choose {planner_choice.name} ({sched(planner_choice)})"
    if not chosen.fits_memory:
        words += f"; {chosen.name} MISSES the training-memory budget even at batch {chosen.batch}"
    if not met:
        words += (f"; the time budget cannot be met: more than {PROMISE_POINTS:g} points below {largest.name}'s "
                  f"full schedule — raise [run] time_budget_s ({largest.name} needs "
                  f"{largest.full_time_s:.0f} s)" if chosen.acc is not None
                  else f"; the time budget cannot be met: {chosen.name} trains fewer epochs than its full "
                       f"schedule")
    return Trade(mode, budget_s, budget_from, rounds, run.task, samples, largest, chosen, pinned, met, words)
