"""What an asynchronous simulation reports (issue 39): the fleet curve measured at fixed moments, busy shares that
mean the same in both modes, the staleness of accepted updates."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

import fedge.profiles
from fedge.cli import main
from fedge.fleet.config import load_fleet
from fedge.sim.clocked_async import AsyncClockedTransport
from fedge.sim.report import build_results, write_results
from fedge.sim.simulate import simulate

# Four profiles, two devices each, tier-xs everywhere (one FedAvg group); label skew; a version of K = 4 updates.
FLEET = """
[run]
method = "{method}"
rounds = {rounds}
dataset = "digits"
seed = 3
eval_every = 1

[partition]
kind = "dirichlet"
alpha = 5.0

[train]
lr = {lr}
lr_schedule = "constant"  # measured at one rate (issue 45's plan anneals it)
batch_size = 16
local_epochs = 2

{coordinator}

[[devices]]
profile = "rpi-zero-2w"
arch = "tier-xs"
count = 2

[[devices]]
profile = "rpi4-4gb"
arch = "tier-xs"
count = 2

[[devices]]
profile = "jetson-nano"
arch = "tier-xs"
count = 2

[[devices]]
profile = "x86-gateway"
arch = "tier-xs"
count = 2
"""
ASYNC = '[coordinator]\nmode = "async"\nbuffer_size = 4\nmax_staleness = 20'


def _write(tmp_path: Path, name: str, *, method: str = "fedavg", rounds: int = 8, coordinator: str = ASYNC,
           lr: float = 0.05) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(FLEET.format(method=method, rounds=rounds, coordinator=coordinator, lr=lr))
    return path


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 8-device asynchronous run, 8 versions, the fleet measured after each.

    At lr 0.06: at 0.05 (and 0.07, 0.1) this fleet's version 7 is itself worse than version 6 for every device
    (82.2 -> 70.9 % at 0.05), which the fleet curve rightly shows. Version 7 averages the Pi 4s' models, trained
    from version 5, with the gateways', trained from version 6: asynchronous FedAvg averages models, not their
    changes, so a stale update brings back some of the older version it started from. The test is about what the
    curve measures, not about that dip (tests/test_async_report.py failed on it from the commit that wrote it,
    222fb86, on this machine; issue 45 pinned the rate, see the report)."""
    return build_results(simulate(load_fleet(_write(tmp_path_factory.mktemp("fleet"), "fleet", lr=0.06))))


@pytest.mark.slow
def test_every_point_of_the_async_curve_covers_the_whole_fleet_at_its_version(fleet_run: dict[str, Any]) -> None:
    curve = fleet_run["time_to_accuracy"]
    training = [r for r in fleet_run["rounds_log"] if r["phase"] != "final"]
    assert len(training) == 8
    # the initial model at 0 s, then one point at each version's publication, in virtual time
    assert [p["after_round"] for p in curve] == list(range(9))
    assert [p["virtual_s"] for p in curve] == [0.0] + [r["virtual_end_s"] for r in training]
    assert all(p["devices"] == 8 for p in curve)
    assert all(p["min_acc_global"] - 1e-9 <= p["mean_acc_global"] <= p["max_acc_global"] + 1e-9 for p in curve)
    # the last point is the final round's evaluation: the same code on the same state
    assert curve[-1]["mean_acc_global"] == pytest.approx(fleet_run["summary"]["mean_final_acc_global"])
    assert curve[-1]["mean_acc_global"] > curve[0]["mean_acc_global"] + 0.3  # it learnt


@pytest.mark.slow
def test_the_async_fleet_curve_has_no_drop_of_more_than_ten_points(fleet_run: dict[str, Any]) -> None:
    """A version's own reports average a different few devices each time (a Zero's, then the gateways'): on this
    fleet that line drops 18 points between two versions. The fleet curve measures every device each time."""
    means = [p["mean_acc_global"] for p in fleet_run["time_to_accuracy"]]
    drops = [a - b for a, b in itertools.pairwise(means)]
    assert max(drops) <= 0.10, means
    # ... where the line of the versions' own reports (each version's reporting devices, at the version each
    # trained from) drops by more on the same run (measured: 2.5 points for the curve, 16.3 for that line)
    devices = fleet_run["devices"]
    line = []
    for i in range(len(devices[0]["acc_global"])):
        seen = [d["acc_global"][i] for d in devices if d["acc_global"][i] is not None]
        line.append(sum(seen) / len(seen))
    assert max(a - b for a, b in itertools.pairwise(line)) > 0.10, line


