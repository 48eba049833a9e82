"""The fleet config's plain tables (``[run]``, ``[partition]``, ``[train]``, ``[[devices]]``, ``[model]``,
``[data]``): what the fleet trains, on what, with which devices; each a frozen dataclass that checks itself.
:class:`fedge.fleet.config.FleetConfig` holds them and checks what they mean together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedge.common.catalog import DATASETS
from fedge.common.families import GEFL_FAMILY
from fedge.common.lrschedule import check_schedule
from fedge.common.tensorcodec import PRECISIONS
from fedge.errors import ConfigError


@dataclass(frozen=True)
class RunSection:
    """What to run: method, rounds, data set, seed."""

    method: str
    rounds: int
    name: str = "fedge-run"
    fleet: str = "default"
    seed: int = 0
    dataset: str = "digits"
    data_dir: str | None = None
    eval_every: int = 1
    embed_dim: int = 64
    # Seconds of device time the run may take: the planner picks each device's model tier for the most
    # accuracy within it (fedge.profiles.tier_choice; 0 = rounds x each profile's budgets.round_time_s).
    time_budget_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.time_budget_s < float("inf"):
            raise ConfigError(f"[run] time_budget_s = {self.time_budget_s:g}: must be a number of seconds >= 0",
                              hint="e.g. 600 for ten minutes; 0 or leave it out for rounds x each profile's "
                                   "budgets.round_time_s")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.eval_every < 1:
            raise ConfigError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}", hint=f"use one of {', '.join(DATASETS)}")
        if not self.fleet.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"fleet name {self.fleet!r} may hold only letters, digits, '-' and '_'")


@dataclass(frozen=True)
class PartitionSection:
    """How the training set is spread over the devices."""

    kind: Literal["iid", "dirichlet", "shards", "group"] = "iid"
    """``group``: each speaker or subject of a 1-D data set on one device (the natural non-IID split)."""
    fraction: float = 1.0
    alpha: float = 0.5
    shards_per_device: int = 2
    local_test_fraction: float = 0.2
    min_size: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"fraction must be in (0, 1], got {self.fraction}")
        if not 0 <= self.local_test_fraction < 1:
            raise ConfigError(f"local_test_fraction must be in [0, 1), got {self.local_test_fraction}")
        if self.alpha <= 0:
            raise ConfigError(f"alpha must be > 0, got {self.alpha}")


# [train] divergence_margin's default (points of validation accuracy; docs/simulation.md, "The divergence guard")
DEFAULT_DIVERGENCE_MARGIN = 0.0


@dataclass(frozen=True)
class TrainSection:
    """Overrides of the plan's local-training settings (unset: the plan decides)."""

    lr: float | None = None
    lr_schedule: str | None = None
    """How the learning rate changes round by round: "constant" or "cosine" (fedge.common.lrschedule; unset: the
    plan decides)."""
    batch_size: int | None = None
    local_epochs: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    min_tail: int | None = None
    """An epoch's last batch smaller than this joins the one before it (unset: the plan decides; 1: never)."""
    val_fraction: float = 0.1
    """Share of each device's training samples held out to choose the model it ships (0: none, ship the last)."""
    divergence_margin: float | None = None
    """Points of validation accuracy a round may lose before the device undoes it and trains the next round from
    its previous model (fedge.edge.divergence). Unset: DEFAULT_DIVERGENCE_MARGIN when there is a validation fold,
    off without one; 0: off."""

    def guard_margin(self) -> float:
        """The divergence guard's margin in points for this fleet (0: no guard)."""
        if self.val_fraction == 0:
            return 0.0
        return DEFAULT_DIVERGENCE_MARGIN if self.divergence_margin is None else self.divergence_margin

    def __post_init__(self) -> None:
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.lr_schedule is not None:
            check_schedule(self.lr_schedule)
        if self.min_tail is not None and self.min_tail < 1:
            raise ConfigError(f"min_tail must be >= 1, got {self.min_tail}", hint="1 keeps every last batch as it is")
        if not 0 <= self.val_fraction < 0.5:
            raise ConfigError(f"val_fraction must be in [0, 0.5), got {self.val_fraction}",
                              hint="0.1 holds out a tenth of each device's training share; 0 holds out nothing")
        if self.divergence_margin is not None:
            if not 0 <= self.divergence_margin <= 100:
                raise ConfigError(f"divergence_margin must be in [0, 100] points of validation accuracy, got "
                                  f"{self.divergence_margin}", hint=f"{DEFAULT_DIVERGENCE_MARGIN:g} is the default; "
                                  "0 turns the divergence guard off")
            if self.divergence_margin > 0 and self.val_fraction == 0:
                raise ConfigError(f"divergence_margin = {self.divergence_margin:g} needs a validation fold, but "
                                  "val_fraction = 0", hint="set val_fraction (e.g. 0.1), or divergence_margin = 0")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.local_epochs is not None and self.local_epochs < 1:
            raise ConfigError(f"local_epochs must be >= 1, got {self.local_epochs}")


