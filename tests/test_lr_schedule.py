"""``[train] lr_schedule`` (issue 45): the learning rate of each round under "constant" and "cosine", the round
descriptor's ``rounds`` (the coordinator's total, which wins over the device's own), the plan's default and its
reason, in-process (synchronous and asynchronous) and over a real Mosquitto."""

from __future__ import annotations

import itertools
import math
import tomllib
from typing import Any

import pytest

from fedge.common.lrschedule import COSINE_FLOOR, LR_SCHEDULES, check_schedule, scheduled_lr
from fedge.common.messages import Message
from fedge.common.rounds import RoundInfo
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.agent import DeviceAgent
from fedge.edge.training import TrainConfig
from fedge.errors import ConfigError, PayloadError
from fedge.fleet.config import FleetConfig, parse_fleet
from fedge.fleet.devices import SimDevice
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.settings import TransportSettings
from fedge.profiles.loader import load_profile
from fedge.profiles.planner import DEFAULT_LR, DEFAULT_LR_SCHEDULE, PROTOCOL_LR, plan
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet, run_rounds

FLEET = """
[run]
method = "fedavg"
rounds = {rounds}
dataset = "digits"
fleet = "{fleet}"
seed = 3

[partition]
kind = "iid"
fraction = 0.3

[train]
lr = 0.1
{schedule}
local_epochs = 1
batch_size = 32

[[devices]]
profile = "rpi4-2gb"
count = 2
arch = "tier-xs"
"""


def fleet(rounds: int, schedule: str | None = "cosine", name: str = "lrs", extra: str = "") -> FleetConfig:
    line = "" if schedule is None else f'lr_schedule = "{schedule}"'
    raw = tomllib.loads(FLEET.format(rounds=rounds, fleet=name, schedule=line) + extra)
    return parse_fleet(raw, source="test_lr_schedule")


def record_lrs(devices: list[SimDevice]) -> list[tuple[str, int, int, float]]:
    """(device, round, descriptor's rounds, learning rate) of every round each device trains, as it trains it."""
    seen: list[tuple[str, int, int, float]] = []
    for d in devices:
        train = d.method.train_round

        def watched(info: RoundInfo, train: Any = train, d: SimDevice = d) -> Any:
            seen.append((d.info.device_id, info.round, info.rounds, d.method.ctx.train_cfg.lr))
            return train(info)

        d.method.train_round = watched  # type: ignore[method-assign]
    return seen


def test_cosine_runs_from_lr_at_round_one_to_a_tenth_at_the_last() -> None:
    assert scheduled_lr(0.1, "cosine", 1, 12) == 0.1
    assert scheduled_lr(0.1, "cosine", 12, 12) == pytest.approx(0.01)
    # half way (round 6.5 of 12 has no round: 6 and 7 sit either side of the mean of the two ends)
    mid = (0.1 + 0.01) / 2
    assert scheduled_lr(0.1, "cosine", 6, 12) > mid > scheduled_lr(0.1, "cosine", 7, 12)
    assert scheduled_lr(0.2, "cosine", 3, 5) == pytest.approx(0.11)  # round 3 of 5: exactly half way
    lrs = [scheduled_lr(0.1, "cosine", r, 12) for r in range(1, 13)]
    assert all(a > b for a, b in itertools.pairwise(lrs))  # it only falls
    assert scheduled_lr(0.1, "cosine", 20, 12) == pytest.approx(COSINE_FLOOR * 0.1)  # past the total: the floor
    assert scheduled_lr(0.1, "cosine", 0, 12) == 0.1
    assert scheduled_lr(0.1, "cosine", 1, 1) == 0.1 and scheduled_lr(0.1, "cosine", 5, 0) == 0.1  # no total
    assert {scheduled_lr(0.05, "constant", r, 12) for r in range(1, 13)} == {0.05}


