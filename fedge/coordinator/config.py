"""The coordinator's settings: one frozen, self-validating :class:`EngineConfig`."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedge.common.asyncmode import AsyncSettings
from fedge.common.coordinator_section import DEADLINE_KEYS, QUORUM_KEYS, Aggregation, CoordinatorSection
from fedge.common.heat import HeatLimits
from fedge.common.privacy import Mechanism, PrivacySettings
from fedge.common.rounds import DeviceInfo
from fedge.common.sampling import Sampling, thermal_guarded
from fedge.errors import ConfigError
from fedge.secagg import DEFAULT_STAGE_S

DEFAULT_MAX_UPDATE_BYTES = 64 * 1024 * 1024
# The default ("auto") timeout of a device's work over a network (EngineConfig.round_timeout_s = None): an
# asynchronous task may go unanswered max(floor, factor x its device's expected task time) — what the device took
# for its earlier tasks, else the estimate its hello or the fleet config's clock model gives — before it is
# withdrawn and handed out again; a device whose speed nobody knows gets UNKNOWN_SPEED_TIMEOUT_S (a synchronous
# round with such a device too, as before).
TASK_TIMEOUT_FLOOR_S = 60.0
TASK_TIMEOUT_FACTOR = 3.0
UNKNOWN_SPEED_TIMEOUT_S = 300.0
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
    # Seconds one task of this device takes by the fleet config's clock model (its compute, evaluation and
    # transfers; None: not known): its task timeout's basis until it has delivered one (EngineConfig.round_timeout_s).
    expected_task_s: float | None = None
    # Where its profile says it becomes hot and cools again ([thermal] limit_c, resume_c; None: the defaults): the
    # thermal guard's limits for its heartbeats (fedge.common.heat).
    heat: HeatLimits | None = None

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
    # How long a device may leave its work unanswered; 0: wait for it. None ("auto", the default here and on the
    # command line; fedge.coordinator.engine.RoundEngine.task_timeout_s): over a network, an asynchronous task is
    # withdrawn after max(TASK_TIMEOUT_FLOOR_S, TASK_TIMEOUT_FACTOR x the device's expected task time), and a round
    # of a device of unknown speed gets UNKNOWN_SPEED_TIMEOUT_S; in-process (nothing is ever lost) no timeout.
    round_timeout_s: float | None = None
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
    # [[shards]]: relay account -> the devices it may report in its partials (a relay listing another shard's
    # device is refused, partial-foreign; an account that is none of these, partial-unauthorized). None: any
    # account the broker lets publish a partial, for any registered device (aggregation workers). Set by the one
    # factory, fedge.coordinator.fromfleet.engine_parts, for the root and for each relay.
    partial_reporters: Mapping[str, frozenset[str]] | None = None
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
    # [privacy] secure_aggregation over a transport that carries stage messages (fedge.coordinator.secure): the
    # settings (threshold, neighbours, clipping range, field size); None: plain rounds. ``secure_stage_s``: how long
    # each stage after the first waits for the devices' answers.
    secure: PrivacySettings | None = None
    secure_stage_s: float = DEFAULT_STAGE_S

    @property
    def thermal_guard(self) -> bool:
        """``[coordinator] thermal_guard``: of the utility selections in synchronous rounds, of the task assignment
        in asynchronous mode (fedge.common.heat)."""
        return thermal_guarded(self.sampling, self.asynchronous)

    def __post_init__(self) -> None:
        if self.min_devices < 0:
            raise ConfigError(f"min_devices must be >= 0, got {self.min_devices}")
        if not 0 <= self.quorum_fraction <= 1:
            raise ConfigError(f"quorum must be a fraction in [0, 1], got {self.quorum_fraction}")
        for name in ("deadline_slack", "round_timeout_s", "min_round_s", "max_round_s", "quorum_timeout_s"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_update_bytes < 1:
            raise ConfigError(f"max_update_bytes must be >= 1, got {self.max_update_bytes}")
        if not self.secure_stage_s > 0:
            raise ConfigError(f"secure_stage_s must be > 0, got {self.secure_stage_s}")
        if self.keep_reports < 0:
            raise ConfigError(f"keep_reports must be >= 0, got {self.keep_reports}")


# `fedge coordinator run`'s waits when neither a flag nor the fleet's [coordinator] table sets them. round_timeout_s
# None: "auto", EngineConfig's own default (TASK_TIMEOUT_FLOOR_S ...).
SERVICE_DEFAULTS: dict[str, float | None] = {
    "min_devices": 1, "quorum": 0.5, "quorum_timeout_s": 600.0, "deadline_slack": 2.0, "round_timeout_s": None,
    "min_round_s": 5.0, "max_round_s": 3600.0,
}


def engine_config(section: CoordinatorSection, *, fleet: str, method: str, slots: Collection[Slot], own_data: bool,
                  privacy: Mechanism | None = None, simulated: bool = False, always_online: bool = True,
                  any_device: bool = False, keep_reports: int = 0) -> EngineConfig:
    """The round engine's configuration from a fleet config's ``[coordinator]`` table (``section``, flags
    applied) and its devices' ``slots``: one factory for ``fedge coordinator run`` and ``fedge simulate``, so
    that aggregation, clipping, the size limit, sampling and asynchronous mode mean the same in both.

    ``simulated``: ``fedge simulate``, whose rounds run on the virtual clock: a deadline or quorum key is refused
    naming why (:meth:`CoordinatorSection.refuse_in_simulation`), every round waits for every device it expects
    (the clock's ``deadline_s`` cuts them instead), and with ``always_online`` False (``[clock] availability``)
    it starts once one device is online. Otherwise the service's waits: the table's, else
    :data:`SERVICE_DEFAULTS`; ``any_device``: hellos from devices not in ``slots`` are accepted too.
    """
    ids = [s.device_id for s in slots]
    if simulated:
        section.refuse_in_simulation()
        # round_timeout_s 0: no wall-clock timeout of a task or round, even over MQTT (simulate --transport mqtt)
        waits: dict[str, Any] = {"min_devices": 0 if always_online else 1, "round_timeout_s": 0.0}
    else:
        given = section.given(DEADLINE_KEYS + QUORUM_KEYS)
        picked = {k: given.get(k, default) for k, default in SERVICE_DEFAULTS.items()}
        waits = {"min_devices": int(picked["min_devices"] or 0), "quorum_fraction": picked["quorum"],
                 "quorum_timeout_s": picked["quorum_timeout_s"], "deadline_slack": picked["deadline_slack"],
                 "round_timeout_s": picked["round_timeout_s"], "min_round_s": picked["min_round_s"],
                 "max_round_s": picked["max_round_s"], "expected_devices": len(ids),
                 "allowed_devices": None if any_device else frozenset(ids)}
    return EngineConfig(
        fleet=fleet, method=method, **waits,
        max_update_bytes=section.max_update_bytes or DEFAULT_MAX_UPDATE_BYTES, keep_reports=keep_reports,
        aggregation=section.aggregation_rule(),
        # every hello is checked against its device's slot (arch, precision, samples, embedding size)
        slots=slot_checks(slots, own_data=own_data), privacy=privacy,
        sampling=section.sampling, asynchronous=section.asynchronous)
