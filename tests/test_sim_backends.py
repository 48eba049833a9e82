"""``[simulation] backend``: devices trained in worker processes or Ray actors give the sequential run's
results bit for bit; a dying worker is its devices' dropout; bad settings are refused (issue 30).

Everything here is real: spawned worker processes, a real SIGKILL, a real local Ray started with
``num_cpus=2``. The Ray tests are skipped, with the reason, only when Ray is not installed
(``pip install 'fedge[ray]'``; CI installs it through ``fedge[all]``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from fedge.cli import main
from fedge.common.method_settings import FedAvgSettings
from fedge.common.rounds import RoundInfo
from fedge.edge.methods.base import Arrays, GlobalEval, model_arrays
from fedge.edge.methods.fedavg import FedAvgDevice
from fedge.edge.training import accuracy
from fedge.errors import ConfigError, FedgeError
from fedge.fleet.config import FleetConfig, parse_fleet
from fedge.fleet.devices import show_global_test
from fedge.fleet.registry import METHODS, MethodEntry, register_method
from fedge.sim.parallel import RoundTiming
from fedge.sim.report import build_results
from fedge.sim.simulate import SimResult, build_fleet, simulate

HAVE_RAY = importlib.util.find_spec("ray") is not None
NO_RAY = "Ray is not installed: pip install 'fedge[ray]' (CI installs it with fedge[all])"

GEN = {"gen_rounds": 1, "gen_epochs": 1, "generator_tier": "tiny"}


def fleet(method: str = "fedavg", *, backend: str = "sequential", workers: int | None = 2, rounds: int = 2,
          method_config: dict[str, Any] | None = None, archs: tuple[str, ...] = ("tier-xs", "tier-s"),
          count: int = 4, eval_every: int = 1, privacy: dict[str, Any] | None = None) -> FleetConfig:
    """A tiny digits fleet: ``count`` devices cycling through ``archs``, one local epoch, 30 % of the data."""
    sim: dict[str, Any] = {"backend": backend, "threads": 1}
    if backend != "sequential" and workers is not None:
        sim["workers"] = workers
    doc: dict[str, Any] = {
        "run": {"method": method, "rounds": rounds, "dataset": "digits", "eval_every": eval_every},
        "partition": {"kind": "dirichlet", "alpha": 1.0, "fraction": 0.3},
        "train": {"local_epochs": 1, "lr": 0.05, "batch_size": 32},
        "method": method_config or {},
        "simulation": sim,
        "devices": [{"profile": "rpi5-8gb", "count": count, "archs": list(archs)}],
    }
    if privacy:
        doc["privacy"] = privacy
    return parse_fleet(doc)


def on(cfg: FleetConfig, backend: str, workers: int = 2) -> FleetConfig:
    import dataclasses

    sim = dataclasses.replace(cfg.simulation, backend=backend, workers=None if backend == "sequential" else workers)
    return dataclasses.replace(cfg, simulation=sim)


def assert_identical(a: SimResult, b: SimResult) -> None:
    """Per device and round: accuracies, bytes up and down; the published global state; the final models."""
    ra, rb = build_results(a), build_results(b)
    for da, db in zip(ra["devices"], rb["devices"], strict=True):
        assert da["id"] == db["id"]
        for key in ("acc_global", "acc_local", "bytes_up", "bytes_down"):
            assert da[key] == db[key], (da["id"], key, da[key], db[key])
        for key in ("acc_local_generic", "acc_global_personal", "personal", "guard", "guard_stem"):
            assert da.get(key) == db.get(key), (da["id"], key)
    assert ra["summary"] == rb["summary"]
    assert a.globals.keys() == b.globals.keys()  # empty for Local, which shares nothing
    for name, arrays in a.globals.items():
        assert arrays.keys() == b.globals[name].keys()
        for k, v in arrays.items():
            assert v.dtype == b.globals[name][k].dtype and v.tobytes() == b.globals[name][k].tobytes(), (name, k)
    for da2, db2 in zip(a.devices, b.devices, strict=True):
        wa, wb = model_arrays(da2.method.ctx.model), model_arrays(db2.method.ctx.model)
        assert all(wa[k].tobytes() == wb[k].tobytes() for k in wa), da2.info.device_id


@pytest.fixture(scope="module")
def sequential_fedavg() -> SimResult:
    torch.set_num_threads(1)
    return simulate(fleet())


# -- identical results -------------------------------------------------------------------------------------

def test_process_workers_give_the_sequential_run_bit_for_bit(sequential_fedavg: SimResult, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Same seed, 1 torch thread per worker: every accuracy, byte count, aggregate and final weight is equal.
    The process run goes through the command line (--backend/--workers) and its results.json."""
    cfg_path = tmp_path / "fleet.toml"
    cfg_path.write_text(
        '[run]\nmethod = "fedavg"\nrounds = 2\ndataset = "digits"\n\n'
        '[partition]\nkind = "dirichlet"\nalpha = 1.0\nfraction = 0.3\n\n'
        '[train]\nlocal_epochs = 1\nlr = 0.05\nbatch_size = 32\n\n[simulation]\nthreads = 1\n\n'
        '[[devices]]\nprofile = "rpi5-8gb"\ncount = 4\narchs = ["tier-xs", "tier-s"]\n')
    out = tmp_path / "run"
    assert main(["simulate", str(cfg_path), "--backend", "process", "--workers", "2", "--out", str(out),
                 "--no-progress"]) == 0
    assert "process backend: 2 workers (peak RSS " in capsys.readouterr().out
    par = json.loads((out / "results.json").read_text())
    seq = build_results(sequential_fedavg)
    for ds, dp in zip(seq["devices"], par["devices"], strict=True):
        for key in ("acc_global", "acc_local", "bytes_up", "bytes_down"):
            assert ds[key] == dp[key], (ds["id"], key)
    sim = par["simulation"]
    assert sim["backend"] == "process" and sim["threads_per_worker"] == 1 and sim["lost"] == {}
    assert len(sim["workers"]) == 2
    assert sorted(d for p in sim["placement"] for d in p) == sorted(d["id"] for d in seq["devices"])
    pids = {w["pid"] for w in sim["workers"]}
    assert os.getpid() not in pids and len(pids) == 2  # the devices trained elsewhere
    assert all(w["peak_rss_bytes"] > 50 * 2**20 for w in sim["workers"])  # torch alone is more than that
    assert len(sim["round_wall_s"]) == 3 and all(o >= 0 for o in sim["round_overhead_s"])
    assert all(len(w) == 2 and all(x > 0 for x in w) for w in sim["round_worker_s"])
    assert sorted(sim["device_s"]) == sorted(sim["device_cpu_s"]) == sorted(d["id"] for d in seq["devices"])
    assert all(c > 0 for c in sim["device_cpu_s"].values())
    assert len(sim["round_driver_s"]) == 3 and all(t > 0 for t in sim["round_driver_s"])
    assert sim["final_placement"] == sim["placement"] or sim["migrations"]
    # the final models the workers shipped back are the sequential run's, byte for byte (checkpoints)
    from fedge.edge.models import load_checkpoint

    for d in sequential_fedavg.devices:
        model = load_checkpoint(out / "checkpoints" / f"{d.info.device_id}.last.safetensors")  # the final model
        want = model_arrays(d.method.ctx.model)
        got = model_arrays(model)
        assert all(want[k].tobytes() == got[k].tobytes() for k in want)