def test_an_unknown_schedule_is_refused_with_the_closest_name() -> None:
    assert LR_SCHEDULES == ("constant", "cosine")
    assert check_schedule("cosine") == "cosine"
    with pytest.raises(ConfigError, match="lr_schedule = 'cosin' is not a learning-rate schedule") as exc:
        check_schedule("cosin")
    assert exc.value.hint is not None and "did you mean 'cosine'?" in exc.value.hint
    with pytest.raises(ConfigError, match="did you mean 'constant'"):
        fleet(3, "constnt")
    with pytest.raises(ConfigError, match="known: 'constant', 'cosine'"):
        fleet(3, "step")
    with pytest.raises(ConfigError, match="lr_schedule"):
        parse_fleet(tomllib.loads(FLEET.format(rounds=3, fleet="x", schedule="lr_schedule = 1")), source="t")
    with pytest.raises(ConfigError, match="cosin"):
        TrainConfig(lr_schedule="cosin")
    assert fleet(3, None).train.lr_schedule is None  # unset: the plan decides


def test_train_config_at_round() -> None:
    cfg = TrainConfig(lr=0.1, lr_schedule="cosine", rounds=12)
    assert cfg.at_round(1) is cfg
    assert cfg.at_round(12).lr == pytest.approx(0.01)  # over its own rounds
    assert cfg.at_round(3, 3).lr == pytest.approx(0.01)  # over the total it is given
    assert cfg.at_round(12).batch_size == cfg.batch_size and cfg.at_round(12).lr_schedule == "cosine"
    assert TrainConfig(lr=0.1).at_round(12, 12).lr == 0.1  # constant by default


def test_the_descriptor_carries_the_total_and_refuses_a_malformed_one() -> None:
    info = RoundInfo(round=2, phase="train", method="fedavg", rounds=12)
    assert info.to_dict()["rounds"] == 12
    assert RoundInfo.from_dict(info.to_dict()) == info
    d = info.to_dict()
    del d["rounds"]  # a coordinator that does not say: 0, the device's own total
    assert RoundInfo.from_dict(d).rounds == 0
    for bad in (-1, "12", 1.5, True, None):
        with pytest.raises(PayloadError, match=r"round descriptor: rounds = .* is not a count of rounds"):
            RoundInfo.from_dict({**info.to_dict(), "rounds": bad})


def test_an_agent_ignores_a_descriptor_whose_rounds_is_malformed(caplog: pytest.LogCaptureFixture) -> None:
    cfg = fleet(3)
    devices, _ = build_fleet(cfg)
    d = devices[0]
    trained = record_lrs([d])

    class OneDescriptor:
        def __init__(self, raw: bytes) -> None:
            self.raw = raw

        def current_round(self) -> bytes:
            return self.raw

    good = RoundInfo(round=1, phase="train", method="fedavg", rounds=3).to_dict()
    msg = Message("round", "coordinator", 1, cfg.run.fleet, info={"round": {**good, "rounds": "3"}})
    agent = DeviceAgent(d.method, OneDescriptor(msg.to_bytes()), d.info, fleet=cfg.run.fleet)  # type: ignore[arg-type]
    with caplog.at_level("WARNING"):
        assert agent.step() is False
    assert "ignored a bad round descriptor: round descriptor: rounds = '3'" in caplog.text
    assert trained == [] and agent.last_round == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_round_trains_at_its_scheduled_rate_in_process(mode: str) -> None:
    extra = '\n[coordinator]\nmode = "async"\nbuffer_size = 1\n' if mode == "async" else ""
    cfg = fleet(4, extra=extra)
    devices, strat = build_fleet(cfg)
    assert {d.method.ctx.train_cfg.lr_schedule for d in devices} == {"cosine"}
    seen = record_lrs(devices)
    run_rounds(cfg, devices, strat)
    assert seen, "no device trained"
    for _dev, rnd, total, lr in seen:
        # the round (in asynchronous mode the version the device trains from) of the coordinator's total
        assert total == 4 and 1 <= rnd <= 4
        assert lr == pytest.approx(scheduled_lr(0.1, "cosine", rnd, 4))
    rounds = {rnd for _d, rnd, _t, _lr in seen}
    if mode == "sync":  # every device, every round, the last at a tenth
        assert sorted((dev, rnd) for dev, rnd, _t, _lr in seen) == sorted(
            (d.info.device_id, r) for d in devices for r in range(1, 5))
    else:  # buffer 1: a version per update; the devices train from versions spread over the run
        assert max(rounds) >= 3
    # the device's settings as configured are left as they were for the next run: round 1 trains at 0.1 again
    d = devices[0]
    assert d.method.schedule(RoundInfo(round=1, phase="train", method="fedavg", rounds=4)) == 0.1


