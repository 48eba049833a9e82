"""FedProto on a label-skewed fleet of two architectures: what sharing prototypes does.

Measured honestly (``docs/simulation.md``): on label-skewed digits fleets FedProto does *not*
beat Local on accuracy reliably — over three seeds of the fleet below (15 rounds) Local reached
70.5 / 82.8 / 82.3 % on the local splits and FedProto (lambda 0.2, head_protos 0.5) 68.6 / 82.2 /
84.7 %. What it does measurably is pull the feature spaces of different architectures
together: the spread of a class's mean feature across devices, relative to the spread between
classes, drops from 8.5 (Local) to 5.2 after 6 rounds with lambda 1 (single-threaded torch, as
the test suite runs). That is what this test asserts; it is a partial alignment, not a collapse
onto common prototypes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedge.edge.training import class_feature_stats
from fedge.fleet.config import parse_fleet
from fedge.sim.simulate import SimResult, simulate


def _run(method: str, method_cfg: dict[str, Any]) -> SimResult:
    cfg = parse_fleet({
        "run": {"method": method, "rounds": 6, "dataset": "digits", "seed": 0},
        "partition": {"kind": "dirichlet", "alpha": 0.5, "fraction": 0.3},
        # min_tail 1 and no validation fold: the training shares the docstring's figures were measured on
        # and one rate throughout (issue 45's plan anneals it: the figures were measured at a constant 0.05)
        "train": {"lr": 0.05, "local_epochs": 2, "batch_size": 16, "min_tail": 1, "val_fraction": 0,
                  "lr_schedule": "constant"},
        "devices": [{"profile": "rpi3b", "count": 6, "archs": ["tier-xs", "tier-s"]}],
        "method": method_cfg,
    })
    return simulate(cfg)


def _misalignment(res: SimResult) -> float:
    """Spread of a class's prototype across devices, relative to the spread between classes.

    For every class seen by at least two devices: mean squared distance of the devices' class
    means to their average, divided by the mean squared distance of the class averages to the
    grand mean. Near 0: every device puts a class in the same place; ~1 or more: unrelated spaces.
    """
    protos: list[np.ndarray] = []  # per device (C, p), NaN where the class is absent
    for d in res.devices:
        ctx = d.method.ctx
        sums, _, counts = class_feature_stats(ctx.model, ctx.train.x, ctx.train.y, ctx.num_classes)
        with np.errstate(invalid="ignore", divide="ignore"):
            protos.append(np.where(counts[:, None] > 0, sums / counts[:, None], np.nan))
    stack = np.stack(protos)  # (K, C, p)
    seen = np.sum(~np.isnan(stack[:, :, 0]), axis=0) >= 2
    centre = np.nanmean(stack[:, seen], axis=0)  # (C', p)
    within = np.nanmean(np.sum((stack[:, seen] - centre) ** 2, axis=-1))
    between = np.mean(np.sum((centre - centre.mean(0)) ** 2, axis=-1))
    return float(within / between)


@pytest.mark.slow
def test_fedproto_aligns_feature_spaces_across_architectures() -> None:
    local = _misalignment(_run("local", {}))
    proto = _misalignment(_run("fedproto", {"lambda": 1.0}))
    assert local > 1.0  # independent models: a class lands anywhere
    assert proto < 0.75 * local  # measured 0.61x
