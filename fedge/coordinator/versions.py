"""Asynchronous mode's policy over the round loop (docs/async.md): how one global version is made.

:class:`VersionPolicy` is what :meth:`fedge.coordinator.engine.RoundEngine.run_round` runs every training round
when ``EngineConfig.asynchronous`` is set (:mod:`fedge.coordinator.policy` has the loop's other half): tasks for
idle online devices (``round.assigned``), updates admitted from the last ``max_staleness`` versions and folded in
with their staleness weight after they are persisted, a new version every ``buffer_size`` accepted updates. The
engine's quorum, gate, strategy, transport, checkpoints and observers are the synchronous rounds' own: an
observer hears ``round_started`` at each announcement of a version (its ``RoundInfo.assigned`` lists the devices
training, ``pending`` is the engine's live task table) and ``round_finished`` once the version is published.
Partial aggregates (aggregation workers, relays) have no place in a version: the fleet config refuses them with
async mode, and one that arrives anyway is refused and counted as ``partial-async``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from fedge.common.inmemory import RECOVERY_KEY
from fedge.common.rounds import RoundInfo
from fedge.common.transport import Inbound
from fedge.coordinator.gate import Admitted
from fedge.coordinator.policy import Call, Engine, Pass, RoundPolicy
from fedge.coordinator.report import RoundReport
from fedge.coordinator.strategy import Contribution
from fedge.coordinator.validation import Rejected

log = logging.getLogger(__name__)


def assign(engine: Engine, rnd: int, online: set[str], done: Collection[str] = (),
           report: RoundReport | None = None) -> list[str]:
    """Ask idle online devices to train from version ``rnd`` until ``concurrency`` online devices have a task.

    Those in ``done`` (their update is in version ``rnd`` already) wait for the next version while another
    device can take the work — unless nobody online would be training otherwise (few devices online, a buffer
    larger than they are): then they train from ``rnd`` again, or the version would never fill. With
    ``thermal_guard``, a hot idle device gets no task until it has cooled (:meth:`RoundEngine.thermal_hold`): named
    in ``report.hot``, why in ``report.selection``."""
    a = engine.config.asynchronous
    assert a is not None
    busy = sum(1 for d in engine.tasks if d in online)
    free = max(0, a.concurrent_devices - busy)
    idle = online - set(engine.tasks)
    held, stale = engine.thermal_hold(idle)
    if held:
        idle -= set(held)
        log.info("version %d: thermal guard holds %s", rnd, ", ".join(f"{d} ({w})" for d, w in held.items()))
    if report is not None:
        report.hot = sorted(set(report.hot) | set(held))
        report.selection.update(held)
        report.selection.update(stale)
    started = a.choose(rnd, sorted(idle - set(done)), free)
    if not started and not busy:
        started = a.choose(rnd, sorted(idle), free)
    now = time.time()
    for d in started:
        engine.tasks[d] = rnd
        engine.task_since[d] = now
    return started


def task_expiries(engine: Engine, phase: str, pending: set[str]) -> dict[str, float]:
    """When (unix seconds) each pending task times out (:meth:`RoundEngine.task_timeout_s`; none: never). A task
    without a hand-out time (restored after a restart) counts from now."""
    now, out = time.time(), {}
    for d in pending:
        timeout = engine.task_timeout_s(d, phase)
        if timeout > 0:
            out[d] = engine.task_since.setdefault(d, now) + timeout
    return out


def withdraw(engine: Engine, report: RoundReport, devices: list[str]) -> None:
    """End ``devices``' tasks unanswered (reported ``missing``): they are idle, and get work again."""
    report.missing += devices
    for d in devices:
        engine.tasks.pop(d, None)
        engine.task_since.pop(d, None)


