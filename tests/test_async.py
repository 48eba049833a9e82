"""Asynchronous buffered aggregation (issue 27, item 2): staleness weights, the version loop, refusals, settings."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fleet_helpers import capture_uploads, tiny_fleet

from fedge.common.asyncmode import AsyncSettings
from fedge.common.messages import Message
from fedge.common.transport import Inbound
from fedge.errors import ConfigError
from fedge.fleet.config import load_fleet, parse_fleet
from fedge.sim.report import build_results
from fedge.sim.simulate import simulate


def test_staleness_weights_are_what_the_functions_say() -> None:
    const = AsyncSettings(staleness_weight="constant")
    assert [const.weight(s) for s in (0, 1, 5, 50)] == [1.0, 1.0, 1.0, 1.0]
    poly = AsyncSettings(staleness_weight="polynomial", staleness_exponent=0.5)  # FedBuff's 1/sqrt(1+s)
    assert [poly.weight(s) for s in (0, 1, 3, 8)] == pytest.approx([1.0, 1 / math.sqrt(2), 0.5, 1 / 3])
    assert AsyncSettings(staleness_exponent=2.0).weight(4) == pytest.approx(1 / 25)  # FedAsync's (1+s)^-a
    hinge = AsyncSettings(staleness_weight="hinge", hinge_a=10, hinge_b=4)  # FedAsync's hinge
    assert [hinge.weight(s) for s in (0, 4, 5, 6)] == pytest.approx([1.0, 1.0, 1 / 11, 1 / 21])


FLEET: dict[str, Any] = {"run": {"method": "fedavg", "rounds": 2}, "devices": [{"profile": "rpi4-4gb", "count": 4}]}


@pytest.mark.parametrize(("table", "method", "message", "fix"), [
    ({"mode": "async", "buffer_size": 0}, "fedavg", "buffer_size = 0: must be an integer >= 1", "buffer_size = K"),
    ({"mode": "async", "buffer_size": 5}, "fedavg", "buffer_size = 5: more than the fleet's 4", "at most 4"),
    ({"mode": "async", "staleness_weight": "exponential"}, "fedavg",
     "staleness_weight = 'exponential': unknown weight function", "'hinge'"),
    ({"mode": "async", "max_staleness": -1}, "fedavg", "max_staleness = -1", "max_staleness"),
    ({"mode": "async", "concurrency": 9}, "fedavg", "concurrency = 9: more than the fleet's 4", "at most 4"),
    ({"mode": "async", "buffer_size": 3, "concurrency": 2}, "fedavg", "buffer_size = 3 > concurrency = 2",
     "buffer_size <= concurrency"),
    ({"mode": "async", "staleness_exponent": "half"}, "fedavg", "'staleness_exponent' = 'half' is not float",
     "exponent"),
    ({"mode": "asynchronous"}, "fedavg", "mode = 'asynchronous': unknown mode", '"async"'),
    ({"buffer_size": 2}, "fedavg", "buffer_size is a setting of asynchronous mode", 'add mode = "async"'),
    ({"mode": "async", "sample": 2}, "fedavg", "sample is for synchronous rounds", "concurrency"),
    ({"mode": "async"}, "local", 'mode = "async" cannot run local: local shares nothing', 'drop mode = "async"'),
])
def test_bad_settings_are_refused_at_load(table: dict, method: str, message: str, fix: str) -> None:
    doc = {**FLEET, "run": {**FLEET["run"], "method": method}, "coordinator": table}
    with pytest.raises(ConfigError) as err:
        parse_fleet(doc, source="fleet.toml")
    assert err.value.message.startswith("fleet.toml: [coordinator]") and message in err.value.message
    assert fix in (err.value.hint or "")


def test_privacy_is_refused_in_async_mode() -> None:
    doc = {**FLEET, "run": {**FLEET["run"], "method": "fedproto"}, "coordinator": {"mode": "async"},
           "privacy": {"noise_multiplier": 1.0}}
    with pytest.raises(ConfigError, match="privacy ledger accounts synchronous rounds") as err:
        parse_fleet(doc, source="fleet.toml")
    assert 'drop mode = "async"' in (err.value.hint or "")


def test_fleet_config_carries_the_async_settings() -> None:
    cfg = parse_fleet({**FLEET, "coordinator": {"mode": "async", "buffer_size": 2, "staleness_weight": "hinge"}})
    assert cfg.asynchronous == AsyncSettings(buffer_size=2, staleness_weight="hinge", fleet_size=4)
    assert cfg.asynchronous.concurrent_devices == 4 and parse_fleet(FLEET).asynchronous is None
    default = parse_fleet({**FLEET, "coordinator": {"mode": "async"}}).asynchronous
    assert default is not None and default.buffer_size == 4  # FedBuff's 10, at most the fleet


@pytest.mark.parametrize("method", ["fedavg", "lgfedavg", "fedproto"])
def test_a_full_buffer_of_fresh_updates_is_a_synchronous_round(method: str) -> None:
    """K = concurrency = N with constant weights: every version is the synchronous round, to the bit."""
    archs = ["tier-xs", "tier-xs", "tier-s"]
    sync = tiny_fleet(method, archs, rounds=3)
    sync.engine.run()
    asyn = tiny_fleet(method, archs, rounds=3,
                      asynchronous=AsyncSettings(buffer_size=3, staleness_weight="constant", fleet_size=3))
    reports = asyn.engine.run()
    assert all(r.staleness == {"d0": 0, "d1": 0, "d2": 0} for r in reports[:-1])
    assert sorted(sync.engine.globals) == sorted(asyn.engine.globals)
    for name, arrays in sync.engine.globals.items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(asyn.engine.globals[name][k], v, err_msg=f"{name}/{k}")


def test_a_version_every_k_updates_stale_ones_weighted_and_too_stale_refused() -> None:
    """Four devices train at once, K = 2: each version takes the two first updates, the other two arrive a
    version late (staleness 1, weight 1/sqrt(2)); with max_staleness = 0 those are refused and counted."""
    a = AsyncSettings(buffer_size=2, max_staleness=1, fleet_size=4)
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 4, rounds=4, asynchronous=a)
    uploads = capture_uploads(fleet.agents)
    reports = fleet.engine.run()
    training = reports[:-1]
    assert [len(r.accepted) for r in training] == [2, 2, 2, 2]
    assert training[0].staleness == {"d0": 0, "d1": 0}
    assert training[1].staleness == {"d2": 1, "d3": 1}  # trained from version 1 (announced for version 1)
    assert all(r.rejected == {} for r in training)
    # the final evaluation refuses what was still on its way (trained after the last version began)
    assert set(reports[-1].rejected) == {"stale"}
    # every update says the version it trained from; each device trained once per task
    for u in uploads:
        assert 1 <= u.msg.round <= 5
    assert len(reports[-1].accepted) == 4  # the final evaluation: every device

    strict = tiny_fleet("fedavg", ["tier-xs"] * 4, rounds=3,
                        asynchronous=AsyncSettings(buffer_size=2, max_staleness=0, fleet_size=4))
    reps = strict.engine.run()
    assert reps[1].rejected == {"stale": 2}
    assert reps[1].rejected_by_device == {"d2": {"stale": 1}, "d3": {"stale": 1}}
    assert all(s == 0 for r in reps for s in r.staleness.values())


def test_replayed_and_unassigned_updates_are_refused_with_their_reason() -> None:
    a = AsyncSettings(buffer_size=1, fleet_size=2, concurrency=2)
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 2, rounds=2, asynchronous=a)
    uploads = capture_uploads(fleet.agents)
    rep = fleet.engine.run_round(1)
    assert rep.accepted == ["d0"]
    first = next(u for u in uploads if u.msg.sender == "d0")
    gate = fleet.engine.gate
    gate.begin_round(2, final=False)
    assert not gate.admit(Inbound(first.data), lambda _: None)  # the same message again
    forged = Message("update", "d0", 1, first.msg.fleet, tensors=first.msg.tensors, info=first.msg.info)
    assert not gate.admit(Inbound(forged.to_bytes()), lambda _: None)  # a new id, but d0's task is done
    by = gate.drain().by_device
    assert by == {"d0": Counter({"replay": 1, "unassigned": 1})}


TWO = """
[run]
method = "{method}"
rounds = {rounds}
dataset = "digits"
seed = 3

