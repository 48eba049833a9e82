"""Partial aggregates without a broker: split a round over aggregators, merge, compare with one coordinator.

Every rule of ``[coordinator] aggregation`` for FedProto (class statistics) and FedAvg over two
architecture groups: the merged state must equal what one strategy accumulating every update gives
(weighted means through float64 sums sent as two float32 halves; robust rules through forwarded rows).
Then partials that are wrong in every way the merger checks are refused, counted by reason under
their sender, and leave the aggregate untouched.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from gate_helpers import CLASSES, FLEET, device, hello, honest_update

from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.transport import Inbound
from fedge.coordinator.accumulators import Aggregation
from fedge.coordinator.config import EngineConfig
from fedge.coordinator.gate import UpdateGate
from fedge.coordinator.merge import PartialMerger
from fedge.coordinator.partial import join64, split64
from fedge.coordinator.strategies.fedavg import FedAvgStrategy, weight_spec
from fedge.coordinator.strategies.fedproto import FedProtoStrategy
from fedge.coordinator.strategy import Strategy
from fedge.scaleout.aggregator import PartialAggregator

RULES = [Aggregation("mean"), Aggregation("trimmed", trim=0.2), Aggregation("median"),
         Aggregation("mean", clip=2.0), Aggregation("trimmed", trim=0.1, clip=1.5)]


def fedavg_update(dev: DeviceInfo, rnd: int) -> bytes:
    rng = np.random.default_rng(rnd * 1000 + int(dev.device_id[1:]))
    arrays = {k: rng.normal(size=shape).astype(np.float32) for k, (shape, _) in weight_spec(dev.arch).items()}
    return Message("update", dev.device_id, rnd, FLEET, tensors=arrays,
                   info={"metrics": {"acc_global": 0.5}, "bytes_down": 10, "num_samples": dev.num_samples}).to_bytes()


def make(method: str, agg: Aggregation) -> tuple[Strategy, EngineConfig]:
    strat: Strategy = (FedProtoStrategy(num_classes=CLASSES, rounds=3) if method == "fedproto"
                       else FedAvgStrategy(num_classes=CLASSES, rounds=3))
    return strat, EngineConfig(fleet=FLEET, method=method, aggregation=agg)


def fleet(method: str, n: int = 12) -> list[DeviceInfo]:
    if method == "fedproto":
        return [device(i) for i in range(n)]
    return [device(i, arch="tier-xs" if i % 3 else "tier-s", feature_dim=0) for i in range(n)]


def update(method: str, dev: DeviceInfo, rnd: int) -> bytes:
    return honest_update(dev, rnd) if method == "fedproto" else fedavg_update(dev, rnd)


def flat_result(method: str, agg: Aggregation, devs: list[DeviceInfo], rnd: int) -> dict[str, Any]:
    strat, cfg = make(method, agg)
    gate = UpdateGate(strat, cfg)
    strat.aggregation = agg
    gate.register([Inbound(hello(d), d.device_id) for d in devs])
    strat.begin_round(rnd)
    gate.begin_round(rnd, final=False)
    for d in devs:
        assert gate.admit(Inbound(update(method, d, rnd), d.device_id),
                          lambda up: strat.accumulate(up.device, up.msg.tensors, up.msg.info))
    return strat.finish_round(rnd)


def root(method: str, agg: Aggregation, devs: list[DeviceInfo], rnd: int) -> tuple[Strategy, PartialMerger]:
    strat, cfg = make(method, agg)
    strat.aggregation = agg
    gate = UpdateGate(strat, cfg)
    gate.register([Inbound(hello(d), d.device_id) for d in devs])
    strat.begin_round(rnd)
    gate.begin_round(rnd, final=False)
    merger = PartialMerger(strat, gate, fleet=FLEET, max_bytes=1 << 26)
    merger.begin_round(rnd, final=False)
    return strat, merger


def worker(method: str, agg: Aggregation, devs: list[DeviceInfo], name: str, rnd: int,
           detail: bool = False) -> PartialAggregator:
    strat, cfg = make(method, agg)
    a = PartialAggregator(strat, cfg, name, detail=detail)
    a.register([Inbound(hello(d), d.device_id) for d in devs])
    a.begin(rnd, final=False, descriptor="d" * 32)
    return a


def assert_same(got: dict[str, Any], want: dict[str, Any], exact: bool) -> None:
    assert got.keys() == want.keys()
    for art in want:
        assert got[art].keys() == want[art].keys()
        for k in want[art]:
            if exact:
                np.testing.assert_array_equal(got[art][k], want[art][k], err_msg=f"{art}/{k}")
            else:
                np.testing.assert_allclose(got[art][k], want[art][k], rtol=2e-7, atol=1e-7, err_msg=f"{art}/{k}")


def test_split64_keeps_float64_to_48_bits() -> None:
    x = np.random.default_rng(0).normal(size=1000) * 1e6
    assert np.max(np.abs(join64(*split64(x)) - x) / np.abs(x)) < 2.0 ** -46


@pytest.mark.parametrize("method", ["fedproto", "fedavg"])
@pytest.mark.parametrize("agg", RULES, ids=lambda a: f"{a.rule}-clip{a.clip}")
def test_two_aggregators_merge_to_the_flat_aggregate(method: str, agg: Aggregation) -> None:
    devs = fleet(method)
    rnd = 2
    want = flat_result(method, agg, devs, rnd)
    strat, merger = root(method, agg, devs, rnd)
    counted: set[str] = set()
    # devices alternate between two workers, and each worker flushes twice within the round
    workers = [worker(method, agg, devs, f"w{k}", rnd) for k in range(2)]
    for half in (devs[: len(devs) // 2], devs[len(devs) // 2:]):
        for i, d in enumerate(half):
            assert workers[i % 2].admit(Inbound(update(method, d, rnd), d.device_id))
        for w in workers:
            data = w.flush()
            assert data is not None
            added = merger.admit(Inbound(data, w.name, kind="partial"), counted, lambda e: None)
            assert added, merger.gate.rejections
            counted.update(added)
    assert counted == {d.device_id for d in devs}
    assert not merger.gate.rejections.by_reason
    # means: float64 sums in another grouping (float addition is not associative) → within 1-2 float32 ulp;
    # robust rules see every row, in another order: the median is exact, trimmed means sum in another order
    assert_same(strat.finish_round(rnd), want, exact=agg.rule == "median" and agg.clip == 0)


def partial_of(method: str, devs: list[DeviceInfo], rnd: int = 1, detail: bool = False,
               name: str = "w0") -> tuple[bytes, Message]:
    w = worker(method, Aggregation(), devs, name, rnd, detail=detail)
    for d in devs:
        assert w.admit(Inbound(update(method, d, rnd), d.device_id))
    msg = Message.from_bytes(w.flush() or b"", max_info_bytes=1 << 22)
    return msg.to_bytes(), msg


@pytest.mark.parametrize(("reason", "edit"), [
    ("partial-shape", lambda m: m.tensors.__setitem__("protos/sums/hi", np.zeros((CLASSES, 3), np.float32))),
    ("partial-nonfinite", lambda m: m.tensors["protos/sums/lo"].__setitem__((0, 0), np.nan)),
    ("partial-weight", lambda m: m.tensors.__setitem__("protos/counts", m.tensors["protos/counts"] * 1000)),
    ("partial-negative", lambda m: m.tensors["protos/counts"].__setitem__(0, -5)),
    ("partial-schema", lambda m: m.tensors.__setitem__("protos/extra", np.zeros(3, np.float32))),
    ("partial-dtype", lambda m: m.tensors.__setitem__("protos/counts", m.tensors["protos/counts"].astype(np.float32))),
    ("partial-unregistered", lambda m: m.info["devices"].__setitem__("stranger", {"up": 1, "info": {}})),
    ("partial-info", lambda m: m.info["devices"]["d0"]["info"].__setitem__("num_samples", 7)),
    # compact partials: ids and a summary instead of entries
    ("partial-unregistered", lambda m: m.info["ids"].append("stranger")),
    ("partial-malformed", lambda m: m.info["ids"].append("d0")),  # listed twice
    ("partial-malformed", lambda m: m.info["ids"].append(["d", 7, 3, 0])),  # a run backwards
    ("partial-malformed", lambda m: m.info["ids"].append(["x", 0, 10 ** 9, 0])),  # a billion devices
    ("partial-summary", lambda m: m.info["summary"].__setitem__("devices", 5)),
    ("partial-summary", lambda m: m.info["summary"].__setitem__("bytes_up", 10 ** 12)),
    ("partial-summary", lambda m: m.info["summary"]["metrics"].__setitem__("acc_global", [0.5, 9])),
    ("partial-summary", lambda m: m.info["summary"].__setitem__("train_s", [1.0, 2e7, 1])),
    ("partial-summary", lambda m: m.info["summary"].__setitem__("extra", 1)),
    ("partial-stale", lambda m: setattr(m, "round", 0)),
    ("partial-kind", lambda m: setattr(m, "kind", "update")),
    ("partial-spoofed", lambda m: setattr(m, "sender", "w1")),
    ("partial-malformed", lambda m: m.info.__setitem__("devices", [1, 2])),
])
def test_a_bad_partial_is_refused_with_its_reason_and_leaves_the_aggregate_alone(reason: str, edit: Any) -> None:
    devs = fleet("fedproto", 4)
    strat, merger = root("fedproto", Aggregation(), devs, 1)
    _, probe = partial_of("fedproto", devs)
    try:
        edit(probe)
        detail = False
    except KeyError:  # an edit of a detailed partial's per-device entries
        detail = True
    _, msg = partial_of("fedproto", devs, detail=detail)
    edit(msg)
    assert merger.admit(Inbound(msg.to_bytes(), "w0", kind="partial"), set(), lambda e: None) == []
    assert dict(merger.gate.rejections.by_device["w0"]) == {reason: 1}
    assert strat.finish_round(1) == {}  # nothing merged
    # and the merger keeps serving: the honest partial is merged afterwards
    good, _ = partial_of("fedproto", devs)
    assert len(merger.admit(Inbound(good, "w0", kind="partial"), set(), lambda e: None)) == 4


def test_overlap_duplicate_oversize_and_foreign_partials_are_refused() -> None:
    devs = fleet("fedproto", 4)
    _, merger = root("fedproto", Aggregation(), devs, 1)
    data, _ = partial_of("fedproto", devs)
    assert len(merger.admit(Inbound(data, "w0", kind="partial"), set(), lambda e: None)) == 4
    assert merger.admit(Inbound(data, "w0", kind="partial"), set(), lambda e: None) == []  # the same message again
    again, _ = partial_of("fedproto", devs[:2])
    assert merger.admit(Inbound(again, "w0", kind="partial"), {"d0", "d1"}, lambda e: None) == []
    merger.max_bytes = 100
    assert merger.admit(Inbound(again, "w0", kind="partial"), set(), lambda e: None) == []
    merger.max_bytes = 1 << 26
    merger.allowed = {"w0": {"d0"}}
    assert merger.admit(Inbound(again, "w0", kind="partial"), set(), lambda e: None) == []
    merger.allowed = {"w9": {"d0"}}
    assert merger.admit(Inbound(again, "w0", kind="partial"), set(), lambda e: None) == []
    assert dict(merger.gate.rejections.by_device["w0"]) == {
        "partial-duplicate": 1, "partial-overlap": 1, "partial-oversize": 1, "partial-foreign": 1,
        "partial-unauthorized": 1}


def test_a_method_that_cannot_be_split_says_so() -> None:
    from fedge.common.method_settings import GeFLSettings
    from fedge.coordinator.strategies.gefl import GeFLStrategy
    from fedge.errors import ConfigError

    strat = GeFLStrategy(GeFLSettings(), num_classes=CLASSES, rounds=300)
    with pytest.raises(ConfigError, match="cannot aggregate in parts"):
        PartialAggregator(strat, EngineConfig(fleet=FLEET, method="gefl"), "w0")


def test_a_sampled_round_is_sampled_at_the_aggregators_and_at_the_parent() -> None:
    """Client sampling (issue 27) with partials: an aggregator refuses an unsampled device's update as the
    coordinator does, and the parent refuses a partial that reports one (``partial-unsampled``)."""
    devs = fleet("fedproto", 4)
    rnd = 1
    agg = Aggregation("mean")
    strat, cfg = make("fedproto", agg)
    a = PartialAggregator(strat, cfg, "w0")
    a.register([Inbound(hello(d), d.device_id) for d in devs])
    descriptor = {"round": rnd, "phase": "train", "sampled": ["d0", "d1"]}
    a.begin(rnd, final=False, descriptor="d" * 32, sampled=a.sampled_of(descriptor))
    assert a.sampled_of({"round": rnd}) is None
    assert a.admit(Inbound(update("fedproto", devs[0], rnd), "d0"))
    assert not a.admit(Inbound(update("fedproto", devs[2], rnd), "d2"))
    assert a.gate.rejections.by_device["d2"] == {"unsampled": 1}
    # a worker that did not know the sample (or lies) reports d3: the parent refuses the whole partial
    _, merger = root("fedproto", agg, devs, rnd)
    merger.gate.begin_round(rnd, final=False, sampled=["d0", "d1"])
    rogue = worker("fedproto", agg, devs, "w1", rnd)
    assert rogue.admit(Inbound(update("fedproto", devs[3], rnd), "d3"))
    data = rogue.flush()
    assert data is not None
    assert merger.admit(Inbound(data, "w1", kind="partial"), set(), lambda e: None) == []
    assert merger.gate.rejections.by_device["w1"] == {"partial-unsampled": 1}


def test_device_ids_pack_into_runs_and_unpack_exactly() -> None:
    from fedge.coordinator.partial import pack_ids, unpack_ids

    ids = ([f"rpi4-4gb-{i}" for i in range(1, 501)] + [f"dev-{i:04d}" for i in range(1200)]
           + ["odd", "x-", "007", "a0", "a00", "a1", "d-3", "d-5"])
    packed = pack_ids(reversed(ids))
    assert ["rpi4-4gb-", 1, 500, 0] in packed and ["dev-", 0, 999, 4] in packed and ["dev-", 1000, 1199, 0] in packed
    assert len(packed) == 10  # 3 runs, the a0-a1 run, and 6 ids in no run (odd, x-, 007, a00, and d-3, d-5: a gap)
    assert sorted(unpack_ids(packed)) == sorted(ids)
    with pytest.raises(Exception, match="more than 10 devices"):
        unpack_ids([["d", 0, 10, 0]], limit=10)


def test_a_compact_partial_weighs_the_same_for_10_or_1000_devices_and_the_root_reports_its_totals() -> None:
    """The per-device entries a partial carried (~100 B each) are gone: the info of a partial over 1000
    devices is as small as over 10, and the root's report still says which devices were counted (accepted),
    by which aggregator (partials), and their bytes, mean metrics and training time (aggregated)."""
    from fedge.coordinator.merge import merged_into
    from fedge.coordinator.report import RoundReport

    sizes = {}
    for n in (10, 1000):
        devs = fleet("fedproto", n)
        _, msg = partial_of("fedproto", devs)
        sizes[n] = len(json.dumps(msg.info))
        _, detailed = partial_of("fedproto", devs, detail=True)
        sizes[-n] = len(json.dumps(detailed.info))
    assert sizes[1000] < sizes[10] + 40, sizes  # one run of ids and one summary either way
    assert sizes[-1000] > 50 * sizes[1000], sizes  # what --detail costs
    devs = fleet("fedproto", 6)
    strat, merger = root("fedproto", Aggregation(), devs, 1)
    want = flat_result("fedproto", Aggregation(), devs, 1)
    report = RoundReport(round=1, phase="train")
    for name, part, detail in (("w0", devs[:4], False), ("w1", devs[4:], True)):
        data, _ = partial_of("fedproto", part, detail=detail, name=name)
        assert merger.admit(Inbound(data, name, kind="partial"), set(report.accepted), merged_into(report, name))
    assert sorted(report.accepted) == sorted(d.device_id for d in devs)
    assert report.partials == {"w0": 4, "w1": 2}
    assert sorted(report.bytes_up) == ["d4", "d5"]  # the detailed partial's devices only
    agg = report.aggregated["w0"]
    assert agg["devices"] == 4 and agg["bytes_up"] == sum(len(update("fedproto", d, 1)) for d in devs[:4])
    up, _ = report.total_bytes()
    assert up == sum(len(update("fedproto", d, 1)) for d in devs)
    assert_same(strat.finish_round(1), want, exact=False)


@pytest.mark.parametrize("method", ["fedproto", "fedavg"])
def test_fp32_sums_halve_the_partial_and_stay_within_float32_rounding(method: str) -> None:
    """``--fp32-sums``: each float64 sum travels as its float32 ``hi`` half only — half the bytes of the sums —
    and the merged aggregate stays within float32 rounding of the flat one; a ``lo`` without its ``hi`` is
    still refused."""
    devs = fleet(method)
    want = flat_result(method, Aggregation(), devs, 1)
    strat, merger = root(method, Aggregation(), devs, 1)
    sizes = {}
    for exact in (True, False):
        strat_w, cfg = make(method, Aggregation())
        w = PartialAggregator(strat_w, cfg, "w0", exact=exact)
        w.register([Inbound(hello(d), d.device_id) for d in devs])
        w.begin(1, final=False, descriptor="d" * 32)
        for d in devs:
            assert w.admit(Inbound(update(method, d, 1), d.device_id))
        data = w.flush()
        assert data is not None
        msg = Message.from_bytes(data, max_info_bytes=1 << 22)
        sizes[exact] = sum(v.nbytes for v in msg.tensors.values())
        if not exact:
            assert not any(k.endswith("/lo") for k in msg.tensors)
            assert merger.admit(Inbound(data, "w0", kind="partial"), set(), lambda e: None)
    assert sizes[False] < 0.55 * sizes[True], sizes
    got = strat.finish_round(1)
    for art in want:
        for k in want[art]:
            np.testing.assert_allclose(got[art][k], want[art][k], rtol=1e-6, atol=1e-7, err_msg=f"{art}/{k}")
    _, msg = partial_of("fedproto", fleet("fedproto", 4), name="w1")
    msg.tensors.pop("protos/sums/hi")
    _, merger2 = root("fedproto", Aggregation(), fleet("fedproto", 4), 1)
    assert merger2.admit(Inbound(msg.to_bytes(), "w1", kind="partial"), set(), lambda e: None) == []
    assert dict(merger2.gate.rejections.by_device["w1"]) == {"partial-schema": 1}


def test_a_merged_device_is_recorded_as_its_own_update_would_be() -> None:
    """A device counted through a partial enters the root's report exactly as its own update would, the seconds it
    trained (``train_s``) included: they were left inside its info, so a run with workers or relays reported no
    device's training time (the clock's replay and `fedge coordinator run`'s slowest device read ``train_s``)."""
    from fedge.coordinator.merge import merged_into
    from fedge.coordinator.report import RoundReport, record_admitted

    devs, rnd, agg = fleet("fedavg", 2), 1, Aggregation("mean")

    def timed(dev: DeviceInfo) -> bytes:
        msg = Message.from_bytes(fedavg_update(dev, rnd))
        return Message("update", dev.device_id, rnd, FLEET, tensors=msg.tensors,
                       info={**msg.info, "train_s": 1.5 + int(dev.device_id[1:])}).to_bytes()

    strat, cfg = make("fedavg", agg)
    gate = UpdateGate(strat, cfg)
    gate.register([Inbound(hello(d), d.device_id) for d in devs])
    strat.begin_round(rnd)
    gate.begin_round(rnd, final=False)
    flat = RoundReport(round=rnd, phase="train")
    for d in devs:
        assert gate.admit(Inbound(timed(d), d.device_id), lambda up: record_admitted(flat, up))
    reports = {}
    for detail in (True, False):  # per-device entries (--detail), and a compact partial's summary
        w = worker("fedavg", agg, devs, "w0", rnd, detail=detail)
        for d in devs:
            assert w.admit(Inbound(timed(d), d.device_id))
        data = w.flush()
        assert data is not None
        _, merger = root("fedavg", agg, devs, rnd)
        reports[detail] = RoundReport(round=rnd, phase="train")
        assert merger.admit(Inbound(data, "w0", kind="partial"), set(), merged_into(reports[detail], "w0")) == [
            "d0", "d1"]
    merged, compact = reports[True], reports[False]
    assert compact.aggregated["w0"]["train_s"] == [4.0, 2.5, 2] and compact.train_s == {}
    assert merged.train_s == flat.train_s == {"d0": 1.5, "d1": 2.5}
    assert merged.info == flat.info and all("train_s" not in i for i in merged.info.values())
    assert (merged.accepted, merged.metrics, merged.bytes_down) == (flat.accepted, flat.metrics, flat.bytes_down)
    assert merged.partials == {"w0": 2}