@dataclass(frozen=True)
class DeviceGroup:
    """``count`` devices of one profile. ``archs`` (cycled) or ``arch`` override the plan's model,
    ``upload_precision`` the plan's upload precision (which the planner derives from the uplink)."""

    profile: str
    count: int = 1
    arch: str | None = None
    archs: tuple[str, ...] = ()
    id_prefix: str | None = None
    upload_precision: str | None = None
    # [clock] availability = "onoff": this group's mean online / offline spells (default: [clock]'s)
    online_mean_s: float | None = None
    offline_mean_s: float | None = None

    def __post_init__(self) -> None:
        if self.online_mean_s is not None and not 0 < self.online_mean_s < float("inf"):
            raise ConfigError(f"online_mean_s = {self.online_mean_s:g}: must be a positive number of seconds",
                              hint="the mean length of this group's online spells, e.g. 3600")
        if self.offline_mean_s is not None and not 0 <= self.offline_mean_s < float("inf"):
            raise ConfigError(f"offline_mean_s = {self.offline_mean_s:g}: must be >= 0 seconds",
                              hint="the mean length of this group's offline spells (0: never offline)")
        if self.count < 1:
            raise ConfigError(f"device count must be >= 1, got {self.count}")
        if self.arch and self.archs:
            raise ConfigError("set either arch or archs for a device group, not both")
        if self.upload_precision is not None and self.upload_precision not in PRECISIONS:
            raise ConfigError(f"upload_precision {self.upload_precision!r} is not a precision",
                              hint=f"use one of {', '.join(PRECISIONS)}")


# The GeFL CNN family's networks take 1x32x32 inputs (fedge.common.archs.ArchSpec's defaults).
ZOO_INPUT = (1, 32)


@dataclass(frozen=True)
class ModelSection:
    """``[model] family``: what network every device trains (docs/models.md).

    ``"gefl-cnn"`` (the GeFL CNNs and ``tier-*``), a built-in family (``mobilenet``, ``resnet8``, ``dscnn``),
    the user's ``"my_family.py:build"`` (a path relative to the fleet config) or ``"package.module:build"``,
    or an entry point of the group ``fedge.families``. The planner picks each device's tier of it;
    ``[[devices]] arch``/``archs`` may name a tier of it instead.
    """

    family: str = GEFL_FAMILY

    def __post_init__(self) -> None:
        if not self.family.strip():
            raise ConfigError("[model] family is empty", hint=f'use "{GEFL_FAMILY}" or "my_family.py:build"')


@dataclass(frozen=True)
class DataSection:
    """The fleet's own data (``fedge edge run --data DIR``): class names in label order and the input.

    Every device maps its class folders to label ids through ``classes``, so folder ``cat``
    is label 2 on every device of ``classes = ["bird", "car", "cat"]``. ``mean``/``std``
    default to the normalization of ``[run] dataset``. Empty ``classes``: the fleet trains
    on shares of the benchmark data set only.
    """

    classes: tuple[str, ...] = ()
    image_size: int = 32
    channels: int = 1
    mean: float | None = None
    std: float | None = None
    kind: Literal["image", "audio", "series"] = "image"
    """What the devices' own files are: images, WAV clips (``audio``) or sensor windows (``series``)."""
    window: int = 0
    """Samples per input of ``audio`` (default 16000: 1 s at 16 kHz) or ``series`` (required) data."""

    def __post_init__(self) -> None:
        for c in self.classes:
            if not c.strip() or c != c.strip() or "/" in c or c.startswith("."):
                raise ConfigError(f"[data] classes: {c!r} is not a usable folder name",
                                  hint="use plain names without '/', leading dots or surrounding spaces")
        dup = sorted({c for c in self.classes if self.classes.count(c) > 1})
        if dup:
            raise ConfigError(f"[data] classes lists {dup} twice", hint="list each class once")
        if self.classes and len(self.classes) < 2:
            raise ConfigError("[data] classes needs at least two classes")
        if self.kind == "series" and (self.window < 2 or self.channels < 1):
            raise ConfigError(f'[data] kind = "series" needs window >= 2 and channels >= 1, got window = '
                              f"{self.window}, channels = {self.channels}",
                              hint="window: samples per window (e.g. 128); channels: signals per sample (e.g. 3)")
        if self.kind == "audio" and self.channels != 1:
            raise ConfigError(f"[data] channels = {self.channels}: audio is read as mono (stereo is downmixed)",
                              hint="set channels = 1 (or leave it out)")
        if self.kind == "audio" and self.window and self.window < 640:
            raise ConfigError(f"[data] window = {self.window}: an audio clip must hold one 40-ms MFCC frame",
                              hint="use 16000 (1 s at 16 kHz) or leave it out")
        if self.kind == "image" and self.channels not in (1, 3):
            raise ConfigError(f"[data] channels = {self.channels}: images are grey (1) or RGB (3)",
                              hint="set channels = 1 (RGB is converted to grey) or 3")
        if not 8 <= self.image_size <= 1024:
            raise ConfigError(f"[data] image_size = {self.image_size}: must be 8 .. 1024 pixels",
                              hint="96 is MLPerf Tiny's visual-wake-words size; 32 the GeFL protocol's")
        if self.std is not None and self.std <= 0:
            raise ConfigError(f"[data] std must be > 0, got {self.std}")
