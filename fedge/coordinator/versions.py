"""Asynchronous mode's version loop (docs/async.md): the part of the round engine that makes one global version.

Run by :class:`fedge.coordinator.engine.RoundEngine` on its own state for every training round when
``EngineConfig.asynchronous`` is set: tasks for idle online devices (``round.assigned``), updates admitted from
the last ``max_staleness`` versions and folded in with their staleness weight after they are persisted, a new
version every ``buffer_size`` accepted updates. The engine's quorum, gate, strategy, transport, checkpoints and
observers are the synchronous rounds' own: an observer hears ``round_started`` at each announcement of a version
(its ``RoundInfo.assigned`` lists the devices training, ``pending`` is the engine's live task table) and
``round_finished`` once the version is published. Partial aggregates (aggregation workers, relays) have no place
in a version: the fleet config refuses them with async mode, and one that arrives anyway is refused and counted
as ``partial-async``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any, Protocol

from fedge.common.inmemory import RECOVERY_KEY
from fedge.common.messages import Message
from fedge.common.rounds import RoundInfo
from fedge.common.transport import CoordinatorTransport
from fedge.coordinator.config import COORDINATOR_ID, EngineConfig
from fedge.coordinator.gate import Admitted, UpdateGate
from fedge.coordinator.merge import PartialMerger
from fedge.coordinator.report import RoundReport, record_admitted
from fedge.coordinator.store import EngineStore
from fedge.coordinator.strategy import Arrays, Contribution, Strategy
from fedge.coordinator.validation import Rejected

log = logging.getLogger(__name__)


class RoundEngine(Protocol):
    """What the version loop uses of :class:`fedge.coordinator.engine.RoundEngine` (which imports this module)."""

    config: EngineConfig
    strategy: Strategy
    gate: UpdateGate
    partials: PartialMerger
    transport: CoordinatorTransport
    store: EngineStore | None
    tasks: dict[str, int]
    task_since: dict[str, float]
    latency: dict[str, dict[str, float]]
    run_id: str
    session: str
    global_rounds: dict[str, int]
    reports: list[RoundReport]
    completed: int

    def await_quorum(self) -> None: ...
    def task_timeout_s(self, device_id: str, phase: str) -> float: ...
    def online_devices(self) -> set[str]: ...
    def _publish(self, artifacts: dict[str, Arrays], rnd: int) -> None: ...
    def _checkpoint(self, report: RoundReport) -> None: ...
    def _trim_reports(self) -> None: ...
    def _notify(self, event: str, *args: Any) -> None: ...


def assign(engine: RoundEngine, rnd: int, online: set[str], done: Collection[str] = ()) -> list[str]:
    """Ask idle online devices to train from version ``rnd`` until ``concurrency`` online devices have a task.

    Those in ``done`` (their update is in version ``rnd`` already) wait for the next version while another
    device can take the work — unless nobody online would be training otherwise (few devices online, a buffer
    larger than they are): then they train from ``rnd`` again, or the version would never fill."""
    a = engine.config.asynchronous
    assert a is not None
    busy = sum(1 for d in engine.tasks if d in online)
    free = max(0, a.concurrent_devices - busy)
    idle = online - set(engine.tasks)
    started = a.choose(rnd, sorted(idle - set(done)), free)
    if not started and not busy:
        started = a.choose(rnd, sorted(idle), free)
    now = time.time()
    for d in started:
        engine.tasks[d] = rnd
        engine.task_since[d] = now
    return started


def task_expiries(engine: RoundEngine, phase: str, pending: set[str]) -> dict[str, float]:
    """When (unix seconds) each pending task times out (:meth:`RoundEngine.task_timeout_s`; none: never). A task
    without a hand-out time (restored after a restart) counts from now."""
    now, out = time.time(), {}
    for d in pending:
        timeout = engine.task_timeout_s(d, phase)
        if timeout > 0:
            out[d] = engine.task_since.setdefault(d, now) + timeout
    return out


def withdraw(engine: RoundEngine, report: RoundReport, devices: list[str]) -> None:
    """End ``devices``' tasks unanswered (reported ``missing``): they are idle, and get work again."""
    report.missing += devices
    for d in devices:
        engine.tasks.pop(d, None)
        engine.task_since.pop(d, None)


