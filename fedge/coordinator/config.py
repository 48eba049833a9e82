"""The coordinator's settings: one frozen, self-validating :class:`EngineConfig`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fedge.common.asyncmode import AsyncSettings
from fedge.common.privacy import Mechanism
from fedge.common.rounds import DeviceInfo
from fedge.common.sampling import Sampling
from fedge.coordinator.aggregate import Aggregation
from fedge.errors import ConfigError

DEFAULT_MAX_UPDATE_BYTES = 64 * 1024 * 1024
COORDINATOR_ID = "coordinator"  # the sender of every message the coordinator publishes


# Hello fields a device's slot fixes (benchmark data: the fleet config partitions it, so all are known).
SLOT_FIELDS: tuple[str, ...] = ("device_id", "profile", "arch", "upload_precision", "num_samples", "feature_dim")
# What the fleet config fixes for a device that trains on its own data.
OWN_DATA_FIELDS: tuple[str, ...] = ("device_id", "profile", "feature_dim")


@dataclass(frozen=True)
class DeviceSlotCheck:
    """What the fleet config says one device is: its hello must announce exactly ``info``'s fields.

    Built by the coordinator CLI from the fleet layer's per-device slot (the library takes it as
    data and never computes it). ``classes``: the labels the device holds (None: unchecked); an
    update may count samples only in those classes.
    """

    info: DeviceInfo
    classes: tuple[int, ...] | None = None
    # The hello fields that must equal ``info``'s. A device on its own data (``fedge edge run --data``)
    # sizes its model and upload from a sample count only it knows: only OWN_DATA_FIELDS are checked.
    fields: tuple[str, ...] = SLOT_FIELDS

    def mismatches(self, hello: DeviceInfo) -> list[str]:
        """How ``hello`` differs from this slot: one ``"field: expected X, got Y"`` per field."""
        return [
            f"{name}: expected {getattr(self.info, name)!r}, got {getattr(hello, name)!r}"
            for name in self.fields
            if getattr(self.info, name) != getattr(hello, name)
        ]


class Slot(Protocol):
    """What the fleet layer says about one device (``fedge.fleet.slots.DeviceSlot``), as data."""

    @property
    def device_id(self) -> str: ...
    @property
    def classes(self) -> tuple[int, ...]: ...
    def info(self) -> DeviceInfo: ...


def slot_checks(slots: Iterable[Slot], *, own_data: bool) -> dict[str, DeviceSlotCheck]:
    """One :class:`DeviceSlotCheck` per device of the fleet config (``own_data``: its devices train on
    their own data, so only :data:`OWN_DATA_FIELDS` are known and class counts are not restricted)."""
    if own_data:
        return {s.device_id: DeviceSlotCheck(s.info(), None, OWN_DATA_FIELDS) for s in slots}
    return {s.device_id: DeviceSlotCheck(s.info(), tuple(s.classes)) for s in slots}


@dataclass(frozen=True)
class EngineConfig:
    """Round-loop settings (fleet config and ``fedge coordinator run`` flags → engine).

    The defaults suit an in-process run (no deadline, no quorum); ``fedge coordinator run``
    passes its own (see :mod:`fedge.coordinator.cli`).
    """

    fleet: str = "default"
    method: str = "fedavg"
    round_timeout_s: float = 0.0  # budget for a round with an unknown device; 0: wait for every online device
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    global_precision: str = "fp32"
    # Quorum: a round starts once max(min_devices, ceil(quorum_fraction * expected_devices))
    # registered devices are online; waiting longer than quorum_timeout_s is an error.
    min_devices: int = 0
    quorum_fraction: float = 0.0
    expected_devices: int = 0
    quorum_timeout_s: float = 600.0
    # Deadline from the slowest expected device: slack * its estimated round time (its measured
    # latency in earlier rounds of the same phase, else the ``est_round_s`` of its hello),
    # clamped to [min_round_s, max_round_s]. slack 0 disables it (round_timeout_s alone applies).
    deadline_slack: float = 0.0
    min_round_s: float = 5.0
    max_round_s: float = 0.0  # 0: no upper bound
    # Devices allowed to register (None: any device that says hello).
    allowed_devices: frozenset[str] | None = None
    # What each device of the fleet config is (None: unchecked): a hello that contradicts its
    # device's slot is refused (reason hello-slot), and its updates count only its own classes.
    slots: Mapping[str, DeviceSlotCheck] | None = None
    # How updates are combined (fedavg, lgfedavg and fedproto; the generative methods always average).
    aggregation: Aggregation = field(default_factory=Aggregation)
    # Round reports kept in memory (0: all). With a state dir every report is in reports.jsonl, so a
    # long-running coordinator keeps only the last few: per-device report entries would otherwise grow
    # its memory by ~1 KB per device per round.
    keep_reports: int = 0
    # [privacy]: the mechanism the devices apply; the engine reports ε per round and stops (or warns)
    # once the budget is spent (fedge.common.privacy).
    privacy: Mechanism | None = None
    # [coordinator] sample / selection: which devices train each round (None: every online device).
    sampling: Sampling | None = None
    # [coordinator] mode = "async": buffered asynchronous aggregation (None: synchronous rounds).
    asynchronous: AsyncSettings | None = None

    def __post_init__(self) -> None:
        if self.min_devices < 0:
            raise ConfigError(f"min_devices must be >= 0, got {self.min_devices}")
        if not 0 <= self.quorum_fraction <= 1:
            raise ConfigError(f"quorum must be a fraction in [0, 1], got {self.quorum_fraction}")
        for name in ("deadline_slack", "round_timeout_s", "min_round_s", "max_round_s", "quorum_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_update_bytes < 1:
            raise ConfigError(f"max_update_bytes must be >= 1, got {self.max_update_bytes}")
        if self.keep_reports < 0:
            raise ConfigError(f"keep_reports must be >= 0, got {self.keep_reports}")


@dataclass(frozen=True)
class CoordinatorSection:
    """The fleet config's optional ``[coordinator]`` table; ``fedge coordinator run`` flags override it.

    Unset keys fall back to the command's defaults. Example::

        [coordinator]
        aggregation = "trimmed"   # mean | trimmed | median
        trim = 0.2                # trimmed: fraction of the devices cut at each end of every coordinate
        clip = 2.0                # clip each update to 2 x the median distance from the median (0: off)
        quorum = 0.8
        deadline_slack = 3.0
    """

    aggregation: str = "mean"
    trim: float = 0.2
    clip: float = 0.0
    min_devices: int | None = None
    quorum: float | None = None
    quorum_timeout_s: float | None = None
    deadline_slack: float | None = None
    round_timeout_s: float | None = None
    min_round_s: float | None = None
    max_round_s: float | None = None
    max_update_bytes: int | None = None
    # client sampling (fedge.common.sampling; the fleet config checks them when it loads)
    sample: float | None = None
    selection: str = "available"
    # asynchronous mode (fedge.common.asyncmode; the fleet config checks them when it loads)
    mode: str = "sync"
    buffer_size: int | None = None
    max_staleness: int | None = None
    staleness_weight: str | None = None
    staleness_exponent: float | None = None
    hinge_a: float | None = None
    hinge_b: float | None = None
    concurrency: int | None = None

    def aggregation_rule(self) -> Aggregation:
        """The :class:`Aggregation` this table selects (validated)."""
        return Aggregation(self.aggregation, self.trim, self.clip)