class VersionPolicy(RoundPolicy):
    """Asynchronous mode's training rounds: collect ``buffer_size`` accepted updates into version ``rnd``, handing
    out tasks to idle online devices pass after pass (the module docstring)."""

    def __init__(self, engine: Engine, rnd: int) -> None:
        super().__init__(engine, rnd)
        a = engine.config.asynchronous
        assert a is not None
        self.settings = a
        self.phase = engine.strategy.phase(rnd)
        self.restoring = False  # folding in the updates a restarted coordinator had accepted (already persisted)
        self.announced = False
        # Set when tasks were withdrawn unanswered: the next announcement carries `recovery` (RECOVERY_KEY), so a
        # device handed its task again resends the update it may have sent (lost on the way) instead of ignoring a
        # task it did; a copy that had arrived after all is refused as a replay.
        self.recovering = False
        self.started: list[str] = []  # the devices given a task in this pass
        self.pending: set[str] = set()  # this pass's online devices with a task (live: accepted ones leave)
        self.expiries: dict[str, float] = {}

    def open(self) -> RoundReport:
        self.report = RoundReport(round=self.rnd, phase=self.phase)
        return self.report

    def restore(self) -> None:
        e = self.engine
        if e.store is None:
            return
        saved, tasks = e.store.buffer_load(self.rnd)  # a restarted coordinator: what it had accepted into this version
        if tasks is not None:
            e.tasks.clear()
            e.tasks.update(tasks)
            e.task_since.clear()  # their timeouts count from now (task_expiries)
        self.restoring = True
        try:
            for raw in saved:
                e.gate.restore(raw, self.accept)
        finally:
            self.restoring = False
        if saved:
            log.info("version %d: %d accepted updates restored from %s", self.rnd, len(saved), e.store.dir)

    def done(self) -> bool:
        return len(self.report.accepted) >= self.settings.buffer_size

    def ask(self) -> Pass:
        e, rnd = self.engine, self.rnd
        e.await_quorum()
        online = e.online_devices()
        self.started = assign(e, rnd, online, self.report.accepted, self.report)
        call = None
        if self.started or not self.announced:
            info = RoundInfo(round=rnd, phase=self.phase, method=e.config.method, config=e.strategy.round_config(rnd),
                             assigned=dict(e.tasks), rounds=e.strategy.total_rounds())
            if e.store is not None:
                e.store.buffer_sync()  # the updates accepted so far are on disk before their devices get work
                e.store.save_tasks(rnd, e.tasks)
            # the devices training (the version is built from whichever K of them deliver first)
            call = Call(info, frozenset(e.tasks), e.tasks,
                        {"session": e.session, **({RECOVERY_KEY: True} if self.recovering else {})})
            self.recovering = False
            self.announced = True
        self.pending = {d for d in e.tasks if d in online}
        if not self.pending:
            return Pass(call, None)
        self.expiries = task_expiries(e, self.phase, self.pending)
        return Pass(call, self.pending, min(self.expiries.values(), default=0.0))  # the first expiry ends the wait

    def accept(self, up: Admitted) -> None:
        e, sender = self.engine, up.msg.sender
        if e.store is not None and not self.restoring:  # persisted before it counts (docs/async.md)
            e.store.buffer_add(self.rnd, len(self.report.accepted), up.raw)
        self.fold(up, Contribution(self.settings.weight(up.staleness), up.msg.round))
        self.report.staleness[sender] = up.staleness
        e.tasks.pop(sender, None)
        since = e.task_since.pop(sender, None)
        if since is not None and not self.restoring:  # what its task took: the basis of its next task's timeout
            e.latency.setdefault(self.phase, {})[sender] = max(0.0, time.time() - since)

    def partial(self, item: Inbound) -> None:
        self.engine.partials.refuse(item.origin, Rejected(
            "async", "a partial aggregate during an asynchronous version: workers and relays aggregate synchronous "
                     "rounds only (docs/async.md)"))

    def end_pass(self, received: int) -> None:
        e, now = self.engine, time.time()
        expired = sorted(d for d in self.pending if d in self.expiries and now >= self.expiries[d])
        if expired:
            # their tasks went unanswered for their timeout: withdrawn, and handed out again (to them too, if they
            # are idle and online) at the next pass
            log.warning("version %d: no update from %s within %s; their tasks are withdrawn and handed out again",
                        self.rnd, ", ".join(expired),
                        ", ".join(f"{e.task_timeout_s(d, self.phase):.0f} s" for d in expired))
            withdraw(e, self.report, expired)
            self.recovering = True
        elif not received and not self.started:
            # the transport has nothing more to wait for from them (in-process: their devices answered with updates
            # the gate refused): the tasks go to other devices
            log.warning("version %d: no update from %s and nothing left to wait for; their tasks are withdrawn",
                        self.rnd, ", ".join(sorted(self.pending)))
            withdraw(e, self.report, sorted(self.pending))

    def missing(self) -> list[str]:
        return self.report.missing  # the tasks withdrawn unanswered (withdraw)