def run_version(engine: RoundEngine, rnd: int) -> RoundReport:
    """Asynchronous mode: collect ``buffer_size`` accepted updates, then publish version ``rnd``'s artifacts."""
    a = engine.config.asynchronous
    assert a is not None
    t0 = time.perf_counter()
    phase = engine.strategy.phase(rnd)
    report = RoundReport(round=rnd, phase=phase)
    engine.strategy.begin_round(rnd)
    engine.gate.begin_round(rnd, final=False)
    restoring = True

    def accept(up: Admitted) -> None:
        sender = up.msg.sender
        if engine.store is not None and not restoring:  # persisted before it counts (docs/async.md)
            engine.store.buffer_add(rnd, len(report.accepted), up.raw)
        engine.strategy.accumulate(up.device, up.msg.tensors, up.msg.info,
                                   Contribution(a.weight(up.staleness), up.msg.round))
        record_admitted(report, up)
        report.staleness[sender] = up.staleness
        engine.tasks.pop(sender, None)
        since = engine.task_since.pop(sender, None)
        if since is not None and not restoring:  # what its task took: the basis of its next task's timeout
            engine.latency.setdefault(phase, {})[sender] = max(0.0, time.time() - since)

    if engine.store is not None:  # a restarted coordinator: what it had accepted into this version
        saved, tasks = engine.store.buffer_load(rnd)
        if tasks is not None:
            engine.tasks.clear()
            engine.tasks.update(tasks)
            engine.task_since.clear()  # their timeouts count from now (task_expiries)
        for raw in saved:
            engine.gate.restore(raw, accept)
        if saved:
            log.info("version %d: %d accepted updates restored from %s", rnd, len(saved), engine.store.dir)
    restoring = False
    announced = False
    # Set when tasks were withdrawn unanswered: the next announcement carries `recovery` (RECOVERY_KEY), so a device
    # handed its task again resends the update it may have sent (lost on the way) instead of ignoring a task it
    # did; a copy that had arrived after all is refused as a replay.
    recovering = False
    while len(report.accepted) < a.buffer_size:
        engine.await_quorum()
        online = engine.online_devices()
        started = assign(engine, rnd, online, report.accepted)
        if started or not announced:
            info = RoundInfo(round=rnd, phase=phase, method=engine.config.method,
                             config=engine.strategy.round_config(rnd), assigned=dict(engine.tasks))
            if engine.store is not None:
                engine.store.buffer_sync()  # the updates accepted so far are on disk before their devices get work
                engine.store.save_tasks(rnd, engine.tasks)
            announce = Message("round", COORDINATOR_ID, rnd, engine.config.fleet,
                               info={"round": info.to_dict(), "run": engine.run_id, "session": engine.session,
                                     "globals": dict(engine.global_rounds), **({RECOVERY_KEY: True} if recovering
                                                                                else {})})
            recovering = False
            engine.transport.announce_round(announce.to_bytes())
            announced = True
            # the devices training (the version is built from whichever K of them deliver first)
            engine._notify("round_started", info, frozenset(engine.tasks), engine.tasks)
        pending = {d for d in engine.tasks if d in online}
        if not pending:
            engine.transport.wait_for_devices(1.0)
            continue
        expiries = task_expiries(engine, phase, pending)
        deadline = min(expiries.values(), default=0.0)  # the first task to time out ends the wait
        received = 0
        for item in engine.transport.collect(rnd, pending, deadline):
            received += 1
            if item.kind == "partial":
                engine.partials.refuse(item.origin, Rejected(
                    "async", "a partial aggregate during an asynchronous version: workers and relays aggregate "
                             "synchronous rounds only (docs/async.md)"))
                continue
            tasks_before = len(engine.tasks)
            if engine.gate.admit(item, accept, engine.transport.hellos):
                pending.discard(report.accepted[-1])
                if len(report.accepted) >= a.buffer_size:
                    break
            elif len(engine.tasks) < tasks_before:
                # the refusal ended its device's task (stale: too old, or trained in the stage before): that
                # device is idle now, and gets a new task at once rather than when this version is full
                break
        now = time.time()
        expired = sorted(d for d in pending if d in expiries and now >= expiries[d])
        if expired:
            # their tasks went unanswered for their timeout: withdrawn, and handed out again (to them too, if
            # they are idle and online) at the next pass
            log.warning("version %d: no update from %s within %s; their tasks are withdrawn and handed out again",
                        rnd, ", ".join(expired),
                        ", ".join(f"{engine.task_timeout_s(d, phase):.0f} s" for d in expired))
            withdraw(engine, report, expired)
            recovering = True
        elif not received and not started:
            # the transport has nothing more to wait for from them (in-process: their devices answered with
            # updates the gate refused): the tasks go to other devices
            log.warning("version %d: no update from %s and nothing left to wait for; their tasks are withdrawn",
                        rnd, ", ".join(sorted(pending)))
            withdraw(engine, report, sorted(pending))
    rejections = engine.gate.drain()
    report.rejected = dict(rejections.by_reason)
    report.rejected_by_device = {d: dict(c) for d, c in sorted(rejections.by_device.items())}
    engine.gate.end_round(report.missing)
    if engine.store is not None:
        engine.store.buffer_sync()  # ... and before the version they make is published
    t_agg = time.perf_counter()
    artifacts = engine.strategy.finish_round(rnd)
    aggregation_s = time.perf_counter() - t_agg
    engine._publish(artifacts, rnd)
    report.seconds = time.perf_counter() - t0
    engine.reports.append(report)
    engine.completed = rnd
    engine._checkpoint(report)
    if engine.store is not None:
        engine.store.buffer_clear()
    engine._trim_reports()
    engine._notify("round_finished", report, aggregation_s)
    return report