[partition]
fraction = 0.2

[train]
lr = 0.05
batch_size = 16
local_epochs = 1

[clock]
{clock}

[coordinator]
mode = "async"
buffer_size = 2
max_staleness = 4

[[devices]]
profile = "rpi-zero-2w"
arch = "tier-xs"

[[devices]]
profile = "rpi4-4gb"
arch = "tier-xs"
count = 2

[[devices]]
profile = "x86-gateway"
arch = "tier-xs"
"""


def _run(tmp_path: Path, name: str, **fmt: object) -> tuple[dict, list[Any]]:
    res = simulate(load_fleet(_write(tmp_path, name, **fmt)))
    return build_results(res), res.reports


def test_a_seeded_async_run_in_process_repeats_exactly_in_virtual_time(tmp_path: Path) -> None:
    churn = 'availability = "onoff"\nonline_mean_s = 0.25\noffline_mean_s = 0.1\njitter = 0.3'
    (one, reports), (two, again) = _run(tmp_path, "a", clock=churn), _run(tmp_path, "b", clock=churn)
    assert [(r.accepted, r.staleness, r.rejected) for r in reports] == [(r.accepted, r.staleness, r.rejected)
                                                                         for r in again]
    for doc in (one, two):  # the host's seconds differ run to run; everything in virtual time repeats
        for r in doc["rounds_log"]:
            del r["seconds"]
    assert one["rounds_log"] == two["rounds_log"] and one["devices"] == two["devices"]
    assert one["clock"] == two["clock"] and one["time_to_accuracy"] == two["time_to_accuracy"]
    training = [r for r in one["rounds_log"] if r["phase"] != "final"]
    assert len(training) == 5 and all(r["accepted"] == 2 for r in training)
    ends = [r["virtual_end_s"] for r in training]
    assert ends == sorted(ends) and ends[0] > 0  # versions follow each other in virtual time
    # the x86 gateway is the fastest: it lands in more versions than the Zero
    assert one["clock"]["lost"]  # the churn did cost updates (a device offline before it finished)
    counts = Counter(d for r in reports[:-1] for d in r.accepted)
    assert counts["x86-gateway-1"] > counts.get("rpi-zero-2w-1", 0)


def test_async_fedproto_keeps_every_devices_latest_prototypes(tmp_path: Path) -> None:
    """A buffer of two holds some classes only; the running aggregate keeps the others from earlier uploads."""
    res = simulate(load_fleet(_write(tmp_path, method="fedproto")))
    counts = [r for r in res.reports if r.phase != "final"]
    assert all(len(r.accepted) == 2 for r in counts)
    # after the last version, the prototypes' counts are those of every device that ever delivered, summed
    delivered = {d for r in counts for d in r.accepted}
    assert len(delivered) >= 3


def _write(tmp_path: Path, name: str = "fleet", **fmt: object) -> Path:
    """TWO as ``name``.toml, with its placeholders (method, rounds, clock) filled in."""
    path = tmp_path / f"{name}.toml"
    path.write_text(TWO.format(**{"method": "fedavg", "rounds": 5, "clock": "", **fmt}))
    return path


def test_an_update_from_another_phase_is_stale_and_its_device_gets_a_new_task() -> None:
    """GeFL's and GeFL-F's stages go by version: work trained in the previous stage cannot be aggregated."""
    from fedge.common.rounds import DeviceInfo
    from fedge.coordinator.config import EngineConfig
    from fedge.coordinator.gate import UpdateGate
    from fedge.coordinator.strategies.local import LocalStrategy

    class TwoPhases(LocalStrategy):
        def phase(self, rnd: int) -> str:
            return "warmup" if rnd <= 2 else "head"

    gate = UpdateGate(TwoPhases(num_classes=10, rounds=5),
                      EngineConfig(method="local", asynchronous=AsyncSettings(buffer_size=1, fleet_size=2)))
    dev = DeviceInfo("d0", "tier-xs", "test")
    gate.register([Inbound(Message("hello", "d0", 0, "default", info={"device": dev.to_dict()}).to_bytes())])
    gate.assigned.update({"d0": 2})
    gate.begin_round(3, final=False)
    update = Message("update", "d0", 2, "default", info={"metrics": {}, "bytes_down": 0, "num_samples": 0})
    assert not gate.admit(Inbound(update.to_bytes()), lambda _: None)
    assert gate.drain().by_device == {"d0": Counter({"stale": 1})} and gate.assigned == {}
    # within one phase, one version old: admitted with its staleness
    gate.assigned.update({"d0": 3})
    gate.begin_round(4, final=False)
    seen: list[int] = []
    fresh = Message("update", "d0", 3, "default", info={"metrics": {}, "bytes_down": 0, "num_samples": 0})
    assert gate.admit(Inbound(fresh.to_bytes()), lambda up: seen.append(up.staleness)) and seen == [1]


def test_a_device_refused_as_stale_gets_its_next_task_at_once_in_virtual_time(tmp_path: Path) -> None:
    """max_staleness = 0: the second Pi 4's update arrives a version late and is refused. Its task is over and its
    work unusable, so it trains again from the moment of the refusal, not once the version being built fills
    (which left it idle for a whole version: 0.106 virtual s of every 0.214 here)."""
    path = _write(tmp_path, rounds=6)
    path.write_text(path.read_text().replace("max_staleness = 4", "max_staleness = 0"))
    res = simulate(load_fleet(path))
    refused = {d for r in res.reports[:-1] for d in r.rejected_by_device}
    assert refused == {"rpi4-4gb-2"}
    assert res.clock is not None
    tasks = [rt.devices["rpi4-4gb-2"] for rt in res.clock.rounds if "rpi4-4gb-2" in rt.devices]
    assert len(tasks) >= 4
    for done, then in itertools.pairwise(tasks):
        assert not then.lost and then.start_s == done.finish_s, (done, then)


def test_a_device_resends_only_to_a_new_coordinator_session_still_listing_its_task() -> None:
    """Within one coordinator process a listed task is an update on its way; a new process (a restart) that still
    lists it never accepted it, so the device sends its cached copy again."""
    from fedge.common.inmemory import async_answer, resend_async

    def descriptor(session: str, tasks: dict[str, int], run: str = "r1") -> dict[str, Any]:
        return {"run": run, "session": session, "round": {"round": 3, "assigned": tasks}}

    answered = async_answer(descriptor("s1", {"d0": 2, "d1": 3}), "d0")
    assert answered == ("r1", "s1", "d0", 2)
    assert not resend_async(answered, descriptor("s1", {"d0": 2}))  # same process: on its way
    assert resend_async(answered, descriptor("s2", {"d0": 2}))  # a restart still lists the task
    assert not resend_async(answered, descriptor("s2", {"d1": 3}))  # accepted before the restart
    assert not resend_async(answered, descriptor("s2", {"d0": 5}))  # a new task: the old one is done
    assert not resend_async(answered, descriptor("s2", {"d0": 2}, run="r2"))  # another run
    assert async_answer(descriptor("s1", {"d1": 3}), "d0") is None  # no task of its own: nothing to resend
    # the same process re-announcing after a reconnection (the broker may have crashed with the update): resend
    recovered = {**descriptor("s1", {"d0": 2}), "recovery": True}
    assert resend_async(answered, recovered)
    assert not resend_async(answered, {**recovered, "round": {"round": 3, "assigned": {"d0": 5}}})  # task done
    assert not resend_async(answered, {**recovered, "run": "r2"})


def test_fedproto_sums_by_version_as_it_would_device_by_device(tmp_path: Path) -> None:
    """The running aggregate kept per version trained from (each group's sum kept until it changes) gives the
    device-by-device staleness-weighted mean; so does a restart from the checkpoint the store writes."""
    from fedge.common.rounds import DeviceInfo
    from fedge.coordinator.accumulators import ClassMean
    from fedge.coordinator.store import EngineState, EngineStore
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.coordinator.strategy import Contribution

    a = AsyncSettings(buffer_size=3, max_staleness=10, fleet_size=8)
    rng = np.random.default_rng(0)
    strat = FedProtoStrategy(num_classes=4, rounds=9)
    strat.asynchronous = a
    latest: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
    for rnd in range(1, 8):
        strat.begin_round(rnd)
        for _ in range(3):  # three uploads per version, some replacing a device's earlier one
            dev, version = f"d{rng.integers(8)}", int(rng.integers(max(1, rnd - 3), rnd + 1))
            protos, counts = rng.normal(size=(4, 5)).astype(np.float32), rng.integers(0, 9, 4)
            strat.accumulate(DeviceInfo(dev, "tier-xs", "p"), {"protos": protos, "counts": counts}, {},
                             Contribution(version=version))
            latest[dev] = (protos, counts, version)
        got = strat.finish_round(rnd)["prototypes"]
        want = ClassMean(4)
        for dev in sorted(latest):
            p, c, v = latest[dev]
            want.add(p, c, a.weight(rnd - v))
        protos, counts = want.result()
        np.testing.assert_allclose(got["protos"], protos, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(got["counts"], counts)
    store = EngineStore(tmp_path)
    store.save(EngineState(completed=7, method="fedproto", fleet="f", strategy=strat.state_dict()), None)
    again = FedProtoStrategy(num_classes=4, rounds=9)
    again.asynchronous = a
    again.load_state_dict(store.load(method="fedproto", fleet="f").strategy)
    for s in (strat, again):
        s.begin_round(8)
    np.testing.assert_array_equal(again.finish_round(8)["prototypes"]["protos"],
                                  strat.finish_round(8)["prototypes"]["protos"])


def test_the_update_log_keeps_whole_records_and_drops_a_torn_one(tmp_path: Path) -> None:
    """Accepted updates are appended to one log per version; a record cut short (the process died while writing
    it: it had not counted) ends the log and is overwritten by the next update; older states' files still load."""
    from fedge.coordinator.store import BUFFER_DIR, EngineStore

    store = EngineStore(tmp_path)
    for i in range(3):
        store.buffer_add(4, i, bytes([i]) * (100 + i))
    store.buffer_sync()
    log = tmp_path / BUFFER_DIR / "4.updates"
    log.write_bytes(log.read_bytes()[:-10])  # the third record torn
    restarted = EngineStore(tmp_path)
    saved, tasks = restarted.buffer_load(4)
    assert saved == [bytes([0]) * 100, bytes([1]) * 101] and tasks is None
    restarted.buffer_add(4, 2, b"again")
    assert restarted.buffer_load(4)[0] == [bytes([0]) * 100, bytes([1]) * 101, b"again"]
    (tmp_path / BUFFER_DIR / "5-000000.update").write_bytes(b"old")  # one file per update, as states before held
    assert restarted.buffer_load(5)[0] == [b"old"]
    restarted.buffer_clear()
    assert not list((tmp_path / BUFFER_DIR).iterdir())


def test_tasks_that_always_outlast_their_devices_online_spells_stop_the_run_with_the_reason(tmp_path: Path) -> None:
    """Devices online for a hundredth of a task's virtual time lose every task: no version could ever be made,
    and the simulation says so (naming the fix) instead of running forever."""
    churn = 'availability = "onoff"\nonline_mean_s = 0.0005\noffline_mean_s = 0.0005'
    with pytest.raises(ConfigError, match=r"tasks in a row were lost.*no version would ever be made") as info:
        _run(tmp_path, "never", clock=churn)
    assert "online_mean_s" in (info.value.hint or "")
