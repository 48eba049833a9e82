"""Fleet configuration (``fedge simulate CONFIG.toml``, ``fedge coordinator run --config``).

Example::

    [run]
    method = "fedproto"
    rounds = 10
    dataset = "digits"

    [partition]
    kind = "dirichlet"
    alpha = 0.3

    [[devices]]
    profile = "rpi-zero-2w"
    count = 2
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedge.common.asyncmode import AsyncSettings
from fedge.common.catalog import DATASETS, NUM_CLASSES, SIGNAL_SHAPES
from fedge.common.coordinator_section import CoordinatorSection
from fedge.common.families import GEFL_FAMILY
from fedge.common.preprocess import NORMALIZATION, Normalization, signal_normalization
from fedge.common.privacy import Mechanism, PrivacySettings
from fedge.common.sampling import Sampling
from fedge.common.settings import MethodSettings
from fedge.common.tensorcodec import PRECISIONS
from fedge.common.tomlconf import build, read_toml
from fedge.errors import ConfigError
from fedge.fleet.registry import method_entry
from fedge.fleet.shards import Shard, ShardSection, resolve_shards
from fedge.secagg.terms import refusal as secure_refusal


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


AVAILABILITIES = ("always", "onoff", "trace")


@dataclass(frozen=True)
class ClockSection:
    """``[clock]``: the virtual clock of ``fedge simulate`` (issue 27; docs/simulation.md, "The virtual clock").

    Each device's time in a round is the speed model's compute time for its training plus the bytes it
    downloads and uploads over its profile's link (half its round-trip time each way), times a seeded
    jitter; a device is online per ``availability``; a synchronous round lasts until its slowest
    participant delivers, or ``deadline_s``.
    """

    jitter: float = 0.0
    """σ of a mean-one lognormal factor drawn per device, round and part (compute, down, up); 0: none."""
    availability: str = "always"
    """``always``; ``onoff`` (exponential online / offline spells of the means below); ``trace`` (a CSV file)."""
    online_mean_s: float = 3600.0
    offline_mean_s: float = 0.0
    trace: str = ""
    """``availability = "trace"``: CSV ``device,online_from,online_to`` (virtual seconds), relative to this file."""
    deadline_s: float = 0.0
    """Virtual seconds a round waits; an update that would arrive later is lost (0: wait for every participant)."""
    seed: int | None = None
    """Seed of the jitter and the on/off spells (default: ``[run] seed``)."""

    def __post_init__(self) -> None:
        if not (0 <= self.jitter <= 3):
            raise ConfigError(f"[clock] jitter = {self.jitter:g}: must be between 0 and 3",
                              hint="σ of the lognormal jitter factor, e.g. 0.1 for ~10 % spread; 0 for none")
        if self.availability not in AVAILABILITIES:
            raise ConfigError(f"[clock] availability = {self.availability!r}: unknown model",
                              hint=f"use one of {', '.join(repr(a) for a in AVAILABILITIES)}")
        if not (self.online_mean_s > 0 and self.online_mean_s < float("inf")):
            raise ConfigError(f"[clock] online_mean_s = {self.online_mean_s:g}: must be a positive number of seconds",
                              hint="the mean length of a device's online spell, e.g. 3600")
        if not (0 <= self.offline_mean_s < float("inf")):
            raise ConfigError(f"[clock] offline_mean_s = {self.offline_mean_s:g}: must be >= 0 seconds",
                              hint="the mean length of an offline spell (0: never offline)")
        if self.availability == "trace" and not self.trace:
            raise ConfigError('[clock] availability = "trace" needs trace = "FILE.csv"',
                              hint="a CSV with the header device,online_from,online_to (docs/simulation.md)")
        if self.trace and self.availability != "trace":
            raise ConfigError(f"[clock] trace = {self.trace!r} is set but availability = {self.availability!r}",
                              hint='set availability = "trace" to use it, or remove trace')
        if not (0 <= self.deadline_s < float("inf")):
            raise ConfigError(f"[clock] deadline_s = {self.deadline_s:g}: must be >= 0 seconds",
                              hint="virtual seconds a round waits for its participants; 0: no deadline")
BACKENDS = ("sequential", "process", "ray")


@dataclass(frozen=True)
class SimulationSection:
    """Where ``fedge simulate`` runs the devices' local work (issue 30; docs/simulation.md, "Backends").

    ``sequential``: every device in this process, one after another. ``process``: ``workers`` worker
    processes on this machine. ``ray``: ``workers`` Ray actors, each reserving ``num_cpus`` CPUs and
    ``num_gpus`` GPUs (a fraction shares one GPU), on a local Ray or the cluster at ``address``. Each
    worker holds its devices for the whole run and trains them one at a time, so a device's resources
    are its worker's. ``threads``: torch intra-op threads per worker (default 1 for process workers,
    ``num_cpus`` for Ray actors, torch's own choice for sequential runs).
    """

    backend: str = "sequential"
    workers: int | None = None
    threads: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    address: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend = {self.backend!r} is not a simulation backend",
                              hint=f"set backend to one of {', '.join(repr(b) for b in BACKENDS)}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers = {self.workers}: a simulation needs at least one worker",
                              hint="set workers = 2 (one per core), or leave it out for one per available CPU")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads = {self.threads}: each worker needs at least one torch thread",
                              hint="set threads = 1 (bit-identical to any other backend at 1 thread)")
        if self.num_cpus <= 0:
            raise ConfigError(f"num_cpus = {self.num_cpus} must be > 0", hint="set num_cpus = 1 (one core per worker)")
        if self.num_gpus < 0:
            raise ConfigError(f"num_gpus = {self.num_gpus} must be >= 0",
                              hint="set num_gpus = 0 (CPU only) or a share such as 0.5")
        ray_only = [k for k, v, default in (("num_cpus", self.num_cpus, 1.0), ("num_gpus", self.num_gpus, 0.0),
                                            ("address", self.address, None)) if v != default]
        if ray_only and self.backend != "ray":
            raise ConfigError(f"{ray_only[0]} applies to the ray backend, not backend = {self.backend!r}",
                              hint=f'set backend = "ray", or remove {ray_only[0]}')

    @property
    def parallel(self) -> bool:
        """Whether devices train outside the driver process."""
        return self.backend != "sequential"


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


@dataclass(frozen=True)
class FleetConfig:
    """A whole fleet run."""

    run: RunSection
    devices: tuple[DeviceGroup, ...]
    partition: PartitionSection = field(default_factory=PartitionSection)
    train: TrainSection = field(default_factory=TrainSection)
    method: dict[str, Any] = field(default_factory=dict)
    # [coordinator], typed; sampling and asynchronous mode resolved against the fleet when it loads
    coordinator: CoordinatorSection = field(default_factory=CoordinatorSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)  # fedge.common.privacy (issue 18)
    clock: ClockSection = field(default_factory=ClockSection)  # fedge simulate's virtual clock (issue 27)
    simulation: SimulationSection = field(default_factory=SimulationSection)  # fedge simulate only (issue 30)
    # [[shards]]: the broker shard of every device and the tree of relays (fedge.fleet.shards; issue 29)
    shards: tuple[ShardSection, ...] = ()
    source: str = "<memory>"
    # The [method] table parsed once, by the run's method (both halves read it): unknown keys, wrong
    # types and out-of-range values fail here, at load time.
    method_config: MethodSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method_config", method_entry(self.run.method).parse(self.method))
        if self.coordinator.mode == "async" and self.privacy.enabled:
            raise ConfigError('[privacy] with [coordinator] mode = "async": the privacy ledger accounts synchronous '
                              "rounds, in which a device contributes once per release",
                              hint='drop mode = "async", or [privacy]')
        # sampling and asynchronous mode need the fleet's size and seed and its method: resolved here, once
        # (and again by dataclasses.replace, e.g. another seed)
        object.__setattr__(self, "coordinator", self.coordinator.resolve(
            fleet_size=self.num_devices, seed=self.run.seed, async_refusal=self.method_config.async_blocker(),
            method=self.run.method))
        d = self.data
        if self.partition.kind == "group" and self.run.dataset not in SIGNAL_SHAPES:
            raise ConfigError(f'{self.source}: [partition] kind = "group" splits by speaker or subject, which '
                              f"{self.run.dataset} has not",
                              hint=f"use it with {', '.join(SIGNAL_SHAPES)}, or kind = \"iid\" / \"dirichlet\"")
        if len(self.input_shape) == 2 and self.model.family == GEFL_FAMILY:
            what = f"[data] kind = {d.kind!r}" if self.own_data else f"[run] dataset = {self.run.dataset!r}"
            raise ConfigError(f"{self.source}: {what} is 1-D ({'x'.join(map(str, self.input_shape))}), the GeFL "
                              "CNN family takes images",
                              hint='set [model] family = "dscnn" for audio (its front end computes MFCCs) or '
                                   '"cnn1d" for sensor windows (docs/audio.md, docs/sensors.md)')
        if len(self.input_shape) == 3 and self.model.family == GEFL_FAMILY \
                and (d.channels, d.image_size) != ZOO_INPUT:
            raise ConfigError(f"{self.source}: [data] channels = {d.channels}, image_size = {d.image_size}: the "
                              f"GeFL CNN family takes {ZOO_INPUT[0]}x{ZOO_INPUT[1]}x{ZOO_INPUT[1]} inputs",
                              hint='set channels = 1 and image_size = 32, or pick a family that takes any size: '
                                   '[model] family = "mobilenet" (docs/models.md)')

    @property
    def family(self) -> str:
        """``[model] family``, a relative ``.py`` path resolved against the config's directory."""
        fam = self.model.family
        ref, sep, func = fam.rpartition(":")
        if sep and ref.endswith(".py") and not Path(ref).is_absolute():
            return f"{(self.base_dir / ref).resolve()}:{func}"
        return fam

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Every device's model input: (channels, samples) of a 1-D data set or of the devices' own audio / sensor
        files (``[data] kind``, ``channels``, ``window``), else (channels, height, width) from ``[data] channels``
        and ``image_size``."""
        d = self.data
        if self.own_data and d.kind != "image":
            return (d.channels, d.window or 16_000)
        if self.run.dataset in SIGNAL_SHAPES:
            return SIGNAL_SHAPES[self.run.dataset]
        return (d.channels, d.image_size, d.image_size)

    @functools.cached_property
    def privacy_mechanism(self) -> Mechanism | None:
        """The ``[privacy]`` mechanism every device applies and the coordinator accounts (None: off)."""
        if not self.privacy.enabled:
            return None
        stats = self.method_config.private_stats
        if not stats:
            raise ConfigError(f"{self.source}: [privacy] applies to fedproto and fedvtc, not {self.run.method!r}",
                              hint="leave [privacy] out for this method (docs/privacy.md)")
        return self.privacy.mechanism(stats=stats, num_classes=self.num_classes, rounds=self.run.rounds)

    @property
    def sampling(self) -> Sampling | None:
        """``[coordinator] sample`` / ``selection`` (None: every device trains every round); checked at load."""
        return self.coordinator.sampling

    @functools.cached_property
    def shard_layout(self) -> list[Shard]:
        """``[[shards]]`` checked against the fleet's devices (empty: no shards); checked at load."""
        if not self.shards:
            return []
        return resolve_shards(self.shards, [i for i, _ in device_ids(self)], source=self.source)

    @property
    def asynchronous(self) -> AsyncSettings | None:
        """``[coordinator] mode = "async"`` and its settings (None: synchronous rounds); checked at load."""
        return self.coordinator.asynchronous

    def check_backend(self) -> None:
        """``[simulation] backend`` against ``[coordinator] mode``: an asynchronous fleet is simulated by the
        sequential backend only (checked at load, and by ``fedge simulate`` again after ``--backend``)."""
        sim = self.simulation
        if self.asynchronous is None or not sim.parallel:
            return
        raise ConfigError(
            f'{self.source}: [simulation] backend = {sim.backend!r} with [coordinator] mode = "async": an asynchronous '
            "simulation is a chain of events in virtual time in which each device starts from the version the "
            "updates before it made (fedge.sim.clocked_async), so it trains its devices one after another in one "
            "process; worker processes or Ray actors would wait on each other",
            hint='use backend = "sequential" (or --backend sequential, or leave it out) with mode = "async", or drop '
                 f'mode = "async" to train synchronous rounds with the {sim.backend} backend')

    @property
    def base_dir(self) -> Path:
        """Directory that relative paths (profiles, data) are resolved against."""
        return Path(self.source).parent if self.source != "<memory>" else Path.cwd()

    @property
    def num_devices(self) -> int:
        return sum(g.count for g in self.devices)

    @property
    def own_data(self) -> bool:
        """Whether devices train on their own data (``[data] classes`` is set)."""
        return bool(self.data.classes)

    @property
    def num_classes(self) -> int:
        """Classes of the fleet's models: ``[data] classes``, else the benchmark data set's."""
        return len(self.data.classes) if self.own_data else NUM_CLASSES[self.run.dataset]

    def input_norm(self) -> Normalization:
        """The preprocessing of the fleet's own data: ``[data]`` over the run data set's defaults (none for audio
        clips and sensor windows, which reach the model as read)."""
        d = self.data
        if d.kind != "image":
            channels, samples = self.input_shape
            return signal_normalization(d.kind, channels, samples)
        base = NORMALIZATION[self.run.dataset] if self.run.dataset in NORMALIZATION else NORMALIZATION["digits"]
        return Normalization(base.mean if d.mean is None else d.mean, base.std if d.std is None else d.std,
                             size=d.image_size, channels=d.channels)


