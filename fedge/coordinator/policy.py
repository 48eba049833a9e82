"""What differs between a synchronous round and an asynchronous version, as two policies over one round loop.

:meth:`fedge.coordinator.engine.RoundEngine.run_round` is the loop, written once: it opens the round (the
strategy's, the gate's and the partial merger's ``begin_round``), then, pass after pass until the policy is
:meth:`~RoundPolicy.done`, announces what the policy :meth:`~RoundPolicy.ask`\\ s for, streams what the
transport delivers through the gate into the policy's :meth:`~RoundPolicy.accept` (which folds it into the
strategy with :meth:`~RoundPolicy.fold`, the one place either mode calls ``accumulate``), and closes the
round: refusals counted, the missing devices, ``finish_round``, publication, checkpoint, observers.

A policy says who is asked and when the round is full:

* :class:`SyncRound` — a synchronous round (and every mode's final evaluation round): one announcement to the
  online devices (those sampled), one pass that waits until each has answered or the deadline passed; a device
  asked that did not answer is missing.
* :class:`fedge.coordinator.versions.VersionPolicy` — an asynchronous version (docs/async.md): tasks handed
  out to idle devices pass after pass, updates folded in with their staleness weight, until ``buffer_size``
  are in.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.common.transport import Inbound
from fedge.coordinator.config import EngineConfig
from fedge.coordinator.gate import Admitted, UpdateGate
from fedge.coordinator.merge import PartialMerger, merged_into
from fedge.coordinator.report import RoundReport, record_admitted
from fedge.coordinator.selecting import Selector
from fedge.coordinator.store import EngineStore
from fedge.coordinator.strategy import FRESH, Contribution, Strategy
from fedge.coordinator.validation import Rejected

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What a policy uses of :class:`fedge.coordinator.engine.RoundEngine` — public members only. Named here
    because the engine imports this module (no import circle, tests/test_architecture.py); mypy checks the
    engine has them where it hands itself to a policy."""

    config: EngineConfig
    strategy: Strategy
    gate: UpdateGate
    partials: PartialMerger
    store: EngineStore | None
    tasks: dict[str, int]  # asynchronous mode: device -> the version it was asked to train from
    task_since: dict[str, float]
    latency: dict[str, dict[str, float]]
    selector: Selector  # selection = "oort" / "energy": why each device was or was not tasked (issue 44)
    session: str
    resumed_round: int

    @property
    def devices(self) -> dict[str, DeviceInfo]: ...
    def register_pending(self) -> list[str]: ...
    def await_quorum(self) -> None: ...
    def online_devices(self) -> set[str]: ...
    def sample(self, rnd: int, online: set[str]) -> list[str] | None: ...
    def round_info(self, rnd: int, expected: set[str] | None = None,
                   sampled: list[str] | None = None) -> RoundInfo: ...
    def task_timeout_s(self, device_id: str, phase: str) -> float: ...
    def thermal_hold(self, candidates: Collection[str]) -> tuple[dict[str, str], dict[str, str]]: ...


@dataclass(frozen=True)
class Call:
    """One announcement of a round: the descriptor's :class:`RoundInfo`, the keys its message info carries
    beyond the run and the globals (asynchronous mode: the process's ``session``, ``recovery``), and what the
    observers are told: the devices asked, and the engine's live collection of those it still waits for."""

    info: RoundInfo
    asked: frozenset[str]
    pending: Collection[str]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """One pass of the loop: the announcement to make first (None: the last one stands), the devices whose
    update the transport awaits (live: the loop removes each accepted one; None: nobody to wait for yet, the
    loop waits for devices and asks again) and the deadline of the wait (unix seconds; 0: none)."""

    call: Call | None
    pending: set[str] | None
    deadline: float = 0.0


