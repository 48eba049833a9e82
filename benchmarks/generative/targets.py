"""The generative benchmark's targets (issue 3), as data: the renderer judges each table against them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Table1Targets:
    """GeFL protocol."""

    gain_over_fedavg: float = 2.0  # points of mean best accuracy, every generative method, paired by seed
    best_accuracy: float = 84.3  # %, the best method
    hours_on_two_cores: float = 3.0  # wall time of the rows, one cell per core


@dataclass(frozen=True)
class Table2Targets:
    """Label skew."""

    alpha: float = 0.1  # the Dirichlet α the FedVTC target applies at
    fedvtc_over_fedproto: float = 2.0  # points of global-test accuracy
    # Each ablation must stay below full FedVTC (at every α).
    ablations: tuple[str, ...] = ("fedvtc-nodm", "fedvtc-head", "fedvtc-nokl")


@dataclass(frozen=True)
class Table3Targets:
    """Upload precision."""

    max_delta: float = 0.5  # |accuracy at fp16 or int8 − at fp32|, points


TABLE1 = Table1Targets()
TABLE2 = Table2Targets()
TABLE3 = Table3Targets()


@dataclass(frozen=True)
class NoWorseTargets:
    """Issue 17: no device worse off than alone (table 2, every α; table 1 for the guard)."""

    local_within: float = 1.0  # points: each personalised method's mean local accuracy ≥ Local's − this
    geflf_gain_kept: float = 0.8  # share of GeFL-F's global-test gain over Local kept with personalisation
    device_margin: float = 1.0  # points: a device counts as "below Local" when it trails by more than this


NO_WORSE = NoWorseTargets()
