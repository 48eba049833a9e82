"""``fedge simulate``: a whole fleet in one process, through the real round engine.

Devices and coordinator exchange encoded messages over a transport exactly as
they would over MQTT; ``transport="inprocess"`` steps devices synchronously in
fleet order (deterministic), ``"mqtt"`` runs them over an embedded broker. The
transports are a table, :data:`fedge.sim.transports.TRANSPORTS`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.coordinator.config import slot_checks
from fedge.coordinator.engine import EngineConfig, RoundEngine, RoundReport
from fedge.coordinator.strategy import Strategy
from fedge.edge.agent import DeviceAgent
from fedge.edge.models.checkpoint import save_checkpoint
from fedge.fleet.clock import FleetClock, fleet_clock
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import SimDevice, build_devices, load_fleet_data
from fedge.fleet.registry import method_entry
from fedge.fleet.slots import checked_slots
from fedge.sim.clocked import check_transport, replay_clock
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
    extra: dict[str, Any] = field(default_factory=dict)
    clock: FleetClock | None = None
    """The run in virtual time (``[clock]``; over MQTT replayed from the reports)."""


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
    agents, reports, _ = run_timed(cfg, devices, strat, transport=transport, on_round=on_round)
    return agents, reports


def run_timed(cfg: FleetConfig, devices: list[SimDevice], strat: Strategy, *,
              transport: str | TransportRunner = "inprocess",
              on_round: Callable[[RoundReport], None] | None = None,
              ) -> tuple[list[DeviceAgent], list[RoundReport], FleetClock | None]:
    """:func:`run_rounds`, and the run in virtual time (``[clock]``; over MQTT or a runner of one's own timed
    afterwards from the reports)."""
    if callable(transport):
        connect = transport
    else:
        check_transport(cfg.clock.availability, transport)
        connect = transport_runner(transport)
    coord, agents, cleanup = connect(cfg, devices)
    try:
        # the devices' hellos are checked against the fleet config's slots, as `fedge coordinator run` does
        checked = checked_slots(cfg)
        slots = slot_checks(checked, own_data=cfg.own_data)
        # with availability, a round waits until one device is online (the clock moves to its return)
        quorum = 0 if cfg.clock.availability == "always" else 1
        engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method, slots=slots,
                                                          privacy=cfg.privacy_mechanism, sampling=cfg.sampling,
                                                          asynchronous=cfg.asynchronous,
                                                          min_devices=quorum))
        reports = engine.run(on_round=on_round)
        clock = getattr(coord, "clock", None)
        if not isinstance(clock, FleetClock):
            if cfg.asynchronous is not None:  # versions on the real clock have no synchronous replay
                return agents, reports, None
            clock = replay_clock(fleet_clock(cfg, checked), reports)  # the real clock: time its rounds afterwards
        return agents, reports, clock
    finally:
        cleanup()


def simulate(cfg: FleetConfig, *, transport: str = "inprocess", out_dir: str | Path | None = None,
             on_round: Callable[[RoundReport], None] | None = None) -> SimResult:
    """Run ``cfg`` end to end; with ``out_dir``, save each device's final model there."""
    transport_runner(transport)  # an unknown name fails before any work
    check_transport(cfg.clock.availability, transport)
    t0 = time.perf_counter()
    devices, strat = build_fleet(cfg)
    agents, reports, clock = run_timed(cfg, devices, strat, transport=transport, on_round=on_round)
    if out_dir is not None:
        ckpt_dir = Path(out_dir) / "checkpoints"
        for d in devices:
            save_checkpoint(d.method.ctx.model, ckpt_dir / f"{d.info.device_id}.safetensors",
                            extra={"fedge.profile": d.info.profile, "fedge.dataset": cfg.run.dataset})
    return SimResult(cfg, devices, agents, reports, time.perf_counter() - t0, clock=clock)
