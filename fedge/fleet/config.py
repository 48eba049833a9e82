"""Fleet configuration (``fedge simulate CONFIG.toml``, ``fedge coordinator run --config``): the whole
:class:`FleetConfig`, its device ids, parsing and loading; its tables are in :mod:`fedge.fleet.sections` and
:mod:`fedge.fleet.sim_sections`.

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
from typing import Any

from fedge.common.asyncmode import AsyncSettings
from fedge.common.catalog import NUM_CLASSES, SIGNAL_SHAPES
from fedge.common.coordinator_section import CoordinatorSection
from fedge.common.families import GEFL_FAMILY
from fedge.common.preprocess import NORMALIZATION, Normalization, signal_normalization
from fedge.common.privacy import Mechanism, PrivacySettings
from fedge.common.sampling import Sampling
from fedge.common.settings import MethodSettings
from fedge.common.tomlconf import build, read_toml
from fedge.errors import ConfigError
from fedge.fleet.registry import method_entry
from fedge.fleet.sections import (
    ZOO_INPUT,
    DataSection,
    DeviceGroup,
    ModelSection,
    PartitionSection,
    RunSection,
    TrainSection,
)
from fedge.fleet.shards import Shard, ShardSection, resolve_shards
from fedge.fleet.sim_sections import ClockSection, SimulationSection
from fedge.secagg.terms import refusal as secure_refusal


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
