"""Runs have identity: a device ignores the retained final round of a run it never trained in, and
follows a new run from its first round."""

from __future__ import annotations

from fleet_helpers import tiny_fleet

from fedge.common.messages import Message
from fedge.common.rounds import FINAL_PHASE, RoundInfo


def descriptor(rnd: int, phase: str, run: str) -> bytes:
    info = RoundInfo(rnd, phase, "fedavg")
    return Message("round", "coordinator", rnd, info={"round": info.to_dict(), "run": run, "globals": {}}).to_bytes()


def test_a_previous_runs_final_round_is_ignored_and_the_next_run_is_followed() -> None:
    fleet = tiny_fleet("fedavg", ["tier-xs"], rounds=1)
    agent = fleet.agents[0]
    fleet.bus.round_msg = descriptor(5, FINAL_PHASE, "a" * 32)  # left retained by a finished run
    assert agent.step() is False and agent.last_round == 0 and len(fleet.bus.updates) == 0
    # the next run's coordinator starts: its rounds are answered, then its own final round
    fleet.engine.run()
    assert [r.round for r in fleet.engine.reports] == [1, 2]
    assert [len(r.accepted) for r in fleet.engine.reports] == [1, 1]
    assert agent.trained_runs == {fleet.engine.run_id}
