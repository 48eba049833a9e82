"""The round loop, written once for every method, every transport and both modes.

Per round the engine announces a :class:`RoundInfo`, streams the updates the
transport delivers through the :class:`~fedge.coordinator.gate.UpdateGate`
into the strategy, publishes the artifacts the strategy returns, and
checkpoints through the :class:`~fedge.coordinator.store.EngineStore`. After
the last training round it announces a final round in which devices evaluate
the final global state and upload only their metrics.

In asynchronous mode (``EngineConfig.asynchronous``, docs/async.md) a round is a global version: the
engine asks up to ``concurrency`` idle devices to train (``round.assigned``), admits updates trained from
any of the last ``max_staleness`` versions, folds each into the strategy with its staleness weight (after
persisting it: a restart loses no accepted update), and makes a new version every ``buffer_size`` accepted
updates. The same transports carry it; the gate, robust aggregation, slots and run ids apply unchanged. The
two modes are two policies over one loop (:mod:`fedge.coordinator.policy`, :mod:`fedge.coordinator.versions`):
a policy says whom a round asks and when it is full; the loop here announces, collects, closes and checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from fedge.common.health import HealthRecord
from fedge.common.heat import HEAT_MAX_AGE_S, HeatReading
from fedge.common.messages import Message
from fedge.common.privacy import PrivacyLedger
from fedge.common.rounds import FINAL_PHASE, DeviceInfo, RoundInfo
from fedge.common.selection import UTILITY_SELECTIONS
from fedge.common.transport import CoordinatorTransport
from fedge.coordinator.config import (
    COORDINATOR_ID,
    DEFAULT_MAX_UPDATE_BYTES,
    TASK_TIMEOUT_FACTOR,
    TASK_TIMEOUT_FLOOR_S,
    UNKNOWN_SPEED_TIMEOUT_S,
    EngineConfig,
)
from fedge.coordinator.gate import UpdateGate
from fedge.coordinator.merge import PartialMerger
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.policy import Call, RoundPolicy, SyncRound
from fedge.coordinator.report import RoundReport, rolled_back
from fedge.coordinator.secure import SecureRound
from fedge.coordinator.selecting import Selector, heartbeat_heat
from fedge.coordinator.store import REPORTS_FILE, EngineState, EngineStore, StateMismatchError
from fedge.coordinator.strategy import Arrays, Strategy
from fedge.coordinator.versions import VersionPolicy
from fedge.errors import ConfigError, TransportError

log = logging.getLogger(__name__)

__all__ = ["COORDINATOR_ID", "DEFAULT_MAX_UPDATE_BYTES", "REPORTS_FILE", "EngineConfig", "RoundEngine",
           "RoundReport", "StateMismatchError"]


class RoundEngine:
    """Drives a :class:`Strategy` over a :class:`CoordinatorTransport`."""

    def __init__(self, strategy: Strategy, transport: CoordinatorTransport, config: EngineConfig,
                 *, state_dir: str | os.PathLike[str] | None = None,
                 observers: Sequence[EngineObserver] = ()) -> None:
        self.strategy = strategy
        self.transport = transport
        self.config = config
        self.observers = list(observers)  # told what happens (fedge.coordinator.observer); never waited for
        strategy.aggregation = config.aggregation
        strategy.asynchronous = config.asynchronous
        if config.secure is not None and not transport.stages:
            raise ConfigError(f"[privacy] secure_aggregation: {type(transport).__name__} carries no stage messages",
                              hint="run it over MQTT (fedge coordinator run) or in `fedge simulate`")
        self.gate = UpdateGate(strategy, config, refuse=self._refuse,
                               observe=lambda *a: self._notify("refused", *a),
                               registered=lambda dev: self._notify("registered", dev))
        # partial aggregates from aggregation workers and relays (fedge.coordinator.merge)
        self.partials = PartialMerger(strategy, self.gate, fleet=config.fleet, max_bytes=config.max_update_bytes,
                                      allowed=config.partial_reporters)
        self.globals: dict[str, Arrays] = {}
        self.reports: list[RoundReport] = []
        self.completed = 0
        self.run_id: str = uuid.uuid4().hex  # lets devices tell a new run from a resumed one
        # this process (asynchronous mode's descriptors carry it: a device resends an update whose task a new
        # process still lists, fedge.common.inmemory.resend_async)
        self.session: str = uuid.uuid4().hex
        self.global_rounds: dict[str, int] = {}  # artifact -> round that produced the published version
        self.latency: dict[str, dict[str, float]] = {}  # phase -> device -> seconds announce→update
        self.resumed_round = 0  # the round a restarted coordinator runs again (0: not resumed)
        # asynchronous mode: device -> the version at which it was asked to train, until its update is accepted
        self.tasks: dict[str, int] = {}
        self.task_since: dict[str, float] = {}  # ... and when (unix seconds) it was handed out, for its timeout
        self.gate.assigned = self.tasks
        self.selector = Selector()  # selection = "oort" / "energy": what devices reported (issue 44)
        # the devices' last accepted heartbeats, each with the time it arrived (the fleet monitor's heartbeats), for
        # the thermal guard over a network; None: none (in process, a simulation's clock tells selection_facts or
        # heat_readings instead). A heartbeat older than heat_max_age_s says nothing of the heat (fedge.common.heat).
        self.health: Callable[[], Mapping[str, tuple[HealthRecord, float]]] | None = None
        self.heat_max_age_s = HEAT_MAX_AGE_S
        self.store: EngineStore | None = EngineStore(state_dir) if state_dir else None
        if self.store is not None and self.store.exists():
            self._resume(self.store.load(method=config.method, fleet=config.fleet))

    @property
    def devices(self) -> dict[str, DeviceInfo]:
        """Registered devices by id."""
        return self.gate.devices

    def _notify(self, event: str, *args: Any) -> None:
        """Tell every observer; one that fails is logged and ignored (watching must not stop the fleet)."""
        for obs in self.observers:
            try:
                getattr(obs, event)(*args)
            except Exception:
                log.exception("observer %s failed on %s", type(obs).__name__, event)

    # -- registration ---------------------------------------------------------------------
    def _refuse(self, device_id: str, reason: str, message: str) -> None:
        """Tell a device its hello was refused and why (reason ""; it was accepted: clear that)."""
        try:
            data = None if not reason else Message(
                "refused", COORDINATOR_ID, 0, self.config.fleet,
                info={"device": device_id, "reason": reason, "message": message, "run": self.run_id}).to_bytes()
            self.transport.refuse(device_id, data)
        except Exception as exc:  # telling the device is a courtesy; it must not stop the coordinator
            log.warning("could not tell %s about its refused hello: %s", device_id, exc)

    def register_pending(self) -> list[str]:
        """Register devices from hellos received so far; returns the new ids."""
        return self.gate.register(self.transport.hellos())

    def online_devices(self) -> set[str]:
        """Registered devices not known to be offline."""
        return set(self.devices) - self.transport.offline()

    def quorum(self) -> int:
        """Devices that must be online before a round starts."""
        c = self.config
        return max(c.min_devices, math.ceil(c.quorum_fraction * c.expected_devices))

    def await_fleet(self, device_ids: Collection[str], timeout_s: float) -> list[str]:
        """Register hellos until each of ``device_ids`` is registered or was refused, at most ``timeout_s``;
        returns the ids that are neither (the log names them)."""
        want = set(device_ids)
        end = time.monotonic() + timeout_s
        self._notify("fleet_wait", sorted(want), time.time() + timeout_s)
        while True:
            self.register_pending()
            # a device whose latest hello was refused has answered: waiting longer will not register it
            missing = want - set(self.devices) - self.gate.refused
            remaining = end - time.monotonic()
            if not missing or remaining <= 0:
                break
            self.transport.wait_for_devices(min(1.0, remaining))
        if missing:
            log.warning("no hello from %d device(s) after %.0f s: %s; starting with the devices online once the "
                        "quorum is", len(missing), timeout_s, ", ".join(sorted(missing)[:10]))
        return sorted(missing)

    def await_quorum(self) -> None:
        """Register hellos until the quorum is online; :class:`TransportError` after ``quorum_timeout_s``."""
        need = self.quorum()
        end = time.monotonic() + self.config.quorum_timeout_s
        announced = False
        while True:
            self.register_pending()
            # Online devices are registered ones: while fewer than the quorum are registered, counting the online
            # ones (a pass over every device and every status) cannot reach it. Done on every wake-up — each
            # hello or status wakes this loop — that pass made registration quadratic in the fleet (N = 10,000:
            # 24 CPU-seconds).
            online = len(self.online_devices()) if len(self.devices) >= need else len(self.devices)
            if online >= need:
                return
            if not announced:
                self._notify("quorum_wait", need, time.time() + self.config.quorum_timeout_s)
            remaining = end - time.monotonic()
            if remaining <= 0:
                online = len(self.online_devices())
                raise TransportError(
                    f"quorum not reached: {online} of {need} devices online after {self.config.quorum_timeout_s:.0f} s",
                    hint="start more devices, or lower min_devices / quorum_fraction",
                )
            if not announced:
                log.info("waiting for a quorum of %d devices (%d online)", need, len(self.online_devices()))
                announced = True
            self.transport.wait_for_devices(min(1.0, remaining))

    # -- one round ------------------------------------------------------------------------
    def unknown_speed_timeout_s(self) -> float:
        """``round_timeout_s``, or its auto default: :data:`UNKNOWN_SPEED_TIMEOUT_S` over a network, else none."""
        c = self.config.round_timeout_s
        if c is not None:
            return c
        return UNKNOWN_SPEED_TIMEOUT_S if self.transport.realtime else 0.0

    def task_timeout_s(self, device_id: str, phase: str) -> float:
        """Asynchronous mode: how long ``device_id``'s task may go unanswered before it is withdrawn (0: forever).

        ``round_timeout_s`` when set; auto (None, the default): over a network, max(:data:`TASK_TIMEOUT_FLOOR_S`,
        :data:`TASK_TIMEOUT_FACTOR` x the device's expected task time) — what its last task took, else its hello's
        ``est_round_s``, else its slot's clock-model estimate — and :data:`UNKNOWN_SPEED_TIMEOUT_S` when none is
        known; in-process none (nothing is lost there, and a simulator's time is not the wall clock)."""
        if self.config.round_timeout_s is not None or not self.transport.realtime:
            return self.unknown_speed_timeout_s()
        expected = self._estimate(device_id, phase)
        slot = self.config.slots.get(device_id) if self.config.slots is not None else None
        if expected is None and slot is not None:
            expected = slot.expected_task_s
        if expected is None:
            return UNKNOWN_SPEED_TIMEOUT_S
        return max(TASK_TIMEOUT_FLOOR_S, TASK_TIMEOUT_FACTOR * expected)

    def round_budget(self, phase: str, expected: set[str]) -> float:
        """Seconds the round may take: from the slowest expected device (0: no deadline)."""
        c = self.config
        if not expected:
            return self.unknown_speed_timeout_s()
        estimates = [self._estimate(d, phase) for d in expected] if c.deadline_slack > 0 else [None]
        if any(e is None for e in estimates):
            budget = self.unknown_speed_timeout_s()
        else:
            budget = max(c.min_round_s, c.deadline_slack * max(e for e in estimates if e is not None))
        if c.max_round_s > 0:
            budget = min(budget, c.max_round_s) if budget > 0 else c.max_round_s
        return budget

    def _estimate(self, device_id: str, phase: str) -> float | None:
        seen = self.latency.get(phase, {}).get(device_id)
        if seen is not None:
            return seen
        est = self.devices[device_id].extra.get("est_round_s") if device_id in self.devices else None
        return float(est) if isinstance(est, int | float) and est > 0 else None

    def round_info(self, rnd: int, expected: set[str] | None = None, sampled: list[str] | None = None) -> RoundInfo:
        final = rnd > self.strategy.total_rounds()
        phase = FINAL_PHASE if final else self.strategy.phase(rnd)
        budget = self.round_budget(phase, set(self.devices) if expected is None else expected)
        return RoundInfo(
            round=rnd,
            phase=phase,
            method=self.config.method,
            deadline=time.time() + budget if budget else 0.0,
            config={} if final else self.strategy.round_config(rnd),
            sampled=sampled,
            rounds=self.strategy.total_rounds(),
        )

    def sample(self, rnd: int, online: set[str]) -> list[str] | None:
        """The devices sampled to train in round ``rnd`` (None: every online device; the final round
        evaluates every device)."""
        s = self.config.sampling
        if s is None or s.full or rnd > self.strategy.total_rounds():
            return None
        if s.selection in UTILITY_SELECTIONS:  # facts from the reports, the heartbeats and, simulated, the clock
            facts = getattr(self.transport, "selection_facts", None)
            return self.selector.choose(s, rnd, self.devices, online, self.reports, facts(rnd) if facts else None,
                                        lambda d: self._estimate(d, self.strategy.phase(rnd)), self._heat())
        return s.choose(rnd, {d: dev.profile for d, dev in self.devices.items()}, online)

    def _heat(self) -> dict[str, HeatReading] | None:
        """The thermal guard's readings from the devices' heartbeats (None: no heartbeats, or no guard)."""
        if self.health is None or not self.config.thermal_guard:
            return None
        slots = self.config.slots or {}
        return heartbeat_heat(self.health(), lambda d: slots[d].heat if d in slots else None, now=time.time(),
                              max_age_s=self.heat_max_age_s)

    def thermal_hold(self, candidates: Collection[str]) -> tuple[dict[str, str], dict[str, str]]:
        """Asynchronous mode's thermal guard (``[coordinator] thermal_guard``): which of ``candidates`` (idle online
        devices) are too hot for a new task, and why; and the candidates whose reading is too old to judge, and
        why. The selector's one :class:`~fedge.common.heat.HeatGuard` judges them, from the simulation's thermal
        model (the transport's ``heat_readings``) or the devices' heartbeats."""
        if not self.config.thermal_guard:
            return {}, {}
        readings = getattr(self.transport, "heat_readings", None)
        heat = readings() if readings is not None else self._heat() or {}
        held, stale = {}, {}
        for d in sorted(candidates):
            reading = heat.get(d)
            why = self.selector.guard.judge(d, reading)
            if why:
                held[d] = f"{why}: not tasked until it cools"
            elif reading is not None and reading.stale:
                stale[d] = reading.stale
        return held, stale

    def run_round(self, rnd: int) -> RoundReport:
        """Announce round ``rnd``, aggregate what arrives, publish the new global state.

        The one round loop of both modes: its :class:`~fedge.coordinator.policy.RoundPolicy` says who is asked and
        when the round is full (:class:`~fedge.coordinator.policy.SyncRound`, or in asynchronous mode's training
        rounds :class:`~fedge.coordinator.versions.VersionPolicy`); announcing, collecting through the gate,
        closing, publishing and checkpointing are written here once."""
        t0 = time.perf_counter()
        training = rnd <= self.strategy.total_rounds()
        policy: RoundPolicy
        if self.config.asynchronous is not None and training:
            policy = VersionPolicy(self, rnd)
        elif self.config.secure is not None and training:
            policy = SecureRound(self, rnd, self.transport.send_stages)
        else:
            policy = SyncRound(self, rnd)
        policy.open()
        if not policy.final:
            self.strategy.begin_round(rnd)
        self.gate.begin_round(rnd, final=policy.final, sampled=policy.sampled)
        self.partials.begin_round(rnd, final=policy.final)
        policy.restore()
        while not policy.done():
            step = policy.ask()
            if step.call is not None:
                self._announce(rnd, step.call)
            if step.pending is None:  # nobody to wait for: until a device is back (or a hello arrives)
                self.transport.wait_for_devices(1.0)
                continue
            policy.end_pass(self._collect(rnd, policy, step.pending, step.deadline))
        return self._close(policy, t0)

    def _announce(self, rnd: int, call: Call) -> None:
        """Publish round ``rnd``'s descriptor and tell the observers."""
        # "run" tells devices a resumed run from a new one; "globals" names the version of each
        # artifact this round starts from, so a device waits for exactly that one.
        announce = Message("round", COORDINATOR_ID, rnd, self.config.fleet,
                           info={"round": call.info.to_dict(), "run": self.run_id, **call.extra,
                                 "globals": dict(self.global_rounds)})
        self.transport.announce_round(announce.to_bytes())
        self._notify("round_started", call.info, call.asked, call.pending)

    def _collect(self, rnd: int, policy: RoundPolicy, pending: set[str], deadline: float) -> int:
        """Stream what the transport delivers through the gate into ``policy``; returns the messages received.

        Stops reading early — the transport's contract allows it: nothing received is lost, the next ``collect``
        hands it on — once the policy is done (asynchronous mode: the buffer is full) or a refusal ended a device's
        task (too stale, or trained in the stage before): that device is idle now and gets a new task at once."""
        received = 0
        for item in self.transport.collect(rnd, pending, deadline):
            received += 1
            if item.kind == "partial":  # a worker's or a relay's share of the round
                policy.partial(item)
                continue
            if item.kind in ("secagg", "secagg-sum"):  # a stage message, a relay's masked sum (coordinator.secure)
                if self.gate.admit_stage(item, policy.stage_message):
                    break  # the stage is complete: the policy closes it and asks for the next
                continue
            tasks = len(self.tasks)
            if self.gate.admit(item, policy.accept, self.transport.hellos):
                sender = policy.report.accepted[-1]
                pending.discard(sender)
                policy.admitted(item, sender)
                if policy.done():
                    break
            elif len(self.tasks) < tasks:
                break
        return received

    def _close(self, policy: RoundPolicy, t0: float) -> RoundReport:
        """Count the round's refusals and missing devices, aggregate, publish, checkpoint, tell the observers."""
        report = policy.report
        rnd = report.round
        rejections = self.gate.drain()  # hellos refused before or during this round count here
        report.rejected = dict(rejections.by_reason)
        report.rejected_by_device = {d: dict(c) for d, c in sorted(rejections.by_device.items())}
        report.missing = policy.missing()
        if undone := rolled_back(report):
            log.info("round %d: %s undid the last round (validation accuracy fell past [train] divergence_margin) "
                     "and trained from the previous model", rnd, ", ".join(undone))
        self.gate.end_round(report.missing)
        aggregation_s = 0.0
        if not policy.final:
            if self.store is not None:
                self.store.buffer_sync()  # asynchronous mode: the updates it holds are on disk before it is published
            t_agg = time.perf_counter()
            artifacts = self.strategy.finish_round(rnd)
            aggregation_s = time.perf_counter() - t_agg
            self._publish(artifacts, rnd)
            if self.config.privacy is not None:
                report.privacy = PrivacyLedger(self.config.privacy).entry(rnd)
        report.seconds = time.perf_counter() - t0
        self.reports.append(report)
        self.completed = rnd
        self._checkpoint(report)
        if self.store is not None:
            self.store.buffer_clear()  # the version is in state.json now (synchronous rounds buffer nothing)
        self._trim_reports()
        self._notify("round_finished", report, aggregation_s)
        return report

    def _trim_reports(self) -> None:
        keep = self.config.keep_reports
        if keep and len(self.reports) > keep:
            del self.reports[: len(self.reports) - keep]

    def _publish(self, artifacts: dict[str, Arrays], rnd: int) -> None:
        for name, arrays in artifacts.items():
            self.globals[name] = arrays
            self.global_rounds[name] = rnd
            msg = Message("global", COORDINATOR_ID, rnd, self.config.fleet, tensors=arrays,
                          info={"artifact": name})
            self.transport.publish_global(name, msg.to_bytes(self.config.global_precision))

    # -- the loop -------------------------------------------------------------------------
    def run(self, on_round: Callable[[RoundReport], Any] | None = None) -> list[RoundReport]:
        """Run every remaining round (resuming after the last completed one)."""
        log.info("run %s: %s on fleet %s, %d training rounds + final%s", self.run_id, self.config.method,
                 self.config.fleet, self.strategy.total_rounds(),
                 f", resuming after round {self.completed}" if self.completed else "")
        self.register_pending()
        if self.completed:
            self._republish()
        final = self.strategy.total_rounds() + 1
        rnd = self.completed + 1
        while rnd <= final:
            if rnd < final and not self._privacy_allows(rnd):
                rnd = final  # the budget is spent: no more releases, only the final evaluation
                continue
            report = self.run_round(rnd)
            if on_round is not None:
                on_round(report)
            rnd += 1
        # Over MQTT this clears the retained descriptor, so no device answers this run's final
        # round once the run is over (the base hook has nothing to clear).
        self.transport.end_run()
        self._notify("run_finished")
        return self.reports

    def _privacy_allows(self, rnd: int) -> bool:
        """Whether training round ``rnd`` keeps the fleet within its [privacy] budget ("warn": always)."""
        mech = self.config.privacy
        if mech is None or PrivacyLedger(mech).allows(rnd):
            return True
        eps = mech.epsilon(rnd)
        if mech.on_budget == "stop":
            log.warning("privacy budget ε = %g (δ = %g) would be exceeded by round %d (ε = %.3g): "
                        "stopping after round %d", mech.budget, mech.delta, rnd, eps, rnd - 1)
            return False
        log.warning("privacy budget ε = %g (δ = %g) exceeded in round %d: ε = %.3g", mech.budget, mech.delta,
                    rnd, eps)
        return True

    def _republish(self) -> None:
        for name, arrays in self.globals.items():
            rnd = self.global_rounds.setdefault(name, self.completed)
            msg = Message("global", COORDINATOR_ID, rnd, self.config.fleet, tensors=arrays,
                          info={"artifact": name})
            self.transport.publish_global(name, msg.to_bytes(self.config.global_precision))

    # -- checkpoints ----------------------------------------------------------------------
    def _checkpoint(self, report: RoundReport) -> None:
        if self.store is None:
            return
        self.store.save(EngineState(
            completed=self.completed, method=self.config.method, fleet=self.config.fleet,
            devices=self.devices, strategy=self.strategy.state_dict(), run_id=self.run_id,
            global_rounds=self.global_rounds, latency=self.latency, globals=self.globals, tasks=dict(self.tasks),
        ), report)

    def _resume(self, state: EngineState) -> None:
        self.completed = state.completed
        self.resumed_round = state.completed + 1
        self.gate.restore_devices(state.devices)
        self.strategy.load_state_dict(state.strategy)
        self.reports = state.reports
        self.run_id = state.run_id or self.run_id
        self.global_rounds = state.global_rounds
        self.latency = state.latency
        self.gate.last_missing = set(self.reports[-1].missing) if self.reports else set()
        self.globals = state.globals
        self.tasks.update(state.tasks)
        self._trim_reports()