@pytest.mark.slow
def test_results_hold_the_staleness_of_accepted_updates(fleet_run: dict[str, Any]) -> None:
    a = fleet_run["asynchronous"]
    training = [r for r in fleet_run["rounds_log"] if r["phase"] != "final"]
    accepted = sum(r["accepted"] for r in training)
    assert accepted == 8 * 4 == sum(a["accepted_per_device"].values()) == sum(a["staleness_histogram"].values())
    assert set(a["accepted_per_device"]) == {d["id"] for d in fleet_run["devices"]}
    # the gateways deliver more often than the Zeros
    assert a["accepted_per_device"]["x86-gateway-1"] > a["accepted_per_device"]["rpi-zero-2w-1"]
    # per version (mean, max) and the histogram are the same updates
    total = sum(int(k) * n for k, n in a["staleness_histogram"].items())
    assert sum(r["staleness_mean"] * r["accepted"] for r in training) == pytest.approx(total)
    assert max(r["staleness_max"] for r in training) == a["staleness_max"] == max(map(int, a["staleness_histogram"]))
    assert a["staleness_max"] > 0 and a["staleness_mean"] == pytest.approx(total / accepted)
    assert all(n == 0 for n in a["refused_per_device"].values())  # max_staleness = 20 refuses none here


# A Pi Zero on a link an eighth of LTE-M's and two on LTE-M, half of digits each: the first one's task is mostly
# transfer, and several times the others', so its tasks span several versions of K = 1.
SMALL = """
[run]
method = "fedavg"
rounds = {rounds}
dataset = "digits"
seed = 5
eval_every = {eval_every}

[partition]
fraction = 0.5

[train]
lr = 0.1
batch_size = 16
local_epochs = 2

{coordinator}

[[devices]]
profile = "slow-link.toml"
arch = "tier-xs"

[[devices]]
profile = "rpi-zero-2w"
arch = "tier-xs"
count = 2
"""


def _small(tmp_path: Path, *, mode: str, rounds: int, eval_every: int = 100) -> Path:
    zero = Path(fedge.profiles.__file__).parent / "builtin" / "rpi-zero-2w.toml"
    (tmp_path / "slow-link.toml").write_text(
        zero.read_text().replace('name = "rpi-zero-2w"', 'name = "slow-link"')
        .replace("uplink_kbps = 375", "uplink_kbps = 47").replace("downlink_kbps = 600", "downlink_kbps = 75"))
    coordinator = '[coordinator]\nmode = "async"\nbuffer_size = 1\nmax_staleness = 50' if mode == "async" else ""
    path = tmp_path / f"{mode}.toml"
    path.write_text(SMALL.format(rounds=rounds, eval_every=eval_every, coordinator=coordinator))
    return path


