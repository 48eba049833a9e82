"""``fedge simulate --transport inprocess``: the fleet on an in-memory bus, stepped in fleet order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport, InMemoryDeviceTransport
from fedge.common.rounds import DeviceInfo
from fedge.common.transport import CoordinatorTransport
from fedge.edge.agent import DeviceAgent
from fedge.edge.methods.base import DeviceMethod
from fedge.fleet.clock import fleet_clock
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import SimDevice
from fedge.fleet.slots import checked_slots
from fedge.sim.clocked import ClockedCoordinatorTransport
from fedge.sim.clocked_async import AsyncClockedTransport


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


def run_inprocess(cfg: FleetConfig, devices: list[SimDevice]) -> tuple[CoordinatorTransport, list[DeviceAgent],
                                                                       Callable[[], None]]:
    """Connect the fleet to an in-memory bus stepped in virtual time (:mod:`fedge.sim.clocked`, ``[clock]``):
    (coordinator transport, agents, cleanup)."""
    bus, _, agents = connect_inprocess([(d.method, d.info) for d in devices], fleet=cfg.run.fleet,
                                       eval_every=cfg.run.eval_every)
    clock = fleet_clock(cfg, checked_slots(cfg))
    for d in devices:  # the test images each device really evaluates (a benchmark may have given it fewer)
        ctx, c = d.method.ctx, clock.devices[d.info.device_id]
        tested = len(ctx.local_test.y) + (len(ctx.global_test.y) if ctx.global_test is not None else 0)
        c.work = dataclasses.replace(c.work, eval_samples=tested)
    if cfg.asynchronous is not None:  # [coordinator] mode = "async": events in virtual time
        return (AsyncClockedTransport(bus, agents, clock, eval_every=cfg.run.eval_every), agents,
                lambda: None)
    if cfg.privacy.secure_aggregation:  # each group's values summed securely (fedge.sim.secure)
        from fedge.sim.secure import SecureClockedTransport

        return (SecureClockedTransport(bus, agents, clock, final_round=cfg.run.rounds + 1, method=cfg.run.method,
                                       settings=cfg.privacy, seed=cfg.run.seed), agents, lambda: None)
    return ClockedCoordinatorTransport(bus, agents, clock, final_round=cfg.run.rounds + 1), agents, lambda: None
