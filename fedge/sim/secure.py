"""Secure aggregation in ``fedge simulate`` (``[privacy] secure_aggregation = true``, in-process only).

The in-process fleet runs each group's secure sum (:mod:`fedge.secagg`) every training round: after the devices
have stepped, their uploads are turned into the terms their method sums (:mod:`fedge.secagg.terms`, the device
side's work), each group's four stages run between the devices' and the coordinator's state machines, and the
coordinator's strategy receives only the unmasked group sum (:meth:`Strategy.accumulate_group_sum`). The update
messages the engine then reads carry the devices' metrics and no tensors: neither the engine, its gate, its
reports nor its checkpoints ever hold one device's values.

A group whose survivors fall below the threshold is abandoned: logged, listed in :attr:`abandoned`, and nothing
of it aggregated (its global state stays as it was). The virtual clock times each round from the plain uploads'
bytes; what the stages add on a device is measured by ``benchmarks/secagg.py``, not simulated.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Sequence

from fedge.common.inmemory import InMemoryBus
from fedge.common.messages import Message
from fedge.common.privacy import PrivacySettings
from fedge.common.rounds import FINAL_PHASE, DeviceInfo, RoundInfo
from fedge.coordinator.strategy import Arrays, Strategy
from fedge.edge.agent import DeviceAgent
from fedge.errors import ConfigError
from fedge.fleet.clock import FleetClock
from fedge.secagg import terms
from fedge.secagg.inprocess import run_group
from fedge.secagg.rounds import group_parameters, plan_task
from fedge.secagg.server import Abandoned
from fedge.sim.clocked import ClockedCoordinatorTransport

log = logging.getLogger(__name__)


class SecureClockedTransport(ClockedCoordinatorTransport):
    """The clocked in-process transport whose rounds sum each group securely (see the module docstring)."""

    def __init__(self, bus: InMemoryBus, agents: Sequence[DeviceAgent], clock: FleetClock, *, final_round: int,
                 method: str, settings: PrivacySettings, seed: int) -> None:
        super().__init__(bus, agents, clock, final_round=final_round)
        self.method, self.settings, self.seed = method, settings, seed
        self.devices: dict[str, DeviceInfo] = {a.device.device_id: a.device for a in agents}
        self.groups: dict[str, list[str]] = defaultdict(list)
        for dev in sorted(self.devices):
            self.groups[terms.group_of(method, self.devices[dev])].append(dev)
        for group, members in self.groups.items():
            group_parameters(settings, group, len(members))  # refused before any round
        self.strategy: Strategy | None = None
        self.abandoned: list[tuple[int, str, str]] = []  # (round, group, why)

    def bind_strategy(self, strategy: Strategy) -> None:
        """The coordinator half whose accumulation receives the group sums (it then reads no update's values)."""
        strategy.secure_sums = True
        self.strategy = strategy

    def _pump(self) -> None:
        super()._pump()
        raw = self.bus.round_msg
        if raw is None:
            return
        info = RoundInfo.from_dict(Message.from_bytes(raw).info["round"])
        if info.phase == FINAL_PHASE:
            return
        uploads: dict[str, Arrays] = {}
        kept = []
        for data in self.bus.updates:
            m = Message.from_bytes(data)
            if m.kind == "update" and m.round == info.round:
                uploads[m.sender] = m.tensors
                data = Message(m.kind, m.sender, m.round, m.fleet, info=m.info, msg_id=m.msg_id).to_bytes()
            kept.append(data)
        self.bus.updates.clear()
        self.bus.updates.extend(kept)
        for group, everyone in sorted(self.groups.items()):
            members = [d for d in everyone if info.includes(d)]
            if members:
                self._sum_group(info.round, group, members, uploads)

    def _sum_group(self, rnd: int, group: str, members: list[str], uploads: dict[str, Arrays]) -> None:
        """One group's secure sum in round ``rnd``, handed to the strategy (or abandoned)."""
        assert self.strategy is not None, "bind_strategy before the first round"
        cap = float(max(max(self.devices[d].num_samples for d in members), 1))
        spec = self.strategy.expected_update(self.devices[members[0]], rnd) or {}
        try:
            seed = hashlib.sha256(f"fedge-secagg|{self.seed}|{rnd}|{group}".encode()).digest()
            task = plan_task(self.settings, self.method, rnd, group, members, spec, cap, seed)
            inputs = {d: terms.device_terms(self.method, uploads[d], num_samples=self.devices[d].num_samples,
                                            cap=cap, clip=task.clip) for d in members if d in uploads}
            result = run_group(task.setup, inputs)
        except (Abandoned, ConfigError) as exc:
            log.warning("round %d: group %s's secure sum abandoned: %s", rnd, group, exc.message)
            self.abandoned.append((rnd, group, exc.message))
            return
        log.info("round %d: group %s summed securely over %d of %d devices", rnd, group, len(result.survivors),
                 len(members))
        self.strategy.accumulate_group_sum(group, result.sums)
