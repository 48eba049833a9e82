"""How long an asynchronous task may go unanswered (issue 47): the default ("auto", the same in the library's
EngineConfig and on ``fedge coordinator run``) derives it from the device's expected task time, with a floor and a
multiplier; a task that times out is withdrawn and handed out again, with the ``recovery`` flag that makes its
device resend the update that was lost on the way. Times are injected (a virtual wall clock), never measured."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from fleet_helpers import tiny_fleet

from fedge.common.asyncmode import AsyncSettings
from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.transport import Inbound
from fedge.coordinator import versions
from fedge.coordinator.config import (
    TASK_TIMEOUT_FACTOR,
    TASK_TIMEOUT_FLOOR_S,
    UNKNOWN_SPEED_TIMEOUT_S,
    DeviceSlotCheck,
    EngineConfig,
)


class Clock:
    """A wall clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


def test_the_default_is_auto_in_the_library_and_on_the_command_line() -> None:
    from fedge.cli import build_parser
    from fedge.coordinator.config import SERVICE_DEFAULTS

    args = build_parser().parse_args(["coordinator", "run", "--config", "f.toml", "--state-dir", "s"])
    assert EngineConfig().round_timeout_s is None and SERVICE_DEFAULTS["round_timeout_s"] is None
    assert args.round_timeout is None  # not given: the fleet config's [coordinator] table, else auto
    assert (TASK_TIMEOUT_FLOOR_S, TASK_TIMEOUT_FACTOR, UNKNOWN_SPEED_TIMEOUT_S) == (60.0, 3.0, 300.0)


def test_a_task_timeout_follows_the_expected_task_time_with_a_floor_and_a_multiplier() -> None:
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 4, asynchronous=AsyncSettings(buffer_size=2, fleet_size=4))
    engine = fleet.engine
    engine.register_pending()
    phase = engine.strategy.phase(1)
    assert engine.task_timeout_s("d0", phase) == 0.0  # in-process: nothing is lost, no wall-clock timeout
    engine.transport.realtime = True  # over a network
    assert engine.task_timeout_s("d0", phase) == UNKNOWN_SPEED_TIMEOUT_S  # nobody knows its speed
    info = engine.devices["d1"]
    engine.gate.devices["d1"] = dataclasses.replace(info, extra={**info.extra, "est_round_s": 40.0})
    assert engine.task_timeout_s("d1", phase) == 120.0  # 3 x its hello's estimate
    engine.latency[phase] = {"d1": 5.0}
    assert engine.task_timeout_s("d1", phase) == TASK_TIMEOUT_FLOOR_S  # 3 x its last task (15 s), floored
    engine.config = dataclasses.replace(engine.config, slots={
        "d2": DeviceSlotCheck(DeviceInfo("d2", "tier-xs", "test"), expected_task_s=50.0)})
    assert engine.task_timeout_s("d2", phase) == 150.0  # the fleet config's clock model
    engine.config = dataclasses.replace(engine.config, round_timeout_s=0.0)
    assert engine.task_timeout_s("d2", phase) == 0.0  # 0: wait forever
    engine.config = dataclasses.replace(engine.config, round_timeout_s=12.0)
    assert engine.task_timeout_s("d2", phase) == 12.0  # a fixed timeout for every task


def test_a_lost_update_times_out_and_its_task_is_handed_out_again_and_resent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """d1's first update is lost on the way (the transport drops it): with a buffer of all three devices version 1
    cannot fill; after the default timeout (no speed known: UNKNOWN_SPEED_TIMEOUT_S of virtual time) its task is
    withdrawn and handed out again with ``recovery``, d1 resends its cached update and the version fills with it,
    counted once."""
    clock = Clock()
    monkeypatch.setattr(versions, "time", types.SimpleNamespace(time=clock.time, perf_counter=clock.perf_counter))
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 3, rounds=2, asynchronous=AsyncSettings(buffer_size=3, fleet_size=3))
    transport = fleet.engine.transport
    transport.realtime = True
    inner = transport.collect
    lost: list[str] = []
    waits: list[float] = []

    def collect(round: int, expected: Collection[str], deadline: float) -> Iterator[Inbound]:
        got = False
        for item in inner(round, expected, deadline):
            if not lost and Message.from_bytes(item.data).sender == "d1":
                lost.append("d1")  # sent, and lost on the way
                continue
            got = True
            yield item
        if not got and deadline:
            waits.append(deadline - clock.now)
            clock.now = deadline  # nothing arrives: the wait lasts until the first task times out

    transport.collect = collect  # type: ignore[method-assign]
    reports = fleet.engine.run()
    assert lost == ["d1"] and waits == [UNKNOWN_SPEED_TIMEOUT_S]
    first = reports[0]
    assert first.missing == ["d1"] and sorted(first.accepted) == ["d0", "d1", "d2"]
    assert first.rejected == {}  # the resent copy is the one counted; nothing twice
    assert [sorted(r.accepted) for r in reports[1:-1]] == [["d0", "d1", "d2"]]


def test_fedge_coordinator_run_gives_each_device_its_clock_model_task_time(tmp_path: Path) -> None:
    from observe_helpers import small_fleet

    from fedge.cli import build_parser
    from fedge.coordinator.fromfleet import engine_parts
    from fedge.fleet.clock import fleet_clock
    from fedge.fleet.slots import checked_slots

    args = build_parser().parse_args(["coordinator", "run", "--config", "f.toml", "--state-dir", "s"])
    cfg = small_fleet(tmp_path, "clocked", extra='[coordinator]\nmode = "async"\nbuffer_size = 2\n')
    engine_cfg, _ = engine_parts(args, cfg, any_device=False)
    assert engine_cfg.round_timeout_s is None and engine_cfg.slots is not None
    clocks = fleet_clock(cfg, checked_slots(cfg)).devices
    expected = {d: c.expected_task_s or 0.0 for d, c in engine_cfg.slots.items()}  # None would fail "> 0"
    assert expected == {d: clocks[d].train_s(1) for d in clocks} and all(v > 0 for v in expected.values())
    assert expected["rpi4-2gb-1"] > expected["x86-gateway-1"]  # a Pi 4 is slower than the gateway
    sync_cfg, _ = engine_parts(args, small_fleet(tmp_path, "sync"), any_device=False)
    assert sync_cfg.slots is not None and {c.expected_task_s for c in sync_cfg.slots.values()} == {None}
