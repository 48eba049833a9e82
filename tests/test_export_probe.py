"""``fedge profile probe``: measured latencies and accuracy drops, written as a profile the planner reads."""

from __future__ import annotations

from pathlib import Path

import export_helpers  # noqa: F401  (one torch thread, like the other export tests)
import pytest

from fedge.errors import ConfigError
from fedge.export.probe import ProbeResult, detect_hardware, measured_profile, probe, write_measured_profile
from fedge.profiles import list_profiles, load_profile, plan


@pytest.fixture(scope="module")
def measured() -> ProbeResult:
    return probe(tiers=("xs",), quants=("fp32", "int8-static"), runs=5, epochs=1, train_batches=(16,),
                 train_threads=1, train_seconds=0.3)


def test_probe_measures_each_tier_and_level(measured: ProbeResult) -> None:
    assert set(measured.latency_ms) == {"tier-xs/fp32", "tier-xs/int8-static"}
    assert all(0 < ms < 100 for ms in measured.latency_ms.values())
    acc = measured.accuracy["tier-xs"]
    assert acc["fp32"] > 0.5  # one epoch on digits
    assert measured.accuracy_drop == {"int8-static": round(100 * (acc["fp32"] - acc["int8-static"]), 2)}
    assert (measured.dataset, measured.test_images, measured.runs, measured.threads) == ("digits", 450, 5, 1)


def test_written_profile_loads_back_with_its_measurements(measured: ProbeResult, tmp_path: Path) -> None:
    path = write_measured_profile(measured, tmp_path / "m.toml", name="probe-test")
    text = path.read_text()
    assert text.startswith("# Measured by `fedge profile probe`") and "median of 5 batch-1 runs" in text
    prof = load_profile(path)
    assert prof.name == "probe-test" and prof.measured is not None
    assert dict(prof.measured.latency_ms) == measured.latency_ms
    assert dict(prof.measured.accuracy_drop) == measured.accuracy_drop
    # the training rate it timed is what the speed model now uses for that tier and batch
    assert set(measured.train_gmac_s) == {"tier-xs@16"} and measured.train_gmac_s["tier-xs@16"] > 0
    assert dict(prof.measured.train_gmac_s) == measured.train_gmac_s
    from fedge.common.archs import tier_arch
    from fedge.profiles.speed import speed_model

    assert speed_model(prof).mac_rate(tier_arch("xs"), 16) == pytest.approx(measured.train_gmac_s["tier-xs@16"] * 1e9)
    assert prof.hardware.cores == detect_hardware()["cores"]
    base = list_profiles()[0]
    based = measured_profile(measured, base=base)
    assert based.name == f"{base}-measured" and based.hardware == load_profile(base).hardware


def _synthetic(int8_ms: float, drop: float) -> ProbeResult:
    lat = {}
    for tier in ("xs", "s", "m", "l", "xl"):
        lat[f"tier-{tier}/fp32"] = 1.0
        lat[f"tier-{tier}/int8-static"] = int8_ms
    return ProbeResult(lat, {"tier-xs": {"fp32": 0.9, "int8-static": 0.9 - drop / 100}}, "digits", 450, 5, 1,
                       detect_hardware())


@pytest.mark.parametrize(("int8_ms", "drop", "expect"), [
    (0.5, 0.2, "int8-static"),  # faster and within the accuracy bound
    (1.5, 0.2, "fp32"),  # slower: never int8
    (0.5, 3.0, "fp32"),  # faster but loses 3 points
])
def test_planner_chooses_int8_only_where_measured_faster_and_accurate(int8_ms: float, drop: float,
                                                                      expect: str) -> None:
    prof = measured_profile(_synthetic(int8_ms, drop), name="synthetic")
    assert plan(prof).inference_quant == expect


def test_probe_rejects_unknown_levels() -> None:
    with pytest.raises(ConfigError, match=r"unknown tier or quantization \['int4'\]"):
        probe(tiers=("xs",), quants=("int4",))