class RoundPolicy(ABC):
    """Who one round asks and when it is full (the module docstring); ``open`` makes the round's report."""

    final = False  # the final evaluation round: no training, nothing accumulated or published
    sampled: list[str] | None = None  # the devices the gate admits updates from (None: every device)
    report: RoundReport

    def __init__(self, engine: Engine, rnd: int) -> None:
        self.engine = engine
        self.rnd = rnd

    @abstractmethod
    def open(self) -> RoundReport:
        """Before the round begins: set ``report``, ``final`` and ``sampled``; returns the report."""

    def restore(self) -> None:  # noqa: B027 - optional hook
        """After the round began: fold in what a restarted coordinator had accepted into it (default: none)."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the round has what it waits for (checked before each pass and after each accepted update)."""

    @abstractmethod
    def ask(self) -> Pass:
        """The next pass: what to announce and whom to wait for."""

    @abstractmethod
    def accept(self, up: Admitted) -> None:
        """An update the gate admitted (inside its error boundary: raising refuses it); calls :meth:`fold`."""

    def admitted(self, item: Inbound, sender: str) -> None:  # noqa: B027 - optional hook
        """After ``sender``'s update (``item``) was accepted and removed from the pending devices."""

    @abstractmethod
    def partial(self, item: Inbound) -> None:
        """A partial aggregate from an aggregation worker or a relay."""

    def stage_message(self, item: Inbound) -> bool:
        """A device's secure-aggregation stage message (inside the gate's error boundary: raising refuses it);
        returns whether the pass may end (everyone owing this stage answered). Default: refused, no secure sum
        runs (:class:`fedge.coordinator.secure.SecureRound` takes them)."""
        raise Rejected("secagg-late", f"a stage message from {(item.origin or '?')[:64]} in round {self.rnd}, "
                                      "which sums nothing securely")

    @abstractmethod
    def end_pass(self, received: int) -> None:
        """The transport's collect returned (or the loop stopped reading it) after ``received`` messages."""

    @abstractmethod
    def missing(self) -> list[str]:
        """The devices asked whose update did not arrive (reported ``missing``, refused ``late`` next round)."""

    def fold(self, up: Admitted, at: Contribution = FRESH) -> None:
        """Accumulate ``up`` into the strategy (``at``: how much it counts) and record it in the report."""
        strategy = self.engine.strategy
        if not self.final and not strategy.secure_sums:  # secure: accumulate_group_sum instead; final: metrics
            strategy.accumulate(up.device, up.msg.tensors, up.msg.info, at)
        record_admitted(self.report, up)


class SyncRound(RoundPolicy):
    """A synchronous round: one announcement, one pass until every expected device answered or the deadline."""

    def open(self) -> RoundReport:
        e, rnd = self.engine, self.rnd
        e.await_quorum()
        online = e.online_devices()
        self.sampled = e.sample(rnd, online)
        # a sampled device that is offline cannot answer: the round waits only for the online ones
        expected = online if self.sampled is None else online & set(self.sampled)
        self.info = e.round_info(rnd, expected, self.sampled)
        self.final = self.info.is_final
        self.expected = frozenset(expected)
        self.pending = set(expected)  # live: the transport stops once it is empty
        # report.accepted as a set, kept in step with it: a partial checks its devices against it, and rebuilding
        # it for every partial would cost O(devices) per partial (O(N x shards) per round at the root).
        self.accepted: set[str] = set()
        self.announced_at = 0.0
        self.collected = False
        deadline_s = max(0.0, self.info.deadline - time.time())
        self.report = RoundReport(round=rnd, phase=self.info.phase, deadline_s=deadline_s,
                                  sampled=list(self.sampled or []),
                                  selection=e.selector.why if self.sampled else {},
                                  hot=list(e.selector.held) if self.sampled else [])
        return self.report

    def done(self) -> bool:
        return self.collected

    def ask(self) -> Pass:
        self.announced_at = time.time()
        return Pass(Call(self.info, self.expected, self.pending), self.pending, self.info.deadline)

    def accept(self, up: Admitted) -> None:
        self.fold(up)

    def admitted(self, item: Inbound, sender: str) -> None:
        self.accepted.add(sender)
        # A round re-run after a restart receives updates the broker queued for the old process: their "latency"
        # measures the restart, not the device, and would shrink the next deadline.
        if item.received > 0 and self.rnd != self.engine.resumed_round:
            self.engine.latency.setdefault(self.info.phase, {})[sender] = max(0.0, item.received - self.announced_at)

    def partial(self, item: Inbound) -> None:
        e, report = self.engine, self.report
        e.register_pending()  # the hellos of the devices it lists may have just arrived
        before = len(report.accepted)
        self.pending.difference_update(e.partials.admit(item, self.accepted, merged_into(report, item.origin)))
        self.accepted.update(report.accepted[before:])

    def end_pass(self, received: int) -> None:
        self.collected = True

    def missing(self) -> list[str]:
        asked = set(self.engine.devices) if self.sampled is None else set(self.sampled)  # unsampled owe nothing
        missing = sorted(asked - self.accepted)
        if missing:
            log.warning("round %d: no update from %s", self.rnd, ", ".join(missing))
        return missing