def test_measuring_the_fleet_costs_no_virtual_time_and_changes_nothing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = _small(tmp_path, mode="async", rounds=4, eval_every=1)
    measured = simulate(load_fleet(path))
    monkeypatch.setattr(AsyncClockedTransport, "_measure", lambda self, info: None)
    plain = simulate(load_fleet(path))
    assert measured.clock is not None and plain.clock is not None
    assert [e.after for e in measured.clock.evaluations] == [0, 1, 2, 3, 4] and not plain.clock.evaluations
    assert all(len(e.metrics) == 3 for e in measured.clock.evaluations)
    assert [(r.accepted, r.staleness, r.metrics) for r in measured.reports] == [
        (r.accepted, r.staleness, r.metrics) for r in plain.reports]
    assert [(r.start_s, r.end_s, r.devices) for r in measured.clock.rounds] == [
        (r.start_s, r.end_s, r.devices) for r in plain.clock.rounds]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_device_whose_task_is_mostly_transfer_is_busy_while_it_transfers(small_runs: dict[str, Path],
                                                                            mode: str) -> None:
    """Its transfers count as busy in both modes. Asynchronous, its task starts versions before the one it ends in
    (busy from the task's start, not the version's), and the one under way at the end is busy until then."""
    doc = json.loads((small_runs[mode] / "results.json").read_text())
    slow = doc["devices"][0]
    tasks = [t for t in slow["virtual"] if t is not None]
    assert tasks, "the slow device finished no task"
    transfer = sum(t["download_s"] + t["upload_s"] for t in tasks)
    compute = sum(t["compute_s"] for t in tasks)
    assert transfer > 3 * compute  # transfer-dominated
    total = doc["clock"]["virtual_s"]
    work = sum(t["finish_s"] - t["start_s"] for t in tasks)
    if mode == "sync":  # every round waits for it: its work is the run
        assert slow["busy_share"] * total == pytest.approx(work) == pytest.approx(total)
    else:  # it always has a task: its tasks that ended, and the one under way at the end
        versions = [r for r in doc["rounds_log"] if r["phase"] != "final"]
        first = next(i for i, t in enumerate(slow["virtual"]) if t is not None)
        assert tasks[0]["start_s"] < versions[first]["virtual_start_s"]  # it spans versions
        assert work < total and slow["busy_share"] == pytest.approx(1.0)
    assert slow["busy_share"] > compute / total + 0.5


# -- fedge compare ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The small fleet run synchronously (3 rounds) and asynchronously (16 versions), each in the directory
    `fedge simulate --out` would write."""
    root = tmp_path_factory.mktemp("runs")
    for mode, rounds in (("sync", 3), ("async", 16)):
        res = simulate(load_fleet(_small(root, mode=mode, rounds=rounds, eval_every=1)))
        write_results(build_results(res), root / mode)
    return {mode: root / mode for mode in ("sync", "async")}


@pytest.fixture
def two_runs(small_runs: dict[str, Path]) -> tuple[Path, Path]:
    return small_runs["sync"], small_runs["async"]


def _ratio_from(a: Path, b: Path, target: float | None = None) -> str:
    """Time to the level in A over B's as printed ("-": one never got there), read from the two results.json."""
    curves = [json.loads((d / "results.json").read_text())["time_to_accuracy"] for d in (a, b)]
    level = 0.95 * max(c[-1]["mean_acc_global"] for c in curves) if target is None else target
    ta, tb = (next((p["virtual_s"] for p in c if p["mean_acc_global"] >= level), None) for c in curves)
    return "-" if ta is None or tb is None else f"{ta / tb:.2f}x"


def test_compare_prints_the_ratio_the_two_results_give(two_runs: tuple[Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    sync, asyn = two_runs
    plot = tmp_path / "cmp.png"
    assert main(["compare", str(sync), str(asyn), "--out", str(plot)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ratio A/B: (\S+)", out).group(1) == _ratio_from(sync, asyn)  # type: ignore[union-attr]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for doc in (json.loads((d / "results.json").read_text()) for d in two_runs):  # final accuracies, both shown
        assert f"{100 * doc['time_to_accuracy'][-1]['mean_acc_global']:.1f}" in out
    assert "fedavg / sync" in out and "fedavg / async" in out and "rpi-zero-2w" in out
    # an explicit level, in percent
    level = json.loads((sync / "results.json").read_text())["time_to_accuracy"][-1]["mean_acc_global"] * 0.5
    assert main(["compare", str(asyn), str(sync), "--target", str(100 * level), "--out", str(plot)]) == 0
    printed = re.search(r"ratio A/B: (\S+)", capsys.readouterr().out).group(1)  # type: ignore[union-attr]
    assert printed == _ratio_from(asyn, sync, level) != "-"


def test_compare_refuses_runs_of_two_datasets_and_a_directory_without_results(
        two_runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sync, asyn = two_runs
    other = tmp_path / "other"
    other.mkdir()
    doc = json.loads((asyn / "results.json").read_text())
    (other / "results.json").write_text(json.dumps({**doc, "dataset": "fmnist"}))
    assert main(["compare", str(sync), str(other), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "'digits'" in err and "'fmnist'" in err and "cannot be compared" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty), str(sync), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{empty} has no results.json" in err and "--out directory of a finished run" in err
    assert not (tmp_path / "x.png").exists()
