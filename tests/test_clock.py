"""The virtual clock (issue 27, item 1): the hand computation, deadlines, availability, traces, [clock] settings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedge.common.archs import tier_arch
from fedge.errors import ConfigError
from fedge.fleet.availability import Availability, Intervals, OnOff, parse_trace
from fedge.fleet.clock import DeviceClock, FleetClock, Participation, TrainWork
from fedge.fleet.config import load_fleet, parse_fleet
from fedge.profiles import load_profile
from fedge.profiles.speed import SIZE_CURVE, speed_model
from fedge.sim.report import build_results
from fedge.sim.simulate import simulate

TWO = """
[run]
method = "{method}"
rounds = 2
dataset = "digits"
seed = 1

[partition]
fraction = 0.2

[train]
lr = 0.05
batch_size = 16
local_epochs = 2

{clock}

[[devices]]
profile = "rpi-zero-2w"
arch = "tier-xs"

[[devices]]
profile = "rpi4-4gb"
arch = "tier-xs"
"""


DIGITS_TEST = 450  # scikit-learn's digits: 1,797 images, a quarter held out as the test split


@pytest.mark.parametrize(("method", "statistics_passes"), [("fedavg", 0), ("fedproto", 1)])
def test_two_device_fleet_clock_equals_the_hand_computation(tmp_path: Path, method: str,
                                                             statistics_passes: int) -> None:
    path = tmp_path / "two.toml"
    path.write_text(TWO.format(clock="", method=method))
    res = simulate(load_fleet(path), out_dir=None)
    doc = build_results(res)
    macs = 195_200  # tier-xs forward MACs per sample (fedge.common.archs)
    xs16 = SIZE_CURVE[4]["xs"][1]  # the 4-lane size curve at tier-xs, batch 16 (NEON cores)
    # device -> (cores x GHz x MAC/cycle of its core, uplink kbit/s, downlink kbit/s, RTT ms)
    hw = {"rpi-zero-2w-1": (4 * 1.0 * 0.838, 375, 600, 150), "rpi4-4gb-1": (4 * 1.8 * 1.635, 100_000, 100_000, 5)}
    start = 0.0
    for r in (1, 2):
        finish = {}
        for d in doc["devices"]:
            peak, up, down, rtt = hw[d["id"]]
            samples, i = d["num_train"], r - 1
            # training (3 x forward MACs per sample, 2 epochs), FedProto's pass over the training samples for its
            # prototypes, and the evaluation every round starts with (eval_every = 1): one forward pass over its
            # local test split and the 450 digits test images
            tested = d["num_local_test"] + DIGITS_TEST
            # and the round's fixed costs: 2,200 MAC equivalents per parameter (tier-xs: 5,566) at the same rate
            work = 3 * macs * samples * 2 + macs * samples * statistics_passes + macs * tested + 2200 * 5566
            compute = work / (peak * 1e9 * xs16)
            t_down = rtt / 2000 + d["bytes_down"][i] * 8 / (down * 1000)
            t_up = rtt / 2000 + d["bytes_up"][i] * 8 / (up * 1000)
            v = d["virtual"][i]
            assert v["compute_s"] == pytest.approx(compute, rel=1e-9)
            assert v["download_s"] == pytest.approx(t_down, rel=1e-9)
            assert v["upload_s"] == pytest.approx(t_up, rel=1e-9)
            assert v["start_s"] == pytest.approx(start) and v["delivered"]
            finish[d["id"]] = start + compute + t_down + t_up
        log = doc["rounds_log"][r - 1]
        assert log["virtual_end_s"] == pytest.approx(max(finish.values()), rel=1e-9)  # the slowest participant
        start = log["virtual_end_s"]
    assert doc["clock"]["virtual_s"] == pytest.approx(start)
    # the Zero is the slow one: busy nearly all the time, the Pi 4 mostly idle; shares add up
    zero, pi4 = doc["devices"]
    assert zero["busy_share"] > 0.95 and pi4["busy_share"] < 0.5
    for d in doc["devices"]:
        assert d["busy_share"] + d["idle_share"] + d["offline_share"] == pytest.approx(1.0)
        # a simulated device reports its round's virtual compute seconds as train_s (the final round: none)
        assert d["train_s"][:2] == [round(v["compute_s"], 6) for v in d["virtual"][:2]] and d["train_s"][2] == 0
    tta = doc["time_to_accuracy"]
    assert [p["after_round"] for p in tta] == [0, 1, 2] and tta[-1]["virtual_s"] == pytest.approx(start)
    json.dumps(doc)


def device(index: int = 0, *, avail: Availability | None = None, jitter: float = 0.0) -> DeviceClock:
    p = load_profile("rpi4-4gb")
    return DeviceClock(f"d{index}", index, speed_model(p), p.network, avail or Availability(),
                       TrainWork(tier_arch("m"), 64, 500, 1), jitter=jitter, seed=3)


def test_deadline_and_offline_lose_updates_and_the_round_waits_the_deadline() -> None:
    d0 = device(0)
    one = d0.timing(1, bytes_down=0, bytes_up=0, work=d0.work).total_s
    slow = device(1, avail=Intervals([(0.0, one / 2), (one * 10, math.inf)]))  # goes offline mid-work
    clock = FleetClock([d0, slow], deadline_s=0.0)
    rt = clock.sync_round(1, {"d0": Participation(0, 0, True), "d1": Participation(0, 0, True)})
    assert rt.devices["d0"].delivered and rt.devices["d1"].lost == "offline"
    assert rt.end_s == pytest.approx(one)  # no deadline: the slowest delivered participant
    assert clock.online() == {"d0"}
    # with a deadline shorter than the work: lost to it, and the round lasts the whole deadline
    clock2 = FleetClock([device(0)], deadline_s=one / 3)
    rt2 = clock2.sync_round(1, {"d0": Participation(0, 0, True)})
    assert rt2.devices["d0"].lost == "deadline" and rt2.end_s == pytest.approx(one / 3)
    # nobody online: time moves on to the first return
    clock3 = FleetClock([device(0, avail=Intervals([(50.0, 60.0)]))])
    assert clock3.advance_to_online() == 50.0
    clock3.now = 70.0
    with pytest.raises(ConfigError, match="no device comes online after virtual time 70"):
        clock3.advance_to_online()


def test_jitter_is_seeded_mean_one_and_independent_of_order() -> None:
    d = device(2, jitter=0.2)
    plain = device(2).compute_s(d.work, 1)
    draws = [d.compute_s(d.work, r) / plain for r in range(1, 2001)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.02)
    assert d.compute_s(d.work, 7) == device(2, jitter=0.2).compute_s(d.work, 7)  # a fresh clock, the same value
    assert device(3, jitter=0.2).compute_s(d.work, 7) != d.compute_s(d.work, 7)  # another device, another draw


def test_the_rounds_a_device_evaluates_in_are_on_its_clock() -> None:
    """A round that starts with an evaluation (``eval_every``, the agent's rule) adds one forward pass over the
    device's test images to its compute, at its training rate; other rounds and a final one (no work) do not."""
    p = load_profile("rpi4-4gb")
    spec = tier_arch("m")
    work = TrainWork(spec, 64, 500, 1, eval_samples=300)
    d = DeviceClock("d", 0, speed_model(p), p.network, Availability(), work, eval_every=3)
    train = d.compute_s(work, 1)
    evaluation = spec.macs() * 300 / speed_model(p).mac_rate(spec, 64)
    assert evaluation > 0.1 * train  # large enough to see
    extra = {r: d.train_s(r) - train for r in range(1, 9)}
    # after rounds 3 and 6 (the starts of rounds 4 and 7); not the initial model, as eval_every > 1
    assert [r for r, x in extra.items() if x] == [4, 7]
    assert extra[4] == pytest.approx(evaluation, rel=1e-12)
    assert d.timing(4, bytes_down=0, bytes_up=0, work=work).compute_s == pytest.approx(train + evaluation)
    assert d.timing(4, bytes_down=0, bytes_up=0, work=None).compute_s == 0.0
    # asynchronous mode: the task counter seeds the jitter, the version being built decides the evaluation
    assert d.train_s(5, eval_round=7) == pytest.approx(train + evaluation)
    assert d.timing(4, bytes_down=0, bytes_up=0, work=work, eval_round=5).compute_s == pytest.approx(train)
    every = DeviceClock("d", 0, speed_model(p), p.network, Availability(), work, eval_every=1)
    assert every.train_s(1) == pytest.approx(train + evaluation)  # eval_every = 1: the initial model too
    none = DeviceClock("d", 0, speed_model(p), p.network, Availability(), TrainWork(spec, 64, 500, 1))
    assert none.train_s(1) == pytest.approx(train)  # no test images: nothing to time


def test_intervals_answer_the_three_questions() -> None:
    a = Intervals([(10.0, 20.0), (30.0, 40.0)])
    assert [a.online(t) for t in (0, 10, 19.9, 20, 35, 40)] == [False, True, True, False, True, False]
    assert a.online_until(15) == 20 and a.online_until(25) == 25
    assert a.next_online(0) == 10 and a.next_online(15) == 15 and a.next_online(25) == 30
    assert a.next_online(45) == math.inf
    assert a.online_share(0, 40) == pytest.approx(0.5)


def test_onoff_is_seeded_and_online_its_share_of_the_time() -> None:
    a, b = OnOff(70.0, 30.0, (1, 2)), OnOff(70.0, 30.0, (1, 2))
    ts = [t * 7.3 for t in range(20_000)]
    assert [a.online(t) for t in ts] == [b.online(t) for t in ts]
    assert sum(a.online(t) for t in ts) / len(ts) == pytest.approx(0.7, abs=0.04)
    assert OnOff(70.0, 30.0, (1, 3)).spells[:3] != a.spells[:3]
    always = OnOff(5.0, 0.0, (0,))
    assert always.online(1e9) and always.online_until(0) == math.inf


DEVICES = ["pi-1", "pi-2"]


def test_a_good_trace_parses() -> None:
    t = parse_trace("device,online_from,online_to\npi-1,0,100\npi-2, 50 ,60\n\npi-1,200,300.5\n", DEVICES,
                    source="t.csv")
    assert t["pi-1"].spells == [(0.0, 100.0), (200.0, 300.5)] and t["pi-2"].spells == [(50.0, 60.0)]


@pytest.mark.parametrize(("text", "needle"), [
    ("dev,from,to\npi-1,0,1\n", "t.csv:1: the header must be device,online_from,online_to"),
    ("device,online_from,online_to\npi-1,0\npi-2,0,1\n", "t.csv:2: expected 3 fields"),
    ("device,online_from,online_to\npi-3,0,1\npi-2,0,1\n", "t.csv:2: device 'pi-3' is not in the fleet"),
    ("device,online_from,online_to\npi-1,soon,1\npi-2,0,1\n", "t.csv:2: online_from = 'soon' is not a number"),
    ("device,online_from,online_to\npi-2,0,1\npi-1,nan,1\n", "t.csv:3: online_from = 'nan' must be a finite number"),
    ("device,online_from,online_to\npi-1,-5,1\npi-2,0,1\n", "must be a finite number >= 0"),
    ("device,online_from,online_to\npi-1,5,5\npi-2,0,1\n", "t.csv:2: online_from = 5 is not before online_to = 5"),
    ("device,online_from,online_to\npi-1,0,10\npi-2,0,1\npi-1,5,20\n", "t.csv:4: pi-1's spell from 5 overlaps its "
                                                                         "spell on line 2"),
    ("device,online_from,online_to\npi-1,0,10\n", "t.csv: no line for device(s) pi-2"),
    ("", "t.csv:1: the header must be"),
])
def test_bad_traces_are_refused_naming_the_line(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_trace(text, DEVICES, source="t.csv")
    assert needle in err.value.message and err.value.hint


FLEET = {"run": {"method": "fedavg", "rounds": 1}, "devices": [{"profile": "rpi4-4gb", "count": 2}]}


@pytest.mark.parametrize(("clock", "needle", "fix"), [
    ({"jitter": -0.1}, "[clock] jitter = -0.1: must be between 0 and 3", "σ of the lognormal"),
    ({"availability": "sometimes"}, "[clock] availability = 'sometimes': unknown model", "'onoff'"),
    ({"availability": "trace"}, 'availability = "trace" needs trace = "FILE.csv"', "device,online_from"),
    ({"trace": "t.csv"}, "trace = 't.csv' is set but availability = 'always'", 'availability = "trace"'),
    ({"online_mean_s": 0}, "[clock] online_mean_s = 0: must be a positive number", "mean length"),
    ({"offline_mean_s": -1}, "[clock] offline_mean_s = -1: must be >= 0", "0: never offline"),
    ({"deadline_s": -2}, "[clock] deadline_s = -2: must be >= 0", "0: no deadline"),
    ({"jiter": 0.1}, "unknown key 'jiter'", "jitter"),
])
def test_bad_clock_settings_are_refused_at_load(clock: dict, needle: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fleet({**FLEET, "clock": clock}, source="fleet.toml")
    assert needle in err.value.message and fix in (err.value.hint or err.value.message)


def test_churn_in_process_repeats_exactly_and_offline_devices_do_nothing(tmp_path: Path) -> None:
    """On/off availability with a deadline: devices offline at a round's start are not asked; the same
    seed gives the same virtual times, participants and accuracies."""
    clock = "[clock]\navailability = \"onoff\"\nonline_mean_s = 2.0\noffline_mean_s = 2.0\njitter = 0.1\n"
    path = tmp_path / "churn.toml"
    path.write_text(TWO.format(method="fedavg", clock=clock).replace("rounds = 2", "rounds = 4"))
    runs = [build_results(simulate(load_fleet(path))) for _ in range(2)]
    a, b = runs
    assert [r.get("virtual_end_s") for r in a["rounds_log"]] == [r.get("virtual_end_s") for r in b["rounds_log"]]
    assert [d["acc_global"] for d in a["devices"]] == [d["acc_global"] for d in b["devices"]]
    assert [d["bytes_up"] for d in a["devices"]] == [d["bytes_up"] for d in b["devices"]]  # to the byte
    asked = 0
    for i in range(len(a["rounds_log"]) - 1):
        for d in a["devices"]:
            if d["virtual"][i] is None:  # offline at the round's start: not asked, no work, no bytes
                assert d["bytes_up"][i] == 0 and d["bytes_down"][i] == 0 and d["train_s"][i] is None
            else:
                asked += 1
    assert 0 < asked < 2 * 4  # churn: some device sat some round out
    assert any(d["offline_share"] > 0 for d in a["devices"])
    # an update lost because its device went offline mid-round is missing from that round's report
    for rnd, lost in a["clock"]["lost"].items():
        assert set(lost) <= set(a["rounds_log"][int(rnd) - 1]["missing"])
    assert a["devices"][0]["acc_global"][-1] is not None  # the final evaluation reaches every device


def test_availability_needs_the_in_process_transport(tmp_path: Path) -> None:
    path = tmp_path / "churn.toml"
    path.write_text(TWO.format(method="fedavg", clock='[clock]\navailability = "onoff"\noffline_mean_s = 5.0\n'))
    with pytest.raises(ConfigError, match="availability = 'onoff' needs --transport inprocess"):
        simulate(load_fleet(path), transport="mqtt")  # refused before a broker starts or a model is built


def test_the_clock_example_loads() -> None:
    cfg = load_fleet(Path(__file__).resolve().parent.parent / "examples" / "clock-sampling.toml")
    assert cfg.sampling is not None and cfg.sampling.count == 6 and cfg.sampling.selection == "balanced"
    assert (cfg.clock.availability, cfg.clock.deadline_s) == ("onoff", 2.0)
    assert cfg.clock.online_mean_s / (cfg.clock.online_mean_s + cfg.clock.offline_mean_s) == pytest.approx(0.7)


def test_statistics_passes_are_the_forward_passes_a_method_makes_besides_training() -> None:
    from fedge.fleet.registry import method_entry

    assert method_entry("fedavg").parse({}).statistics_passes(5) == 0
    assert method_entry("fedproto").parse({}).statistics_passes(5) == 1  # its prototypes, after the epochs
    # FedVTC refreshes its prototypes and σ before each decoder epoch: every alternation unless decoder_epochs
    assert method_entry("fedvtc").parse({}).statistics_passes(3) == 3
    assert method_entry("fedvtc").parse({"decoder_epochs": 1}).statistics_passes(3) == 1
