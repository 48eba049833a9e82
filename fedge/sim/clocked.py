"""The virtual clock in ``fedge simulate``: the in-process fleet stepped in virtual time.

In-process (:func:`clock_inprocess`), the coordinator transport answers the engine from the clock:
a device offline at the round's start (``[clock] availability``) is ``offline()`` to the engine and is
not stepped; each round's participants are timed by :meth:`fedge.fleet.clock.FleetClock.sync_round`
from the bytes they actually moved and their planned training; an update that the clock says never
arrived (its device went offline first, or it missed ``[clock] deadline_s``) is withdrawn before the
engine sees it, so the engine reports that device missing exactly as over a real network. When no
device is online, the engine's wait for its quorum moves the clock to the next device's return.

The final evaluation round is the simulator's measurement, not a round of the fleet: every device
evaluates, and it takes no virtual time. A device's ``train_s`` is its training's virtual seconds here (the
simulating host's seconds mean nothing for the device, and would make the update's bytes differ run to run).

Over MQTT the rounds run on the real clock; :func:`replay_clock` times them afterwards from the round
reports (every device always online).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport
from fedge.common.messages import Message
from fedge.common.rounds import FINAL_PHASE, RoundInfo
from fedge.common.selection import SystemFacts
from fedge.coordinator.report import RoundReport
from fedge.edge.agent import DeviceAgent
from fedge.errors import ConfigError
from fedge.fleet.clock import FleetClock, Participation
from fedge.fleet.energy import selection_facts

log = logging.getLogger(__name__)


class ClockedCoordinatorTransport(InMemoryCoordinatorTransport):
    """The in-memory coordinator transport with availability and virtual time (see the module docstring)."""

    def __init__(self, bus: InMemoryBus, agents: Sequence[DeviceAgent], clock: FleetClock, *, final_round: int) -> None:
        super().__init__(bus)
        self.agents = list(agents)
        self.clock = clock
        self.final_round = final_round
        self._next_round = 1
        bus.pump = self._pump

    def announce_round(self, data: bytes) -> None:
        super().announce_round(data)
        self._next_round = Message.from_bytes(data).round + 1  # our own engine's bytes

    def selection_facts(self, rnd: int) -> dict[str, SystemFacts]:
        """``selection = "oort"`` / ``"energy"``: each device's expected task time and joules, and its battery, from
        the clock (:func:`fedge.fleet.energy.selection_facts`), with the bytes of its last task."""
        moved = {a.device.device_id: (a.traffic[-1].bytes_down, a.traffic[-1].bytes_up) for a in self.agents
                 if a.traffic}
        return selection_facts(self.clock, rnd, moved)

    def offline(self) -> set[str]:
        if self._next_round >= self.final_round:
            return set()  # the final evaluation: every device (see the module docstring)
        return set(self.clock.devices) - self.clock.online()

    def wait_for_devices(self, timeout_s: float) -> None:
        self.clock.advance_to_online()  # nobody online: time passes until someone returns

    def _pump(self) -> None:
        raw = self.bus.round_msg
        if raw is None:
            return
        info = RoundInfo.from_dict(Message.from_bytes(raw).info["round"])
        if info.phase == FINAL_PHASE:
            for a in self.agents:
                a.timer = Stopwatch(0.0)  # evaluation only: no virtual time
                a.step()
            return
        online = self.clock.online()
        sent: dict[str, list[bytes]] = {}
        done: dict[str, Participation] = {}
        for a in self.agents:
            dev = a.device.device_id
            if dev not in online:
                continue
            before, handled = len(self.bus.updates), len(a.traffic)
            # the device reports the virtual seconds of its training as its train_s, not the simulating host's
            # time: the update's bytes (and so the clock) then repeat exactly for a seed
            a.timer = Stopwatch(self.clock.devices[dev].train_s(info.round))
            a.step()
            if len(a.traffic) > handled and a.traffic[-1].round == info.round:
                t = a.traffic[-1]
                done[dev] = Participation(t.bytes_down, t.bytes_up, trained=True)
                sent[dev] = list(self.bus.updates)[before:]
        timed = self.clock.sync_round(info.round, done)
        lost = {d for d, r in timed.devices.items() if not r.delivered}
        if lost:
            drop = {id(m) for d in lost for m in sent[d]}
            kept = [m for m in self.bus.updates if id(m) not in drop]
            self.bus.updates.clear()
            self.bus.updates.extend(kept)
            for d in sorted(lost):
                log.info("round %d: %s's update is lost in virtual time (%s)", info.round, d, timed.devices[d].lost)


class Stopwatch:
    """A timer that reads 0 and then ``elapsed`` (and so on): what an agent's ``train_s`` measures in virtual time."""

    def __init__(self, elapsed: float) -> None:
        self.elapsed, self._started = elapsed, False

    def __call__(self) -> float:
        self._started = not self._started
        return 0.0 if self._started else self.elapsed


def replay_clock(clock: FleetClock, reports: Sequence[RoundReport]) -> FleetClock:
    """Time finished rounds (over MQTT, on the real clock) in virtual time: every accepted device took part."""
    for rep in reports:
        if rep.phase == FINAL_PHASE:
            continue
        clock.sync_round(rep.round, {d: Participation(rep.bytes_down.get(d, 0), rep.bytes_up.get(d, 0), trained=True)
                                     for d in rep.accepted})
    return clock


def check_transport(clock_availability: str, transport: str) -> None:
    """Availability is simulated in-process only: refuse it over another transport before any work."""
    if clock_availability != "always" and transport != "inprocess":
        raise ConfigError(f"[clock] availability = {clock_availability!r} needs --transport inprocess",
                          hint="over MQTT rounds run on the real clock; drop availability, or run in-process")
