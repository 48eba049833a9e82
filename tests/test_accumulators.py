"""Robust aggregation: the rules against hand-computed values, poisoned prototypes through the real
engine, and the [coordinator] table of the fleet config."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from gate_helpers import FLEET, expected_prototypes, honest_arrays, stats_fleet

from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo
from fedge.coordinator.accumulators import (
    Aggregation,
    ClassMean,
    RobustMean,
    WeightedMean,
    robust_combine,
    trimmed_count,
    weighted_median,
    weighted_trimmed_mean,
)
from fedge.coordinator.engine import EngineConfig
from fedge.errors import ConfigError


def test_weighted_median_and_trimmed_mean_by_hand() -> None:
    x = np.array([[1.0], [2.0], [3.0], [100.0]])
    w = np.array([1.0, 1.0, 1.0, 1.0])
    assert weighted_median(x, w)[0] == 2.0  # first value whose cumulative weight reaches half
    assert weighted_median(x, np.array([1.0, 1.0, 5.0, 1.0]))[0] == 3.0
    # trim 0.25 of 4 devices: drop 1 and 100, mean of 2 and 3
    assert weighted_trimmed_mean(x, w, 0.25)[0] == pytest.approx(2.5)
    # trim 0.1 of 4 devices: ceil(0.4) = 1 cut at each end too
    assert weighted_trimmed_mean(x, w, 0.1)[0] == pytest.approx(2.5)
    assert weighted_trimmed_mean(x, w, 0.0)[0] == pytest.approx(26.5)  # no trim: the weighted mean
    # the cut counts devices, not weight: 100 holds 90 % of the weight and is cut all the same; the
    # survivors keep their weights (2 x 1 + 3 x 3) / 4
    heavy = np.array([1.0, 1.0, 3.0, 45.0])
    assert weighted_trimmed_mean(x, heavy, 0.2)[0] == pytest.approx((2 * 1 + 3 * 3) / 4)
    # columns are trimmed independently (3 devices: one cut at each end); with 2 nothing can be cut
    two = np.array([[0.0, 5.0], [10.0, -5.0], [4.0, 1.0]])
    np.testing.assert_allclose(weighted_trimmed_mean(two, np.ones(3), 0.2), [4.0, 1.0])
    assert weighted_trimmed_mean(two[:2], np.ones(2), 0.4)[0] == pytest.approx(5.0)
    assert [trimmed_count(n, 0.2) for n in (1, 2, 3, 5, 8, 10, 11)] == [0, 0, 1, 1, 2, 2, 3]


def test_clipping_pulls_an_outlier_to_the_median_distance() -> None:
    agg = Aggregation("trimmed", trim=0.0, clip=1.0)
    acc = RobustMean(agg)
    for v in ([0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1000.0, 1000.0]):
        acc.add({"w": np.array(v, np.float32)}, 1.0)
    out = acc.result()["w"]
    # median (0, 0); distances 0, 1, 1, 1414 -> median distance 1: the outlier becomes (0.707, 0.707)
    np.testing.assert_allclose(out, [(1 + 0.7071) / 4, (1 + 0.7071) / 4], atol=1e-3)
    plain = WeightedMean()
    plain.add({"w": np.array([1.0, 3.0])}, 1.0)
    plain.add({"w": np.array([3.0, 5.0])}, 3.0)
    np.testing.assert_allclose(plain.result()["w"], [2.5, 4.5])


def test_robust_class_mean_uses_only_devices_with_samples_of_the_class() -> None:
    acc = ClassMean(2, Aggregation("median"))
    acc.add(np.array([[1.0], [50.0]]), np.array([3, 0]))   # no samples of class 1: its row is ignored
    acc.add(np.array([[2.0], [7.0]]), np.array([1, 2]))
    acc.add(np.array([[9.0], [8.0]]), np.array([1, 2]))
    stats, counts = acc.result()
    np.testing.assert_array_equal(counts, [5, 4])
    assert stats[0, 0] == 1.0 and stats[1, 0] == 7.0


@pytest.mark.parametrize("rule", ["median", "trimmed"])
def test_poisoned_prototypes_barely_move_a_robust_aggregate(rule: str) -> None:
    n, bad = 10, 2
    fleet = stats_fleet(n, rounds=1, config=EngineConfig(fleet=FLEET, method="fedproto",
                                                         aggregation=Aggregation(rule, trim=0.25, clip=2.0)))
    honest = fleet.devices[bad:]

    def send(dev: DeviceInfo, rnd: int) -> bytes:
        arrays = honest_arrays(dev, rnd)
        if dev in honest:
            return Message("update", dev.device_id, rnd, FLEET, tensors=arrays).to_bytes()
        arrays["protos"] = arrays["protos"] * -50 + 30  # far away, with all its (valid) counts
        return Message("update", dev.device_id, rnd, FLEET, tensors=arrays).to_bytes()

    fleet.honest = send
    fleet.engine.run_round(1)
    clean, _ = expected_prototypes(honest, 1)
    glob = fleet.engine.globals[PROTOTYPES_ARTIFACT]["protos"]
    # honest prototypes are N(0, 1) per device: a robust estimate of their mean lands within ~1 of it;
    # the plain mean is dragged ~6 away per coordinate
    assert np.abs(glob - clean).mean() < 0.6
    plain = stats_fleet(n, rounds=1)
    plain.honest = send
    plain.engine.run_round(1)
    assert np.abs(plain.engine.globals[PROTOTYPES_ARTIFACT]["protos"] - clean).mean() > 5


def test_aggregation_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="unknown aggregation 'mode'"):
        Aggregation("mode")
    with pytest.raises(ConfigError, match=r"trim must be in \[0, 0.5\)"):
        Aggregation("trimmed", trim=0.5)


def test_the_coordinator_table_is_strict_and_flags_override_it(tmp_path: Path) -> None:
    from fedge.coordinator.fromfleet import coordinator_settings
    from fedge.fleet.config import load_fleet

    path = tmp_path / "fleet.toml"
    path.write_text('[run]\nmethod = "fedproto"\nrounds = 1\n[[devices]]\nprofile = "rpi4-2gb"\n'
                    '[coordinator]\naggregation = "median"\nquorum = 0.9\nclip = 3.0\n')
    cfg = load_fleet(path)
    args = type("Args", (), {k: None for k in ("min_devices", "quorum", "quorum_timeout", "deadline_slack",
                                              "round_timeout", "min_round", "max_round", "max_update_bytes",
                                              "aggregation", "trim", "clip")})()
    section = coordinator_settings(args, cfg.coordinator, cfg.source)
    assert (section.aggregation, section.quorum, section.clip, section.min_devices) == ("median", 0.9, 3.0, None)
    args.quorum, args.aggregation = 0.3, "trimmed"
    section = coordinator_settings(args, cfg.coordinator, cfg.source)
    assert section.aggregation_rule() == Aggregation("trimmed", 0.2, 3.0) and section.quorum == 0.3
    path.write_text(path.read_text() + "quorom = 0.5\n")
    out = subprocess.run([sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(path),
                          "--state-dir", str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "quorom" in out.stderr, out.stderr


@pytest.mark.parametrize("agg", [Aggregation("trimmed", 0.2, 0.0), Aggregation("median", 0.2, 0.0),
                                 Aggregation("trimmed", 0.2, 1.5)])
def test_a_robust_rule_gives_the_same_bits_whatever_order_the_updates_arrive_in(agg: Aggregation) -> None:
    """Over MQTT updates arrive in network order; the trimmed sum of the kept values (and which of two tied
    values a median takes) must not depend on it, or an ulp in round 1 grows into another accuracy by round 3."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 4000)).astype(np.float32)
    rows[3, :100] = rows[1, :100]  # ties between devices of different weight
    counts = np.array([[3, 0, 7], [5, 2, 1], [8, 4, 0], [2, 9, 6], [6, 1, 4]])
    stats = rng.standard_normal((5, 3, 16)).astype(np.float32)
    ref_flat = robust_combine(rows, np.array([1.0, 2.0, 3.0, 4.0, 5.0]), agg)
    ref_class = class_mean_of(stats, counts, agg, range(5))
    for perm in ([4, 3, 2, 1, 0], [1, 2, 4, 3, 0], [2, 0, 4, 1, 3]):
        got = robust_combine(rows[perm], np.array([1.0, 2.0, 3.0, 4.0, 5.0])[perm], agg)
        assert got.tobytes() == ref_flat.tobytes(), perm
        assert class_mean_of(stats, counts, agg, perm).tobytes() == ref_class.tobytes(), perm


def class_mean_of(stats: np.ndarray, counts: np.ndarray, agg: Aggregation, order: Iterable[int]) -> np.ndarray:
    acc = ClassMean(stats.shape[1], agg)
    for i in order:
        acc.add(stats[i], counts[i])
    return acc.result()[0]
