"""The fleet monitor after the coordinator reconnected to the broker (issue 47): at once, as a warning, it says what
the coordinator waits for — the devices training for an asynchronous version as the devices of a synchronous round.
Times are injected (the monitor's clock), and the transport's reconnections are counted by hand."""

from __future__ import annotations

import logging

import pytest

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport
from fedge.common.rounds import RoundInfo
from fedge.observe.monitor import FleetMonitor


class Reconnecting(InMemoryCoordinatorTransport):
    """An in-process transport whose connection count the test raises, as a broker outage would."""

    def __init__(self) -> None:
        super().__init__(InMemoryBus())
        self.count = 1

    def connections(self) -> int:
        return self.count


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_after_a_reconnection_the_monitor_says_what_it_waits_for(mode: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedge.observe.monitor")
    now = [100.0]
    transport = Reconnecting()
    mon = FleetMonitor(fleet="f", method="fedproto", total_rounds=5, transport=transport, wait_log_s=30.0,
                       clock=lambda: now[0], buffer_size=2 if mode == "async" else 0)
    tasks = {"d1": 2, "d3": 2}
    if mode == "async":
        info = RoundInfo(round=2, phase="train", method="fedproto", assigned=dict(tasks))
        mon.round_started(info, frozenset(tasks), tasks)
    else:
        info = RoundInfo(round=2, phase="train", method="fedproto")
        mon.round_started(info, frozenset(["d1", "d2", "d3"]), {"d1", "d3"})
    now[0] += 4.0
    mon.tick()  # the first connection is no reconnection, and the periodic line is not due yet
    assert [r for r in caplog.records if r.name == "fedge.observe.monitor"] == []
    transport.count = 2  # the broker went away and came back
    now[0] += 1.0
    mon.tick()
    lines = [r for r in caplog.records if r.name == "fedge.observe.monitor"]
    assert [r.levelno for r in lines] == [logging.WARNING]
    text = lines[0].getMessage()
    head = ("version 2 (train): waiting for the 2 updates of 2 devices training, after 5 s" if mode == "async"
            else "round 2 (train): waiting for 2 of 3 devices after 5 s")
    assert text == f"reconnected to the broker: {head}: d1 (no hello yet); d3 (no hello yet)", text
    mon.tick()  # said once per reconnection
    assert len([r for r in caplog.records if r.name == "fedge.observe.monitor"]) == 1
