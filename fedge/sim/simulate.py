"""``fedge simulate``: a whole fleet in one process, through the real round engine.

Devices and coordinator exchange encoded messages over a transport exactly as
they would over MQTT; ``transport="inprocess"`` steps devices synchronously in
fleet order (deterministic), and other transports plug in through
:func:`register_transport`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport, InMemoryDeviceTransport
from fedge.common.rounds import DeviceInfo
from fedge.common.transport import CoordinatorTransport
from fedge.coordinator.engine import EngineConfig, RoundEngine, RoundReport
from fedge.edge.agent import DeviceAgent
from fedge.edge.methods.base import DeviceMethod
from fedge.edge.models.checkpoint import save_checkpoint
from fedge.errors import ConfigError
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import SimDevice, build_devices, load_fleet_data
from fedge.fleet.methods import method_entry

log = logging.getLogger(__name__)

# name -> factory(cfg, devices) returning (coordinator transport, agents, cleanup)
TransportFactory = Callable[[FleetConfig, list[SimDevice]], tuple[CoordinatorTransport, list[DeviceAgent],
                                                                    Callable[[], None]]]
_TRANSPORTS: dict[str, TransportFactory] = {}


def register_transport(name: str, factory: TransportFactory) -> None:
    """Make ``fedge simulate --transport NAME`` available."""
    _TRANSPORTS[name] = factory


def connect_inprocess(devices: Sequence[tuple[DeviceMethod, DeviceInfo]], *, fleet: str = "default",
                      eval_every: int = 1) -> tuple[InMemoryBus, InMemoryCoordinatorTransport, list[DeviceAgent]]:
    """Wire device halves to an in-memory bus: each says hello, and the coordinator's ``collect``
    steps them synchronously in this order (deterministic rounds)."""
    bus = InMemoryBus()
    agents = [DeviceAgent(method, InMemoryDeviceTransport(bus), info, fleet=fleet, eval_every=eval_every)
              for method, info in devices]
    for a in agents:
        a.hello()

    def pump() -> None:
        for a in agents:
            a.step()

    bus.pump = pump
    return bus, InMemoryCoordinatorTransport(bus), agents


def _inprocess(cfg: FleetConfig, devices: list[SimDevice]) -> tuple[CoordinatorTransport, list[DeviceAgent],
                                                                   Callable[[], None]]:
    _, coord, agents = connect_inprocess([(d.method, d.info) for d in devices], fleet=cfg.run.fleet,
                                         eval_every=cfg.run.eval_every)
    return coord, agents, lambda: None


register_transport("inprocess", _inprocess)


@dataclass
class SimResult:
    """Everything a finished simulation measured."""

    cfg: FleetConfig
    devices: list[SimDevice]
    agents: list[DeviceAgent]
    reports: list[RoundReport]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def simulate(cfg: FleetConfig, *, transport: str = "inprocess", out_dir: str | Path | None = None,
             on_round: Callable[[RoundReport], None] | None = None) -> SimResult:
    """Run ``cfg`` end to end; with ``out_dir``, save each device's final model there."""
    if transport not in _TRANSPORTS:
        _load_transports()
    if transport not in _TRANSPORTS:
        raise ConfigError(f"unknown transport {transport!r}", hint=f"use one of {', '.join(sorted(_TRANSPORTS))}")
    t0 = time.perf_counter()
    data = load_fleet_data(cfg)
    devices = build_devices(cfg, data)
    strat = method_entry(cfg.run.method).build_strategy(cfg.method_config, num_classes=data.train.num_classes,
                                                         rounds=cfg.run.rounds)
    coord, agents, cleanup = _TRANSPORTS[transport](cfg, devices)
    try:
        engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method))
        reports = engine.run(on_round=on_round)
    finally:
        cleanup()
    if out_dir is not None:
        ckpt_dir = Path(out_dir) / "checkpoints"
        for d in devices:
            save_checkpoint(d.method.ctx.model, ckpt_dir / f"{d.info.device_id}.safetensors",
                            extra={"fedge.profile": d.info.profile, "fedge.dataset": cfg.run.dataset})
    return SimResult(cfg, devices, agents, reports, time.perf_counter() - t0)


def _load_transports() -> None:
    """Transports that register themselves on import (MQTT)."""
    try:
        import fedge.mqtt.simulate  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "fedge.mqtt.simulate" and exc.name != "fedge.mqtt":
            raise
