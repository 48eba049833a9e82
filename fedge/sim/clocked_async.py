"""Asynchronous mode in ``fedge simulate``: the in-process fleet as events in virtual time.

The engine runs its versions unchanged (:class:`fedge.coordinator.versions.VersionPolicy`); this
coordinator transport answers it from the virtual clock. When a descriptor assigns a device a task and the
device is online and free, the device starts at once: it is stepped there and then (it takes the latest
version and trains), and its update is held back until the clock says it arrives — download, its training
and upload by :meth:`fedge.fleet.clock.DeviceClock.timing`, the device's n-th task seeding its jitter. The
engine's ``collect`` receives updates in order of arrival, the clock moving to each; a device that goes
offline before it finishes loses its update (its last will is heard then), and it does the task again, from
the version then current, once it is back. Everything is a function of the seed: a run repeats exactly.

Each version is recorded as a :class:`~fedge.fleet.clock.RoundTime` from the previous version's publication
to its own, holding the tasks that ended in it (delivered or lost), so results.json's virtual times, the
busy / idle shares read the same as for synchronous rounds: a task is busy from its start (download, compute,
upload), whichever version it started in, and the tasks under way when the run ends are busy until then
(:attr:`FleetClock.other_work <fedge.fleet.clock.FleetClock.other_work>`).

A version's report holds the accuracies of the devices that started a task from it, a different few each time,
so its mean says nothing of the fleet. The fleet curve does: every ``[run] eval_every`` versions, and after the
last, every device of the fleet evaluates the global state just published as it would at the start of a round
(its group's model, or its method's own predictor: :meth:`fedge.edge.agent.DeviceAgent.measure`, the code a
synchronous round evaluates with), on a copy of its method, whatever it is doing and in no virtual time: the
experimenter's measurement, not the fleet's work, so the run is the same with it or without. The points are
:attr:`FleetClock.evaluations <fedge.fleet.clock.FleetClock.evaluations>`; results.json's ``time_to_accuracy``
is made of them.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from fedge.common.heat import HeatReading
from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport
from fedge.common.messages import Message
from fedge.common.rounds import FINAL_PHASE, RoundInfo, evaluates_at
from fedge.common.transport import Inbound
from fedge.edge.agent import DeviceAgent
from fedge.errors import ConfigError
from fedge.fleet.clock import DeviceRound, FleetClock, FleetEvaluation, RoundTime
from fedge.fleet.energy import heat_reading
from fedge.sim.clocked import Stopwatch

log = logging.getLogger(__name__)
# Tasks lost in a row, per device of the fleet, after which a run is declared unable to fill a version. Even a
# task as long as the mean online spell is lost with probability 1 - 1/e (exponential spells): 20 per device in
# a row, 0.63^(20 N), does not happen by chance.
LOST_IN_A_ROW_PER_DEVICE = 20


@dataclass(order=True)
class _Arrival:
    """One task's end: its update arrives at ``at`` (or, when ``lost``, its device went offline then)."""

    at: float
    seq: int
    device: str = field(compare=False)
    updates: list[bytes] = field(compare=False)
    timeline: DeviceRound = field(compare=False)


