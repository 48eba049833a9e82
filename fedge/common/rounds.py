"""The vocabulary both halves of every method share: rounds, devices, phases, artifacts.

Everything here is plain data (no torch): the coordinator half names the same
phases, artifacts and upload keys as the device half by importing them from
here, never from :mod:`fedge.edge`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fedge.common.generators import IMAGE_LEVEL
from fedge.errors import PayloadError

# -- phase names (``RoundInfo.phase``) ----------------------------------------------------------
TRAIN_PHASE = "train"  # the single phase of Local, FedAvg, LG-FedAvg, FedProto and FedVTC
WARMUP_PHASE = "warmup"  # GeFL-F: LG-FedAvg on the full model
GENERATOR_PHASE = "generator"  # GeFL, GeFL-F: the federated generator trains
TARGET_PHASE = "target"  # GeFL: each device's network on synthetic, then real samples
HEAD_PHASE = "head"  # GeFL-F: everything after the frozen extractor
FINAL_PHASE = "final"  # after the last training round: apply, evaluate, upload metrics only


@dataclass(frozen=True)
class RoundInfo:
    """What the coordinator announces at the start of a round.

    Rounds are numbered from 1. After the last training round the coordinator
    announces one more round with ``phase == "final"``: devices apply the last
    global state, evaluate, and upload metrics only.
    """

    round: int
    phase: str
    method: str
    deadline: float = 0.0  # unix seconds; 0 = none (in-process)
    config: dict[str, Any] = field(default_factory=dict)
    # The devices sampled to train this round ([coordinator] sample, fedge.common.sampling); None: every
    # device. A device not listed sends nothing.
    sampled: list[str] | None = None
    # Asynchronous mode ([coordinator] mode = "async", fedge.common.asyncmode): ``round`` is the global version,
    # and this maps every device asked to train to the version at which it was asked (its task). A device
    # trains once per task, from the version announced when it starts; a device not listed sends nothing.
    assigned: dict[str, int] | None = None
    # The run's total of rounds (training rounds of every phase; in asynchronous mode, versions): what a device's
    # [train] lr_schedule anneals over (fedge.common.lrschedule). 0: not said (the device's own [run] rounds).
    rounds: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise PayloadError(f"round descriptor: rounds = {self.rounds!r} is not a count of rounds (an integer >= 0)")

    def includes(self, device_id: str) -> bool:
        """Whether ``device_id`` is asked to work in this round."""
        if self.assigned is not None:
            return device_id in self.assigned
        return self.sampled is None or device_id in self.sampled

    @property
    def is_final(self) -> bool:
        return self.phase == FINAL_PHASE

    def to_dict(self) -> dict[str, Any]:
        # Shallow copies of the fields (no asdict: its deep copy of an asynchronous descriptor's ``assigned``,
        # one entry per device, cost more than encoding it); the caller may change the dict and its lists.
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["config"] = copy.deepcopy(self.config)  # small: a method's settings
        for key in ("sampled", "assigned"):
            if d[key] is None:
                del d[key]  # absent unless used: a device of an older release still reads the descriptor
            else:
                d[key] = type(d[key])(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoundInfo:
        return cls(**d)


@dataclass(frozen=True)
class DeviceInfo:
    """A registered device as the coordinator knows it (from its hello)."""

    device_id: str
    arch: str
    profile: str
    upload_precision: str = "fp32"
    num_samples: int = 0
    feature_dim: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str:
        """Architecture group: devices that can average weights with each other."""
        return self.arch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceInfo:
        return cls(**d)


# -- artifact names (global state the coordinator publishes) ------------------------------------
EXTRACTOR_ARTIFACT = "extractor"  # the common stem averaged over every device (LG-FedAvg, GeFL, GeFL-F)
PROTOTYPES_ARTIFACT = "prototypes"  # FedProto's global per-class feature means and counts
VTC_STATS_ARTIFACT = "vtc-stats"  # FedVTC's global prototypes, σ and class counts

# -- upload key prefixes ---------------------------------------------------------------------------
EXTRACTOR_PREFIX = "extractor."  # state-dict entries of the common stem (FedgeNet.extractor)
GENERATOR_PREFIX = "generator."  # generator weights in an upload (models use extractor./body./...)


def evaluates_at(round_: int, eval_every: int, *, final: bool = False) -> bool:
    """Whether a device evaluates at the start of round ``round_``: the model after round r = round_ - 1.

    Every ``eval_every``-th round's model and the final one; the initial model (r = 0) only when every round is
    evaluated (``eval_every = 1``), so ``eval_every = rounds`` costs one evaluation. The device agent follows it,
    and the virtual clock times the evaluations by it (``fedge.fleet.clock``)."""
    done = round_ - 1
    every = max(1, eval_every)
    return final or (done % every == 0 and (done > 0 or every == 1))


def group_artifact(arch: str) -> str:
    """Artifact holding the weights averaged within an architecture group."""
    return f"group-{arch}"


def generator_artifact(kind: str, tier: str, level: str = IMAGE_LEVEL) -> str:
    """Artifact holding the generator averaged over the devices with the same kind, tier and level.

    Devices can only average generators of identical shape, so a fleet whose
    plans give different generator tiers trains one generator per tier.
    """
    return f"generator-{level}-{kind}-{tier}"


# -- class statistics (FedProto, FedVTC) ----------------------------------------------------------
# An upload of per-class feature statistics: name -> (shape, dtype kind), as the validator checks it.
StatsSpec = dict[str, tuple[tuple[int, ...], str]]


def class_stats_spec(num_classes: int, feature_dim: int, *, with_sigma: bool = False) -> StatsSpec:
    """What a device uploads of its features: ``protos`` (C, p) class means, ``counts`` (C,) samples
    per class, and with ``with_sigma`` (FedVTC) ``sigma`` (p,), the pooled within-class std."""
    spec: StatsSpec = {"protos": ((num_classes, feature_dim), "float"), "counts": ((num_classes,), "int")}
    if with_sigma:
        spec["sigma"] = ((feature_dim,), "float")
    return spec
