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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedge.common.catalog import DATASETS
from fedge.common.tensorcodec import PRECISIONS
from fedge.common.tomlconf import build, read_toml
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

    def __post_init__(self) -> None:
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

    kind: Literal["iid", "dirichlet", "shards"] = "iid"
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


@dataclass(frozen=True)
class TrainSection:
    """Overrides of the plan's local-training settings (unset: the plan decides)."""

    lr: float = 0.1
    batch_size: int | None = None
    local_epochs: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
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

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"device count must be >= 1, got {self.count}")
        if self.arch and self.archs:
            raise ConfigError("set either arch or archs for a device group, not both")
        if self.upload_precision is not None and self.upload_precision not in PRECISIONS:
            raise ConfigError(f"upload_precision {self.upload_precision!r} is not a precision",
                              hint=f"use one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class FleetConfig:
    """A whole fleet run."""

    run: RunSection
    devices: tuple[DeviceGroup, ...]
    partition: PartitionSection = field(default_factory=PartitionSection)
    train: TrainSection = field(default_factory=TrainSection)
    method: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    @property
    def base_dir(self) -> Path:
        """Directory that relative paths (profiles, data) are resolved against."""
        return Path(self.source).parent if self.source != "<memory>" else Path.cwd()

    @property
    def num_devices(self) -> int:
        return sum(g.count for g in self.devices)


def device_ids(cfg: FleetConfig) -> list[tuple[str, int]]:
    """(device id, group index) for every device, in fleet order."""
    out = []
    for gi, g in enumerate(cfg.devices):
        prefix = g.id_prefix or g.profile.rsplit("/", 1)[-1].removesuffix(".toml")
        out += [(f"{prefix}-{i + 1}", gi) for i in range(g.count)]
    ids = [i for i, _ in out]
    dup = {i for i in ids if ids.count(i) > 1}
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
    return build(FleetConfig, {**data, "devices": devices, "source": source}, source=source)


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and validate a fleet config file."""
    return parse_fleet(read_toml(path), source=str(path))
