"""The learning rate of local training round by round: ``[train] lr_schedule`` (issue 45).

``"constant"``: every round trains at the configured learning rate. ``"cosine"``: the rate anneals along half a
cosine from the configured one at round 1 to a tenth of it (:data:`COSINE_FLOOR`) at the run's last round, so the
last rounds take small steps and a device on a small, skewed share does not throw away what it learned in them.

The round is the round descriptor's ``round`` (in asynchronous mode the model version the device trains from); the
run's total is the descriptor's ``rounds`` (the coordinator's total, which wins) or, from a coordinator that does
not send it, the device's own ``[run] rounds``. Torch-free: both halves and the planner read it.
"""

from __future__ import annotations

import difflib
import math

from fedge.errors import ConfigError

CONSTANT = "constant"
COSINE = "cosine"
LR_SCHEDULES = (CONSTANT, COSINE)
COSINE_FLOOR = 0.1
"""The cosine schedule's last-round rate as a share of the first round's."""


def check_schedule(name: str) -> str:
    """``name`` if it is a schedule of :data:`LR_SCHEDULES`; otherwise a :class:`ConfigError` naming the closest."""
    if name in LR_SCHEDULES:
        return name
    close = difflib.get_close_matches(name, LR_SCHEDULES, n=1)
    raise ConfigError(f"lr_schedule = {name!r} is not a learning-rate schedule",
                      hint=(f"did you mean {close[0]!r}? " if close else "")
                      + f"known: {', '.join(repr(s) for s in LR_SCHEDULES)}")


def scheduled_lr(lr: float, schedule: str, rnd: int, total: int) -> float:
    """The learning rate of round ``rnd`` (from 1) of a ``total``-round run under ``schedule``.

    Cosine: ``lr`` at round 1, ``COSINE_FLOOR * lr`` at round ``total`` and after it (an asynchronous version
    past the total, a final round), half a cosine between. A run of one round, or an unknown total (0), trains
    at ``lr``.
    """
    check_schedule(schedule)
    if schedule == CONSTANT or total <= 1:
        return lr
    t = min(max(rnd, 1), total)
    floor = COSINE_FLOOR * lr
    return floor + (lr - floor) * (1 + math.cos(math.pi * (t - 1) / (total - 1))) / 2