def test_constant_trains_every_round_at_lr() -> None:
    cfg = fleet(3, "constant")
    devices, strat = build_fleet(cfg)
    seen = record_lrs(devices)
    run_rounds(cfg, devices, strat)
    assert len(seen) == 6 and {lr for *_x, lr in seen} == {0.1}


def test_the_plan_chooses_lr_and_cosine_and_says_why_and_explicit_settings_win() -> None:
    p = plan(load_profile("rpi4-2gb"))
    assert (p.lr, p.lr_schedule) == (DEFAULT_LR, DEFAULT_LR_SCHEDULE) == (PROTOCOL_LR, "cosine")
    assert "cosine" in p.reasons["lr_schedule"] and "0.01 by the run's last round" in p.reasons["lr_schedule"]
    assert "issue 45" in p.reasons["lr_schedule"] and "0.1" in p.reasons["lr"]
    assert p.to_dict()["lr_schedule"] == "cosine"
    # nothing set in [train]: the plan's; set: the config's, each key on its own
    base = FLEET.replace("lr = 0.1\n{schedule}\n", "{schedule}\n")
    unset = parse_fleet(tomllib.loads(base.format(rounds=3, fleet="p", schedule="")), source="t")
    tc = build_fleet(unset)[0][0].method.ctx.train_cfg
    assert (tc.lr, tc.lr_schedule, tc.rounds) == (0.1, "cosine", 3)
    pinned = parse_fleet(tomllib.loads(base.format(rounds=3, fleet="p", schedule='lr = 0.05\nlr_schedule = '
                                                                                  '"constant"')), source="t")
    tc = build_fleet(pinned)[0][0].method.ctx.train_cfg
    assert (tc.lr, tc.lr_schedule) == (0.05, "constant")
    lr_only = parse_fleet(tomllib.loads(base.format(rounds=3, fleet="p", schedule="lr = 0.05")), source="t")
    tc = build_fleet(lr_only)[0][0].method.ctx.train_cfg
    assert (tc.lr, tc.lr_schedule) == (0.05, "cosine")


def test_a_device_over_mqtt_anneals_over_the_coordinators_total(mosquitto: MosquittoProcess) -> None:
    # The device's own config says 10 rounds; the coordinator runs 3. The descriptor's total wins: the device
    # reaches a tenth of its rate in round 3, not in round 10.
    mine = fleet(10, name="lrsmqtt")
    theirs = fleet(3, name="lrsmqtt")
    devices = build_fleet(mine)[0]
    assert {d.method.ctx.train_cfg.rounds for d in devices} == {10}
    strat = build_fleet(theirs)[1]
    seen = record_lrs(devices)
    coord, _agents, stop = start_fleet(mine, devices, mosquitto.settings(reconnect_min_s=0.2, reconnect_max_s=1.0),
                                       TransportSettings(global_timeout_s=20))
    assert coord is not None
    try:
        reports = RoundEngine(strat, coord, EngineConfig(fleet=mine.run.fleet, method=mine.run.method)).run()
    finally:
        stop()
    assert len(reports) == 4 and all(len(r.accepted) == 2 for r in reports)
    by_device = {d.info.device_id: [(rnd, total, lr) for dev, rnd, total, lr in seen if dev == d.info.device_id]
                 for d in devices}
    for got in by_device.values():
        assert [(rnd, total) for rnd, total, _lr in got] == [(1, 3), (2, 3), (3, 3)]
        assert [lr for *_x, lr in got] == pytest.approx([0.1, 0.055, 0.01])
        assert not math.isclose(got[-1][2], scheduled_lr(0.1, "cosine", 3, 10))  # not over its own 10
