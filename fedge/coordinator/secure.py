"""A synchronous round whose values are summed securely over a transport (``[privacy] secure_aggregation``).

:class:`SecureRound` is the round policy (:mod:`fedge.coordinator.policy`) the engine runs for a training round
when :attr:`EngineConfig.secure <fedge.coordinator.config.EngineConfig.secure>` is set. It plans each group's
secure sum over the devices the round expects (:func:`fedge.secagg.rounds.plan_task`: FedAvg's architecture
groups, or the whole fleet for FedProto's and FedVTC's statistics), announces the tasks in the round descriptor
(``info["secagg"]``) and then drives the four stages, one pass of the engine's loop each, with the same
coordinator state machine the in-process simulation runs (:class:`~fedge.secagg.server.SecAggServer`):

1. ``keys`` — until every member advertised its keys or the round's deadline (the devices train first);
2. ``shares``, 3. ``masked``, 4. ``unmask`` — each after the previous stage's messages were sent
   (:meth:`CoordinatorTransport.send_stages`), until every device asked answered, is offline, or
   ``secure_stage_s`` passed;
5. the devices' ``update`` messages, which carry their metrics only (the gate admits no tensors in a secure
   round), until each expected device's arrived or it is offline, at most until the later of the round's
   deadline and ``secure_stage_s`` from now.

Every stage message passes the engine's gate (:meth:`UpdateGate.admit_stage`): what the state machine refuses
is counted in the round report as ``secagg-<reason>``. Behind relays (a sharded fleet) the stage messages arrive
as the devices sent them, but a shard's masked inputs arrive summed by its relay (``secagg-sum``,
:mod:`fedge.secagg.partial`): :meth:`SecAggServer.receive_sum` adds the sum and counts its devices as having
sent theirs, refusing a forged one — another field or length, a device counted twice, one that shared no keys,
or (with ``[[shards]]``, the engine's ``partials.allowed``) one outside the relay's shard. A device lost after
sharing its keys is unmasked with its neighbours' shares; a group whose survivors fall below its threshold is
abandoned: nothing of it reaches the strategy, so its global state stays as it was, and
``report.secure[group]["abandoned"]`` says why.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from fedge.common.transport import Inbound
from fedge.coordinator.policy import Call, Engine, Pass, SyncRound
from fedge.coordinator.report import RoundReport
from fedge.coordinator.validation import Rejected
from fedge.errors import ConfigError
from fedge.secagg import terms
from fedge.secagg.messages import Refusal, masked_group
from fedge.secagg.rounds import SecureTask, plan_task
from fedge.secagg.server import Abandoned, SecAggServer

log = logging.getLogger(__name__)

STAGES = ("keys", "shares", "masked", "unmask", "updates")


class SecureRound(SyncRound):
    """A synchronous training round summed securely, group by group (see the module docstring)."""

    def __init__(self, engine: Engine, rnd: int, send: Callable[[Mapping[str, bytes]], None]) -> None:
        super().__init__(engine, rnd)
        self.send = send  # the transport's send_stages

    def open(self) -> RoundReport:
        report = super().open()
        e = self.engine
        settings = e.config.secure
        assert settings is not None, "a secure round needs EngineConfig.secure"
        e.strategy.secure_sums = True  # the gate admits metrics only; the sums arrive in accumulate_group_sum
        self.servers: dict[str, SecAggServer] = {}
        self.tasks: dict[str, SecureTask] = {}
        groups: dict[str, list[str]] = defaultdict(list)
        for d in sorted(self.expected):
            groups[terms.group_of(e.config.method, e.devices[d])].append(d)
        for group, members in sorted(groups.items()):
            cap = float(max(max(e.devices[d].num_samples for d in members), 1))
            spec = e.strategy.expected_update(e.devices[members[0]], self.rnd) or {}
            try:
                task = plan_task(settings, e.config.method, self.rnd, group, members, spec, cap, os.urandom(32),
                                 e.config.secure_stage_s)
            except ConfigError as exc:  # this round's group is too small to hide one device's values
                self._abandon(group, exc.message)
                continue
            self.tasks[group], self.servers[group] = task, SecAggServer(task.setup)
        self.member_of = {m: g for g, t in self.tasks.items() for m in t.setup.members}
        self.stage = STAGES[0]
        self.stage_pending: set[str] = set(self.member_of)  # live: who still owes the current stage's message
        self.announced = False
        return report

    def ask(self) -> Pass:
        if not self.announced:
            self.announced, self.announced_at = True, time.time()
            extra = {"secagg": {g: t.to_dict() for g, t in self.tasks.items()}}
            return Pass(Call(self.info, self.expected, self.pending, extra), self.stage_pending, self.info.deadline)
        deadline = time.time() + self.engine.config.secure_stage_s
        if self.stage != "updates":
            return Pass(None, self.stage_pending, deadline)
        # a device in no group this round (or whose group was abandoned early) sends its metrics once trained
        return Pass(None, self.pending, max(deadline, self.info.deadline) if self.info.deadline else 0.0)

    def admitted(self, item: Inbound, sender: str) -> None:
        super().admitted(item, sender)
        # the loop discards it from the pass's pending set, a stage's while a stage runs: the updates' too
        self.pending.discard(sender)

    def stage_message(self, item: Inbound) -> bool:
        if item.kind == "secagg-sum":
            return self._masked_sum(item)
        sender = item.origin or ""
        group = self.member_of.get(sender)
        if group is None or group not in self.servers:
            raise Rejected("secagg-unknown-sender", f"a stage message from {sender[:64]!r}, in no secure sum of "
                                                    f"round {self.rnd} still running")
        server = self.servers[group]
        if not server.receive(sender, item.data):
            refusal = server.last_refusal
            assert refusal is not None
            raise Rejected(f"secagg-{refusal.reason}", refusal.message)
        self.stage_pending.discard(sender)
        return not self.stage_pending

    def _masked_sum(self, item: Inbound) -> bool:
        """A relay's sum of its devices' masked inputs (inside the gate's error boundary: refusals raise)."""
        relay = item.origin or ""
        allowed = self.engine.partials.allowed  # [[shards]]: the devices each relay reports
        if allowed is not None and relay not in allowed:
            raise Rejected("secagg-foreign", f"a masked sum from {relay[:64]!r}, no relay of this fleet's shards")
        try:
            group = masked_group(item.data)
        except Refusal as r:
            raise Rejected(f"secagg-{r.reason}", r.message) from r
        server = self.servers.get(group)
        if server is None:
            raise Rejected("secagg-late", f"a masked sum from {relay[:64]!r} for group {group[:40]!r}, in no secure "
                                          f"sum of round {self.rnd} still running")
        devices = server.receive_sum(relay, item.data, None if allowed is None else allowed[relay])
        if not devices:
            refusal = server.last_refusal
            assert refusal is not None
            raise Rejected(f"secagg-{refusal.reason}", refusal.message)
        self.stage_pending.difference_update(devices)
        return not self.stage_pending

    def end_pass(self, received: int) -> None:
        if self.stage == "updates":
            self.collected = True
            return
        out: dict[str, bytes] = {}
        for group, server in list(self.servers.items()):
            try:
                out.update(self._close(group, server))
            except Abandoned as exc:
                self._abandon(group, exc.message, server)
        if out:
            self.send(out)
        self.stage = STAGES[STAGES.index(self.stage) + 1]
        self.stage_pending = set(out)

    def _close(self, group: str, server: SecAggServer) -> dict[str, bytes]:
        """End the current stage of ``group``'s sum: the messages to send, or (stage 4) the sum handed on."""
        if self.stage == "keys":
            return server.close_keys()
        if self.stage == "shares":
            return server.close_shares()
        if self.stage == "masked":
            return server.close_masked()
        sums = server.close_unmask()
        del self.servers[group]
        self.report.secure[group] = {"survivors": server.survivors, "dropped": self._dropped(server),
                                     "abandoned": ""}
        log.info("round %d: group %s summed securely over %d of %d devices", self.rnd, group,
                 len(server.survivors), len(server.setup.members))
        self.engine.strategy.accumulate_group_sum(group, sums)
        return {}

    @staticmethod
    def _dropped(server: SecAggServer) -> list[str]:
        return sorted(set(server.shares) - set(server.masked))

    def _abandon(self, group: str, why: str, server: SecAggServer | None = None) -> None:
        """Nothing of ``group`` is summed this round; its devices' later stage messages are refused."""
        self.servers.pop(group, None)
        self.report.secure[group] = {"survivors": [], "dropped": self._dropped(server) if server else [],
                                     "abandoned": why}
        log.warning("round %d: group %s's secure sum abandoned: %s", self.rnd, group, why)