class AsyncClockedTransport(InMemoryCoordinatorTransport):
    """The in-memory coordinator transport driving an asynchronous fleet in virtual time (module docstring)."""

    def __init__(self, bus: InMemoryBus, agents: Sequence[DeviceAgent], clock: FleetClock, *,
                 eval_every: int = 1) -> None:
        super().__init__(bus)
        self.eval_every = eval_every  # [run] eval_every: the versions after which the fleet is measured
        self.agents = {a.device.device_id: a for a in agents}
        self.order = [a.device.device_id for a in agents]
        self.clock = clock
        self._arrivals: list[_Arrival] = []
        self._busy: set[str] = set()
        self._tasks_run: dict[str, int] = {d: 0 for d in self.order}  # jitter stream per device
        self._seq = 0
        self._lost_in_a_row = 0  # tasks lost to going offline since the last update that arrived
        self._tasks: dict[str, int] = {}
        self._final = False
        self._version: RoundTime | None = None
        # updates that arrived and are not handed to the engine yet: the engine may stop reading between two
        # (a full buffer, a refusal that ended a task), and the next collect hands on the rest first
        self._ready: deque[bytes] = deque()
        bus.pump = None  # devices are stepped here, in virtual time

    # -- what the engine asks ---------------------------------------------------------------
    def announce_round(self, data: bytes) -> None:
        super().announce_round(data)
        msg = Message.from_bytes(data)  # our own engine's bytes
        info = RoundInfo.from_dict(msg.info["round"])
        self._final = info.phase == FINAL_PHASE
        self._tasks = dict(info.assigned or {})
        if self._version is None or self._version.round != msg.round:
            if self._version is not None:
                self._close_version()
            self._version = RoundTime(msg.round, self.clock.now, self.clock.now)
            if self._final:  # the tasks still under way are busy until the run's end (FleetClock.busy_s)
                for a in self._arrivals:
                    self.clock.other_work.setdefault(a.device, []).append(a.timeline)
            if evaluates_at(msg.round, self.eval_every, final=self._final):
                self._measure(info)

    def end_run(self) -> None:
        super().end_run()
        if self._version is not None and not self._final:
            self._close_version()

    def offline(self) -> set[str]:
        if self._final:
            return set()  # the final evaluation: every device, in no virtual time
        return set(self.clock.devices) - self.clock.online()

    def wait_for_devices(self, timeout_s: float) -> None:
        before = self.clock.now
        self.clock.advance_to_online()  # nobody to work: time passes until a device returns
        if self.clock.now == before:  # everyone is online and idle, yet none was tasked: the thermal guard holds
            self.clock.now += timeout_s  # them all, and they cool while the coordinator waits (as over a network)

    def heat_readings(self) -> dict[str, HeatReading]:
        """What the thermal guard (``[coordinator] thermal_guard``) knows of each device's heat now: the virtual
        clock's thermal model, as a heartbeat would say it (:func:`fedge.fleet.energy.heat_reading`; a profile
        without a ``[thermal]`` table: nothing)."""
        return {d: r for d, c in self.clock.devices.items() if (r := heat_reading(c, self.clock.now)) is not None}

    def collect(self, round: int, expected: Collection[str], deadline: float) -> Iterator[Inbound]:
        if self._final:
            yield from self._evaluate_all()
            return
        while True:
            while self._ready:
                yield Inbound(self._ready.popleft())
            self._start_ready()
            if not self._arrivals:
                return
            arrival = heapq.heappop(self._arrivals)
            self.clock.now = max(self.clock.now, arrival.at)
            self._busy.discard(arrival.device)
            assert self._version is not None
            earlier = self._version.devices.get(arrival.device)
            if earlier is not None:  # a second task of this device ends in this version (one was lost or refused)
                self.clock.other_work.setdefault(arrival.device, []).append(earlier)
            self._version.devices[arrival.device] = arrival.timeline
            if arrival.timeline.lost:
                # offline before it finished: nothing arrives; it does the task again once back (module docstring)
                log.info("version %d: %s's update is lost in virtual time (went offline)", round, arrival.device)
                self.agents[arrival.device].task_done = None
                self._lost_in_a_row += 1
                if self._lost_in_a_row > LOST_IN_A_ROW_PER_DEVICE * len(self.order):
                    raise self._never_delivered(arrival.timeline)
                continue
            self._lost_in_a_row = 0
            self._tasks.pop(arrival.device, None)  # its task is over (the engine accepts or refuses the update)
            self._ready.extend(arrival.updates)

    # -- the devices ------------------------------------------------------------------------
    def _start_ready(self) -> None:
        """Start every device that has a task, is online and is free: it trains now, its update arrives later."""
        online = self.clock.online()
        for dev in self.order:
            if dev not in self._tasks or dev in self._busy or dev not in online:
                continue
            agent = self.agents[dev]
            before, handled = len(self.bus.updates), len(agent.traffic)
            n = self._tasks_run[dev] = self._tasks_run[dev] + 1
            c = self.clock.devices[dev]
            version = self._version.round if self._version is not None else None  # whose start it evaluates
            agent.timer = Stopwatch(c.train_s(n, version))
            agent.step()
            sent = list(self.bus.updates)[before:]  # held back until they arrive
            for _ in sent:
                self.bus.updates.pop()
            if len(agent.traffic) == handled:
                # nothing trained; a cached update it sent again is dropped: in-process no coordinator restarts,
                # and the device heard each descriptor late here, not when it was published
                continue
            t = agent.traffic[-1]
            timing = c.timing(n, bytes_down=t.bytes_down, bytes_up=t.bytes_up, work=c.work, eval_round=version,
                              start=self.clock.now)
            start = self.clock.now
            gone = c.availability.online_until(start)
            finish = start + timing.total_s
            lost = "offline" if finish > gone else ""
            rec = c.record(start, timing, bytes_down=t.bytes_down, bytes_up=t.bytes_up, until=gone, lost=lost)
            self._busy.add(dev)
            self._push(dev, sent, rec, at=gone if lost else finish)

    def _never_delivered(self, last: DeviceRound) -> ConfigError:
        """The run cannot go on: tasks keep outlasting the devices' online spells, so no version would fill."""
        work = last.download_s + last.compute_s + last.upload_s
        return ConfigError(
            f"{self._lost_in_a_row} tasks in a row were lost: each device went offline before its task was done "
            f"(the last task needed {work:.3g} virtual s), so no update arrives and no version would ever be made",
            hint="make devices stay online longer than a task takes ([clock] online_mean_s, or the trace), or "
                 "make a task shorter (fewer local_epochs, a larger eval_every, a smaller model)")

    def _push(self, dev: str, updates: list[bytes], rec: DeviceRound, *, at: float | None = None) -> None:
        self._seq += 1
        heapq.heappush(self._arrivals, _Arrival(rec.finish_s if at is None else at, self._seq, dev, updates, rec))

    def _evaluate_all(self) -> Iterator[Inbound]:
        """The final round: every device applies the last version and evaluates, in no virtual time."""
        for dev in self.order:
            agent = self.agents[dev]
            agent.timer = Stopwatch(0.0)
            agent.step()
        while self.bus.updates:
            yield Inbound(self.bus.updates.popleft())

    def _measure(self, info: RoundInfo) -> None:
        """The fleet curve's point after version ``info.round - 1``: every device, online or not, busy or not,
        evaluates the global state published now as it would at the start of ``info``'s round
        (:meth:`DeviceAgent.measure`), in no virtual time and leaving the run as it was."""
        metrics = {dev: self.agents[dev].measure(info) for dev in self.order}
        self.clock.evaluations.append(FleetEvaluation(info.round - 1, self.clock.now, metrics))

    def _close_version(self) -> None:
        assert self._version is not None
        self._version.end_s = self.clock.now
        self.clock.rounds.append(self._version)
