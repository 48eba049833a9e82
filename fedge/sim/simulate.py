"""``fedge simulate``: a whole fleet in one process, through the real round engine.

Devices and coordinator exchange encoded messages over a transport exactly as
they would over MQTT; ``transport="inprocess"`` steps devices synchronously in
fleet order (deterministic), ``"mqtt"`` runs them over an embedded broker. The
transports are a table, :data:`fedge.sim.transports.TRANSPORTS`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.common.transport import CoordinatorTransport
from fedge.coordinator.config import engine_config
from fedge.coordinator.engine import RoundEngine, RoundReport
from fedge.coordinator.strategy import Arrays, Strategy
from fedge.edge.agent import DeviceAgent
from fedge.edge.best import BestRecord
from fedge.edge.models.checkpoint import save_checkpoint
from fedge.errors import ConfigError
from fedge.fleet.clock import FleetClock, fleet_clock
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import SimDevice, build_devices, load_fleet_data
from fedge.fleet.registry import method_entry
from fedge.fleet.slots import DeviceSlot, check_feature_dims, checked_slots, device_slots
from fedge.sim.clocked import check_transport, replay_clock
from fedge.sim.parallel import LostDevice, sequential_run
from fedge.sim.transports import transport_runner

if TYPE_CHECKING:
    from fedge.sim.transports import TransportRunner

log = logging.getLogger(__name__)

@dataclass
class SimResult:
    """Everything a finished simulation measured."""

    cfg: FleetConfig
    devices: list[SimDevice]
    agents: list[DeviceAgent]
    reports: list[RoundReport]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)  # "simulation": the backend's facts (results.json)
    lost: list[LostDevice] = field(default_factory=list)  # devices whose worker died (parallel backends)
    globals: dict[str, Arrays] = field(default_factory=dict)  # the last global state the coordinator published
    clock: FleetClock | None = None
    """The run in virtual time (``[clock]``; over MQTT or from worker processes replayed from the reports)."""


def build_fleet(cfg: FleetConfig) -> tuple[list[SimDevice], Strategy]:
    """The devices of ``cfg`` with their data shares, and the coordinator half of its method."""
    data = load_fleet_data(cfg)
    strat = method_entry(cfg.run.method).build_strategy(cfg.method_config, num_classes=data.train.num_classes,
                                                         rounds=cfg.run.rounds)
    return build_devices(cfg, data), strat


def run_rounds(cfg: FleetConfig, devices: list[SimDevice], strat: Strategy, *,
               transport: str | TransportRunner = "inprocess",
               on_round: Callable[[RoundReport], None] | None = None) -> tuple[list[DeviceAgent], list[RoundReport]]:
    """Every round of ``cfg`` over ``transport`` with devices already built (``build_fleet``), which a
    caller may prepare first (e.g. a benchmark that withholds part of each device's data). ``transport``
    is a name of :data:`~fedge.sim.transports.TRANSPORTS` or a runner of one's own (e.g. an in-process bus
    on which a device stops answering, to replay an emulated fault)."""
    agents, engine, _ = _run_rounds(cfg, devices, strat, transport=transport, on_round=on_round)
    return agents, engine.reports


def run_timed(cfg: FleetConfig, devices: list[SimDevice], strat: Strategy, *,
              transport: str | TransportRunner = "inprocess",
              on_round: Callable[[RoundReport], None] | None = None,
              ) -> tuple[list[DeviceAgent], list[RoundReport], FleetClock | None]:
    """:func:`run_rounds`, and the run in virtual time (``[clock]``; over MQTT or a runner of one's own timed
    afterwards from the reports)."""
    agents, engine, clock = _run_rounds(cfg, devices, strat, transport=transport, on_round=on_round)
    return agents, engine.reports, clock


def _run_rounds(cfg: FleetConfig, devices: list[SimDevice], strat: Strategy, *, transport: str | TransportRunner,
                on_round: Callable[[RoundReport], None] | None
                ) -> tuple[list[DeviceAgent], RoundEngine, FleetClock | None]:
    if callable(transport):
        connect = transport
    else:
        check_transport(cfg.clock.availability, transport)
        connect = transport_runner(transport)
    coord, agents, cleanup = connect(cfg, devices)
    bind = getattr(coord, "bind_strategy", None)  # secure aggregation: the group sums go to the strategy
    if bind is not None:
        bind(strat)
    try:
        slots = checked_slots(cfg)
        engine = _engine(cfg, strat, coord, slots)
        engine.run(on_round=on_round)
        return agents, engine, _clock_of(cfg, coord, slots, engine.reports)
    finally:
        cleanup()


def _clock_of(cfg: FleetConfig, coord: CoordinatorTransport, slots: list[DeviceSlot],
              reports: list[RoundReport], unused: FleetClock | None = None) -> FleetClock | None:
    """The in-process transport's own clock, or (a transport on the real clock, worker processes) the rounds
    timed afterwards from the reports — into ``unused``, a fleet clock no round was timed on yet, if the caller
    has one; None for asynchronous versions on the real clock (over MQTT), which have no synchronous replay."""
    clock = getattr(coord, "clock", None)
    if isinstance(clock, FleetClock):
        return clock
    if cfg.asynchronous is not None:
        return None
    return replay_clock(unused or fleet_clock(cfg, slots), reports)


def _engine(cfg: FleetConfig, strat: Strategy, coord: CoordinatorTransport, slots: list[DeviceSlot]) -> RoundEngine:
    """The round engine of a simulation, configured by the factory ``fedge coordinator run`` uses: the same
    aggregation, clipping, size limit, sampling and asynchronous mode, and the devices' hellos checked
    against the fleet config's slots. With availability, a round waits until one device is online (the clock
    moves to its return)."""
    config = engine_config(
        cfg.coordinator, fleet=cfg.run.fleet, method=cfg.run.method, slots=slots, own_data=cfg.own_data,
        privacy=cfg.privacy_mechanism, simulated=True, always_online=cfg.clock.availability == "always")
    if cfg.privacy.secure_aggregation and coord.stages:  # over MQTT: the engine drives the stages
        config = dataclasses.replace(config, secure=cfg.privacy)  # (in-process: fedge.sim.secure sums them)
    return RoundEngine(strat, coord, config)


def simulate(cfg: FleetConfig, *, transport: str = "inprocess", out_dir: str | Path | None = None,
             on_round: Callable[[RoundReport], None] | None = None) -> SimResult:
    """Run ``cfg`` end to end; with ``out_dir``, save each device's final model there.

    ``cfg.simulation`` says where the devices train: here, one after another (``sequential``), or in
    worker processes or Ray actors (:mod:`fedge.sim.parallel`), with the same results.
    """
    transport_runner(transport)  # an unknown name fails before any work
    sim = cfg.simulation
    if sim.parallel and transport != "inprocess":
        raise ConfigError(
            f"[simulation] backend = {sim.backend!r} trains devices in workers over the in-process transport; "
            f"--transport {transport} already runs every device concurrently, each in its own thread with its own "
            "broker connection, which is the point of simulating over it",
            hint='use backend = "sequential" with --transport mqtt, or --transport inprocess with the '
                 f'{sim.backend} backend (real devices in separate processes: `fedge edge run`, docs/mqtt.md)')
    check_transport(cfg.clock.availability, transport)
    cfg.coordinator.refuse_in_simulation(cfg.source)  # a wall-clock deadline or quorum: before any work
    if cfg.privacy.secure_aggregation and sim.parallel:
        raise ConfigError(f"[privacy] secure_aggregation runs in the simulation with the sequential backend only "
                          f"(here: backend {sim.backend!r}); in worker processes it is not built yet",
                          hint='use [simulation] backend = "sequential" (--transport inprocess or mqtt)')
    cfg.check_backend()  # asynchronous mode: sequential only (again: --backend may have changed it since the load)
    if sim.parallel and (cfg.clock.availability != "always" or cfg.clock.deadline_s):
        key = (f"availability = {cfg.clock.availability!r}" if cfg.clock.availability != "always"
               else f"deadline_s = {cfg.clock.deadline_s:g}")
        raise ConfigError(
            f"[clock] {key} is simulated by the sequential in-process run only (it decides, device by device, "
            f"who is online and whose update arrives in time); backend = {sim.backend!r} trains in workers",
            hint='use backend = "sequential" with it, or drop it for the parallel backend')
    if sim.backend == "ray":
        from fedge.sim.raypool import import_ray

        import_ray()  # without the extra, say so before any data is loaded
    t0 = time.perf_counter()
    if sim.threads is not None and not sim.parallel:
        torch_threads(sim.threads)
    lost: list[LostDevice] = []
    if sim.parallel:
        devices, agents, reports, final_globals, extra, lost, clock = _run_parallel(cfg, on_round)
    else:
        devices, strat = build_fleet(cfg)
        agents, engine, clock = _run_rounds(cfg, devices, strat, transport=transport, on_round=on_round)
        reports, final_globals = engine.reports, engine.globals
        extra = {"simulation": sequential_run(devices)}
    if out_dir is not None:
        save_device_checkpoints(cfg, devices, reports, Path(out_dir) / "checkpoints")
    return SimResult(cfg, devices, agents, reports, time.perf_counter() - t0, extra, lost, final_globals, clock)


def save_device_checkpoints(cfg: FleetConfig, devices: list[SimDevice], reports: list[RoundReport],
                            ckpt_dir: Path) -> None:
    """Each device's best model (by its validation fold, :mod:`fedge.edge.best`) as ``<device>.safetensors``,
    what ``fedge export`` ships, and its last model as ``<device>.last.safetensors`` (``fedge export --last``).
    Both record the last round (``fedge.last.*``: round, validation, global and local accuracy) and which one
    they are (``fedge.checkpoint``); the best one also ``fedge.best.*``, the round it came from."""
    last_round = reports[-1].round if reports else 0
    for d in devices:
        dev = d.info.device_id
        base = {"fedge.profile": d.info.profile, "fedge.dataset": cfg.run.dataset}
        model = d.method.ctx.model
        last_m = reports[-1].metrics.get(dev, {}) if reports else {}
        last = BestRecord(last_round, last_m.get("acc_val"), last_m.get("acc_global"), last_m.get("acc_local"))
        save_checkpoint(model, ckpt_dir / f"{dev}.last.safetensors",
                        extra={**base, "fedge.checkpoint": "last", **last.meta("fedge.last")})
        best = d.method.best
        record = best.record or last
        save_checkpoint(best.model(model), ckpt_dir / f"{dev}.safetensors",
                        extra={**base, "fedge.checkpoint": "best", **record.meta(), **last.meta("fedge.last")})


def torch_threads(n: int) -> None:
    """torch intra-op threads of this process (``[simulation] threads`` of a sequential run)."""
    import torch

    torch.set_num_threads(n)


def _run_parallel(cfg: FleetConfig, on_round: Callable[[RoundReport], None] | None
                  ) -> tuple[list[SimDevice], list[DeviceAgent], list[RoundReport], dict[str, Arrays],
                             dict[str, Any], list[LostDevice], FleetClock | None]:
    """The rounds with the devices in worker processes or Ray actors (:mod:`fedge.sim.parallel`)."""
    from fedge.sim.parallel import ParallelFleet, make_pool

    pool, workers = make_pool(cfg.simulation, cfg.num_devices)
    try:
        pool.spawn(workers)  # the workers start and import torch while this process loads the data
        data = load_fleet_data(cfg)
        slots = device_slots(cfg, data.train.y)
        entry = method_entry(cfg.run.method)
        check_feature_dims(cfg, (s.feature_dim for s in slots), shares_features=entry.shares_features)
        strat = entry.build_strategy(cfg.method_config, num_classes=data.train.num_classes, rounds=cfg.run.rounds)
        fleet = ParallelFleet(cfg, data, slots, pool, workers)
        del data  # the fleet drops the training images once the workers hold their shares
        coord = fleet.start()
        engine = _engine(cfg, strat, coord, slots)
        engine.run(on_round=on_round)
        devices, agents, lost = fleet.finish()
    finally:
        pool.close()
    return (devices, agents, engine.reports, engine.globals, {"simulation": fleet.run.to_dict()}, lost,
            _clock_of(cfg, coord, slots, engine.reports, fleet.clock))  # the workers' train_s came from it