def device_ids(cfg: FleetConfig) -> list[tuple[str, int]]:
    """(device id, group index) for every device, in fleet order."""
    out = []
    for gi, g in enumerate(cfg.devices):
        prefix = g.id_prefix or g.profile.rsplit("/", 1)[-1].removesuffix(".toml")
        out += [(f"{prefix}-{i + 1}", gi) for i in range(g.count)]
    # counted once (not ids.count per id: that is quadratic, 5 s for a 20,000-device fleet)
    dup = {i for i, k in Counter(i for i, _ in out).items() if k > 1}
    if dup:
        raise ConfigError(f"{cfg.source}: duplicate device ids {sorted(dup)}", hint="give groups distinct id_prefix")
    return out


def parse_fleet(data: dict[str, Any], *, source: str = "<memory>") -> FleetConfig:
    """Build a :class:`FleetConfig` from a parsed TOML document."""
    data = dict(data)
    groups = data.pop("devices", None)
    if not groups:
        raise ConfigError(f"{source}: no [[devices]] tables", hint="add at least one [[devices]] with a profile")
    if not isinstance(groups, list):
        raise ConfigError(f"{source}: devices must be an array of tables ([[devices]])")
    devices = tuple(build(DeviceGroup, g, source=source, section=f"devices[{i}]") for i, g in enumerate(groups))
    shard_tables = data.pop("shards", [])
    if not isinstance(shard_tables, list):
        raise ConfigError(f"{source}: shards must be an array of tables ([[shards]])",
                          hint="write one [[shards]] table per broker shard (docs/scale.md)")
    shards = tuple(build(ShardSection, t, source=source, section=f"shards[{i}]") for i, t in enumerate(shard_tables))
    cfg = build(FleetConfig, {**data, "devices": devices, "shards": shards, "source": source}, source=source)
    cfg.check_backend()  # async with a parallel simulation backend fails now, at load time
    cfg.shard_layout  # noqa: B018  (overlapping, unassigned or unknown devices, cycles: refused now)
    if "privacy" in data:
        if not cfg.privacy.enabled and not cfg.privacy.secure_aggregation:
            raise ConfigError(f"{source}: [privacy] sets neither noise_multiplier nor epsilon",
                              hint="add `epsilon = 4` (total ε of the run), `noise_multiplier = 1.0`, or "
                                   "`secure_aggregation = true`")
        cfg.privacy_mechanism  # noqa: B018  (a method without statistics fails now, at load time)
        if cfg.privacy.secure_aggregation:  # what cannot run on masked sums is refused now (fedge.secagg.terms)
            why = secure_refusal(cfg.run.method, robust=cfg.coordinator.aggregation_rule().robust,
                                 asynchronous=cfg.coordinator.mode == "async")
            if why:
                raise ConfigError(f"{source}: [privacy] secure_aggregation: {why}",
                                  hint="leave secure_aggregation out, or change what the message names")
    return cfg


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and validate a fleet config file."""
    return parse_fleet(read_toml(path), source=str(path))