def test_process_backend_keeps_the_aggregates_identical(sequential_fedavg: SimResult) -> None:
    """With three workers (an odd split of four devices): the published global state, the final models."""
    par = simulate(on(fleet(), "process", workers=3))
    assert sorted(par.globals) == ["group-tier-s", "group-tier-xs"]
    assert_identical(sequential_fedavg, par)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "config", "privacy"), [
    ("local", None, None),
    ("lgfedavg", None, None),
    ("fedproto", {"personalize": True, "personal_epochs": 1}, None),
    ("fedproto", {"inference": "prototype"}, {"noise_multiplier": 0.0, "clip": 5.0}),
    ("gefl", {**GEN, "guard": True, "personalize": True, "personal_epochs": 1}, None),
    ("geflf", {**GEN, "warmup_rounds": 1}, None),
    ("fedvtc", {"generator_tier": "tiny", "guard": True}, None),
], ids=["local", "lgfedavg", "fedproto-personal", "fedproto-privacy-clip", "gefl-guard-personal", "geflf",
        "fedvtc-guard"])
def test_every_method_is_identical_in_worker_processes(method: str, config: dict[str, Any] | None,
                                                       privacy: dict[str, Any] | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each method (with the guard, personalisation, [privacy] clipping) gives the same bytes with 2 workers,
    a device moved to the other worker mid-run (its whole state shipped) included."""
    torch.set_num_threads(1)
    archs = ("cnn1-p32", "cnn2-p32") if method in ("gefl", "geflf", "fedvtc") else ("tier-xs", "tier-s")
    # a phase of two rounds at least (GeFL-F: warm-up, generator, then two head rounds), so a move happens
    rounds = {"gefl": 3, "geflf": 4}.get(method, 2)
    cfg = fleet(method, method_config=config, archs=archs, count=3, rounds=rounds, privacy=privacy)
    monkeypatch.setattr("fedge.sim.parallel.rebalance", move_first_device)
    par = simulate(on(cfg, "process"))
    assert build_results(par)["simulation"]["migrations"], "no round was followed by one of its own phase"
    assert_identical(simulate(cfg), par)


def move_first_device(costs: dict[int, float], placement: list[list[int]], live: list[int],
                      **_: Any) -> list[list[int]]:
    """A rebalance that always moves worker 0's first device to worker 1, whatever was measured."""
    new = [list(p) for p in placement]
    new[1].append(new[0].pop(0))
    return [sorted(p) for p in new]


def test_privacy_noise_works_in_workers() -> None:
    """[privacy] with noise: the devices add fresh OS-entropy noise (never reproducible, on purpose), and the
    coordinator still accounts ε — so the parallel run is checked for the accounting, not for bytes."""
    torch.set_num_threads(1)
    cfg = fleet("fedproto", backend="process", count=3, privacy={"noise_multiplier": 1.0, "clip": 5.0})
    res = build_results(simulate(cfg))
    assert res["privacy"]["training_rounds_released"] == 2 and res["privacy"]["epsilon"] > 0
    assert all(r["accepted"] == 3 for r in res["rounds_log"])


# -- evaluation once per distinct model ---------------------------------------------------------------------

def test_each_distinct_model_is_evaluated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four FedAvg devices of one architecture hold one model from round 1 on: one pass over the global
    test set per evaluation, not four — and the figures are those of four separate passes."""
    torch.set_num_threads(1)
    cfg = fleet(archs=("tier-xs",), rounds=2)
    res = simulate(cfg)
    w = build_results(res)["simulation"]["workers"][0]
    # 3 evaluations (initial model, after round 1, final); FedAvg's shared start makes even the initial
    # models equal: one pass each, the other three devices read it
    assert (w["global_eval_passes"], w["global_eval_hits"]) == (3, 9)
    accs = [d["acc_global"] for d in build_results(res)["devices"]]
    assert all(a == accs[0] for a in accs)

    calls = []

    def uncached(self: GlobalEval, model: Any, compute: Any, **kw: Any) -> float:
        calls.append(1)
        return float(compute())

    monkeypatch.setattr(GlobalEval, "accuracy", uncached)
    plain = simulate(cfg)
    assert len(calls) == 12  # every device, every evaluation
    assert [d["acc_global"] for d in build_results(plain)["devices"]] == accs


def test_a_slice_of_the_test_set_shown_to_the_fleet_is_still_scored_once_per_model() -> None:
    """A benchmark that scores the devices on the first images only (show_global_test) keeps the shared cache:
    four devices holding one model pass over the slice once, with the figure of a pass of their own. Replacing
    ``global_test`` alone bypassed it (the fleet's GlobalEval answers only for the whole test set), and the
    asynchronous benchmark's fleet curve paid a pass per device at every point."""
    torch.set_num_threads(1)
    devices, _ = build_fleet(fleet(archs=("tier-xs",), rounds=1))
    whole = devices[0].method.ctx.global_eval
    assert whole is not None
    shown = whole.test.subset(np.arange(100))
    show_global_test(devices, shown)
    state = devices[0].method.ctx.model.state_dict()
    for d in devices[1:]:  # one model on every device, as FedAvg's group holds after a round
        d.method.ctx.model.load_state_dict(state)
    accs = [d.method.evaluate()["acc_global"] for d in devices]
    shared = devices[0].method.ctx.global_eval
    assert shared is not None and shared is not whole and shared.test is shown
    assert all(d.method.ctx.global_eval is shared and d.method.ctx.global_test is shown for d in devices)
    assert (shared.passes, shared.hits, whole.passes) == (1, 3, 0)
    model = devices[2].method.ctx.model
    assert accs == [accuracy(model, shown.x, shown.y)] * 4


@pytest.mark.parametrize(("every", "rounds", "evaluated"), [
    (1, 3, [0, 1, 2, 3]),  # every round, the initial model included
    (2, 3, [2, 3]),  # after round 2, and the final model
    (3, 3, [3]),  # eval_every = rounds: the final model only — round 1 no longer evaluates it
])
def test_eval_every_is_honoured_in_round_one(every: int, rounds: int, evaluated: list[int]) -> None:
    torch.set_num_threads(1)
    res = build_results(simulate(fleet(rounds=rounds, eval_every=every, count=2)))
    for d in res["devices"]:
        assert [r for r, a in enumerate(d["acc_global"]) if a is not None] == evaluated


# -- a worker that dies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DyingSettings(FedAvgSettings):
    """FedAvg whose device ``dies_as`` kills its own process in round ``dies_in``."""

    method: ClassVar[str] = "fedavg-dies"


class DyingFedAvgDevice(FedAvgDevice):
    """FedAvg, but the second device's process is SIGKILLed in the middle of round 2 (after training)."""

    settings_type = DyingSettings

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        out = super().train_round(info)
        if info.round == 2 and self.ctx.device_id.endswith("-2"):
            os.kill(os.getpid(), signal.SIGKILL)  # a real death: no exception, no goodbye
        return out


@pytest.fixture
def dying_method() -> Iterator[str]:
    name = DyingSettings.method
    if name not in METHODS:
        register_method(MethodEntry(DyingSettings, f"{__name__}:DyingFedAvgDevice",
                                    "fedge.coordinator.strategies.fedavg:FedAvgStrategy"))
    yield name


def _check_dropout(res: SimResult, worker_devices: list[str], everyone: list[str]) -> None:
    out = build_results(res)
    lost = out["simulation"]["lost"]
    assert sorted(lost) == sorted(worker_devices)
    assert all(v.startswith("round 2: worker") and "died" in v for v in lost.values()), lost
    rounds = {r["round"]: r for r in out["rounds_log"]}
    assert rounds[1]["accepted"] == len(everyone) and rounds[1]["missing"] == []
    for r in (2, 3):  # the round it died in, and the final one
        assert sorted(rounds[r]["missing"]) == sorted(worker_devices)
        assert rounds[r]["accepted"] == len(everyone) - len(worker_devices)
    for d in out["devices"]:
        if d["id"] in worker_devices:
            assert d["lost"] == lost[d["id"]]
            assert d["acc_global"][0] is not None and d["acc_global"][1:] == [None, None]  # what it sent before
        else:
            assert "lost" not in d and all(a is not None for a in d["acc_global"])


def test_a_killed_worker_process_is_its_devices_dropout(dying_method: str) -> None:
    """SIGKILL inside round 2: the run finishes, that worker's devices are missing from round 2 on."""
    torch.set_num_threads(1)
    cfg = fleet(dying_method, backend="process", archs=("tier-xs",), count=4)
    res = simulate(cfg)
    placement = build_results(res)["simulation"]["final_placement"]  # where the devices were when it died
    victim = next(p for p in placement if any(d.endswith("-2") for d in p))
    _check_dropout(res, victim, [d for p in placement for d in p])
    assert all("killed by signal 9" in v for v in build_results(res)["simulation"]["lost"].values())
    assert len(res.devices) == 4 - len(victim) and len(res.lost) == len(victim)


@dataclass(frozen=True)
class BrokenSettings(FedAvgSettings):
    method: ClassVar[str] = "fedavg-broken"


def test_a_worker_that_cannot_build_its_devices_fails_the_run() -> None:
    """An error in a worker (here: a device half that does not import) is the run's error, with the worker's
    traceback — not a silent dropout of every device."""
    if BrokenSettings.method not in METHODS:
        register_method(MethodEntry(BrokenSettings, "fedge.edge.methods.nowhere:Device",
                                    "fedge.coordinator.strategies.fedavg:FedAvgStrategy"))
    with pytest.raises(FedgeError) as exc:
        simulate(fleet(BrokenSettings.method, backend="process", count=2))
    assert "failed: ModuleNotFoundError: No module named 'fedge.edge.methods.nowhere'" in exc.value.message


# -- bad settings --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("table", "needles"), [
    ({"backend": "threads"}, ["[simulation]", "backend = 'threads' is not a simulation backend",
                              "'sequential', 'process', 'ray'"]),
    ({"backend": "process", "workers": 0}, ["[simulation]", "workers = 0", "set workers = 2"]),
    ({"backend": "process", "num_gpus": 0.5}, ["num_gpus applies to the ray backend", 'set backend = "ray"']),
    ({"backend": "ray", "num_gpus": -1.0}, ["num_gpus = -1.0 must be >= 0"]),
    ({"backend": "ray", "num_cpus": 0}, ["num_cpus = 0"]),
    ({"threads": 0}, ["threads = 0"]),
    ({"workers": "two"}, ["'workers' = 'two' is not"]),
    ({"backnd": "ray"}, ["unknown key 'backnd'", "did you mean 'backend'"]),
])
def test_bad_simulation_settings_are_refused(table: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_fleet({"run": {"method": "fedavg", "rounds": 1}, "simulation": table,
                     "devices": [{"profile": "rpi5-8gb"}]}, source="fleet.toml")
    text = f"{exc.value.message} {exc.value.hint}"
    assert all(n in text for n in needles), text


def test_bad_workers_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "fleet.toml"
    cfg.write_text('[run]\nmethod = "fedavg"\nrounds = 1\n\n[[devices]]\nprofile = "rpi5-8gb"\n')
    assert main(["simulate", str(cfg), "--backend", "process", "--workers", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "[simulation] (command line) workers = 0" in err and "set workers = 2" in err


def test_mqtt_transport_stays_sequential() -> None:
    with pytest.raises(ConfigError) as exc:
        simulate(fleet(backend="process"), transport="mqtt")
    assert "already runs every device concurrently" in exc.value.message
    assert 'backend = "sequential"' in (exc.value.hint or "")


@pytest.mark.parametrize("clock, needle", [({"availability": "onoff", "offline_mean_s": 60.0},
                                             "[clock] availability = 'onoff'"),
                                            ({"deadline_s": 5.0}, "[clock] deadline_s = 5")])
def test_a_clock_that_decides_who_delivers_stays_sequential(clock: dict[str, Any], needle: str) -> None:
    """Availability and a virtual deadline drop updates device by device in the sequential in-process run;
    a parallel backend is refused before any work, naming the key."""
    import dataclasses

    from fedge.fleet.sim_sections import ClockSection

    cfg = dataclasses.replace(fleet(backend="process"), clock=ClockSection(**clock))
    with pytest.raises(ConfigError) as exc:
        simulate(cfg)
    assert needle in exc.value.message and "backend = 'process' trains in workers" in exc.value.message
    assert 'use backend = "sequential"' in (exc.value.hint or "")


def test_ray_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``import ray`` failing (as when the extra is not installed) is an error naming fedge[ray], exit code 8."""
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    cfg = tmp_path / "fleet.toml"
    cfg.write_text('[run]\nmethod = "fedavg"\nrounds = 1\ndataset = "digits"\n\n[[devices]]\nprofile = "rpi5-8gb"\n')
    assert main(["simulate", str(cfg), "--backend", "ray", "--no-progress"]) == 8
    err = capsys.readouterr().err
    assert "pip install 'fedge[ray]'" in err


def test_rebalance_moves_the_fewest_devices_for_a_real_gain() -> None:
    from fedge.sim.parallel import rebalance

    # worker 0 took 1 s, worker 1 took 5 s: placed again by the seconds (3 s each), and of the placements
    # that give it the one that moves one device, not three
    costs = {0: 1.0, 1: 2.0, 2: 1.5, 3: 1.5}
    assert rebalance(costs, [[0], [1, 2, 3]], [0, 1]) == [[0, 1], [2, 3]]
    # already within 10 % of the best placement: nothing moves
    assert rebalance({0: 1.0, 1: 1.05, 2: 1.0, 3: 1.0}, [[0, 1], [2, 3]], [0, 1]) is None
    # a lost worker's devices stay where they were (lost); the live ones share the rest
    assert rebalance({0: 3.0, 1: 1.0, 2: 1.0, 4: 1.0}, [[0, 1, 2], [3], [4]], [0, 2]) == [[1, 2, 4], [3], [0]]


def test_a_misplaced_fleet_is_rebalanced_by_measured_seconds(sequential_fedavg: SimResult,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An estimate that is badly off (device 1 as costly as the rest together) puts one device on worker 0
    and three on worker 1; after round 1 the driver places them again by the seconds each took, moves
    devices with their whole state, and every figure still equals the sequential run's. The seconds are
    injected (one CPU second per device): what the machine measures under load decides nothing here."""
    monkeypatch.setattr("fedge.sim.parallel.estimated_cost", lambda cfg, slot: 100.0 if slot.index == 0 else 1.0)
    measured: list[dict[str, float | None]] = []

    def one_second_each(timing: RoundTiming) -> dict[str, float | None]:
        measured.append(dict(timing.device_cpu_s))
        return dict.fromkeys(timing.device_cpu_s, 1.0)

    monkeypatch.setattr("fedge.sim.parallel.measured_costs", one_second_each)
    par = simulate(on(fleet(), "process"))
    sim = build_results(par)["simulation"]
    ids = [d.info.device_id for d in sequential_fedavg.devices]
    assert sim["placement"] == [ids[:1], ids[1:]]
    (m,) = sim["migrations"]  # once for the training phase, before round 2
    assert m["before_round"] == 2 and m["moved"] and m["bytes"] > 0
    # three devices of one second on worker 1 before, two per worker after
    assert (m["busiest_worker_cpu_s"], m["predicted_cpu_s"]) == (3.0, 2.0)
    assert len(measured) == 1 and sorted(measured[0]) == sorted(ids)  # the workers measured every device
    assert sorted(len(p) for p in sim["final_placement"]) == [2, 2]
    assert_identical(sequential_fedavg, par)


def test_placement_balances_the_estimated_work() -> None:
    from fedge.sim.parallel import place

    # the longest job first, each to the least-loaded worker; each worker's devices in fleet order
    assert place([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [[0], [1, 2, 3, 4, 5]]
    assert place([3.0, 3.0, 2.0, 2.0, 2.0], 2) == [[0, 2, 4], [1, 3]]
    assert place([1.0], 4) == [[0]]  # never an empty worker


# -- Ray --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    if not HAVE_RAY:
        pytest.skip(NO_RAY)
    import ray

    # the workers must import this module (its dying method), as a local Ray fedge starts arranges itself
    path = os.pathsep.join(p for p in sys.path if p)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield ray
    finally:
        ray.shutdown()


def test_ray_actors_give_the_sequential_run_bit_for_bit(ray_cluster: Any, sequential_fedavg: SimResult) -> None:
    res = simulate(on(fleet(), "ray"))
    assert_identical(sequential_fedavg, res)
    sim = build_results(res)["simulation"]
    assert sim["backend"] == "ray" and len(sim["workers"]) == 2
    assert sim["ray"]["started_here"] is False and sim["ray"]["cluster"]["CPU"] == 2.0
    assert all(w["peak_rss_bytes"] > 50 * 2**20 and w["pid"] != os.getpid() for w in sim["workers"])
    assert sim["ray"]["init_s"] >= 0 and sim["mean_round_overhead_s"] is not None


def test_ray_actors_move_devices_bit_for_bit(ray_cluster: Any, sequential_fedavg: SimResult,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A device moved between actors (its state through Ray's object store) trains on unchanged."""
    monkeypatch.setattr("fedge.sim.parallel.rebalance", move_first_device)
    res = simulate(on(fleet(), "ray"))
    assert build_results(res)["simulation"]["migrations"]
    assert_identical(sequential_fedavg, res)


def test_a_dead_ray_actor_is_its_devices_dropout(ray_cluster: Any, dying_method: str) -> None:
    torch.set_num_threads(1)
    res = simulate(on(fleet(dying_method, archs=("tier-xs",), count=4), "ray"))
    placement = build_results(res)["simulation"]["final_placement"]  # where the devices were when it died
    victim = next(p for p in placement if any(d.endswith("-2") for d in p))
    _check_dropout(res, victim, [d for p in placement for d in p])


def test_ray_refuses_what_the_cluster_cannot_host(ray_cluster: Any) -> None:
    import dataclasses

    cfg = fleet(backend="ray")
    gpu = dataclasses.replace(cfg, simulation=dataclasses.replace(cfg.simulation, num_gpus=0.5))
    with pytest.raises(ConfigError) as exc:
        simulate(gpu)
    assert "num_gpus = 0.5, but the Ray cluster has no GPU" in exc.value.message
    assert "set num_gpus = 0" in (exc.value.hint or "")
    many = dataclasses.replace(cfg, simulation=dataclasses.replace(cfg.simulation, workers=3))
    with pytest.raises(ConfigError) as exc:
        simulate(many)
    assert "workers = 3" in exc.value.message and "set workers = 2 or less" in (exc.value.hint or "")
    assert ray_cluster.is_initialized()  # a Ray this process started before is left running

