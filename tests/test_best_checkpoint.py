"""The model a device ships is its best one (issue 45): a validation fold held out of the training share chooses
it, `fedge export` ships it (`--last`: the last one), the manifest names its round, and a device over MQTT keeps
it in its state directory across a restart."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.best import BestRecord
from fedge.edge.cli import _keep_best
from fedge.edge.data.partition import iid_fraction, local_splits
from fedge.edge.models.checkpoint import load_checkpoint, read_checkpoint_meta
from fedge.edge.training import predict
from fedge.export.exporter import ExportOptions
from fedge.export.fleet import export_run
from fedge.fleet.config import FleetConfig, load_fleet
from fedge.fleet.devices import SimDevice, load_fleet_data
from fedge.fleet.slots import fleet_splits, train_labels
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.settings import TransportSettings
from fedge.runtime import EdgeModel
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.report import build_results, write_results
from fedge.sim.simulate import SimResult, build_fleet, run_rounds, save_device_checkpoints

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 3

FLEET = """
[run]
method = "fedavg"
rounds = {rounds}
dataset = "digits"
fleet = "{fleet}"
seed = 3

[partition]
kind = "iid"

[train]
lr = 0.1
local_epochs = 3
batch_size = 32

[[devices]]
profile = "rpi4-2gb"
count = 2
arch = "tier-xs"
"""


def fleet(tmp: Path, name: str = "best", rounds: int = ROUNDS) -> FleetConfig:
    path = tmp / f"{name}.toml"
    path.write_text(FLEET.format(rounds=rounds, fleet=name))
    return load_fleet(path)


def sabotage(devices: list[SimDevice], rounds: set[int]) -> None:
    """In ``rounds`` every device uploads zeros for its model: the global model after them predicts one class."""
    for d in devices:
        train = d.method.train_round

        def zeroed(info: Any, train: Any = train) -> Any:
            arrays, extra = train(info)
            if info.round in rounds:
                arrays = {k: np.zeros_like(v) for k, v in arrays.items()}
            return arrays, extra

        d.method.train_round = zeroed  # type: ignore[method-assign]


def test_validation_fold_is_held_out_of_training_and_never_overlaps_a_test_split() -> None:
    cfg = load_fleet(REPO / "benchmarks" / "fleets" / "six-fedproto-defaults.toml")
    assert cfg.train.val_fraction == 0.1  # the default
    labels = train_labels(cfg)
    splits = fleet_splits(cfg, labels)
    assert len(splits) == 6
    seen: set[int] = set()
    for s in splits:
        train, test, val = set(s.train.tolist()), set(s.test.tolist()), set(s.val.tolist())
        assert not val & test and not val & train and not train & test
        assert len(val) == max(1, round((len(train) + len(val)) * 0.1))
        assert not (train | test | val) & seen  # shares are disjoint across devices too
        seen |= train | test | val
    # The global test set is another file (digits' held-out split), never indexed by a share: the fold comes
    # from the training set only. And a fold of 0 leaves the published protocols' shares untouched.
    protocol = load_fleet(REPO / "examples" / "gefl-protocol-fedavg.toml")
    assert protocol.train.val_fraction == 0.0 and protocol.train.min_tail == 1 and protocol.train.lr == 0.1
    assert protocol.train.lr_schedule == "constant"
    plabels = train_labels(protocol)
    plain = fleet_splits(protocol, plabels)
    assert all(len(s.val) == 0 for s in plain)
    parts = iid_fraction(plabels, protocol.num_devices, protocol.partition.fraction, protocol.run.seed)
    again = local_splits(parts, protocol.partition.local_test_fraction, protocol.run.seed)
    assert all(np.array_equal(a.train, b.train) for a, b in zip(plain, again, strict=True))


def test_export_ships_the_best_round_when_the_last_one_was_worse(tmp_path: Path) -> None:
    cfg = fleet(tmp_path)
    devices, strat = build_fleet(cfg)
    sabotage(devices, {ROUNDS})  # the last training round's global model predicts one class
    agents, reports = run_rounds(cfg, devices, strat)
    run = tmp_path / "run"
    save_device_checkpoints(cfg, devices, reports, run / "checkpoints")
    write_results(build_results(SimResult(cfg, devices, agents, reports, 0.0)), run)
    results = json.loads((run / "results.json").read_text())
    final = ROUNDS + 1  # the final round only evaluates
    for dev in results["devices"]:
        val = dev["acc_val"]
        assert len(val) == final and val[-1] is not None
        best_round = 1 + max(range(final), key=lambda i: (val[i], i))  # a tie goes to the later round
        assert dev["shipped"]["round"] == best_round < final
        assert dev["shipped"]["acc_val"] == val[best_round - 1] > val[-1] + 0.1  # the sabotage is no near thing
        assert dev["shipped"]["acc_global"] == dev["acc_global"][best_round - 1] > dev["final_acc_global"] + 0.1
    out = tmp_path / "export"
    opts = ExportOptions(latency_runs=3)
    manifests = export_run(run, out, test_samples=300, quant="fp32", options=opts)
    x = load_fleet_data(cfg).test.x[:300]
    for dev in results["devices"]:
        m = manifests[dev["id"]]
        origin = m.extra["checkpoint"]
        assert origin["choice"] == "best" and origin["round"] == dev["shipped"]["round"]
        assert origin["acc_val"] == dev["shipped"]["acc_val"] and origin["acc_global"] == dev["shipped"]["acc_global"]
        assert origin["last"] == {"round": final, "acc_val": dev["acc_val"][-1], "acc_global": dev["final_acc_global"]}
        written = json.loads((out / dev["id"] / "manifest.json").read_text())
        assert written["checkpoint"] == origin
        # What ships predicts as the best round's model did, not as the last one does.
        best = load_checkpoint(run / "checkpoints" / f"{dev['id']}.safetensors")
        last = load_checkpoint(run / "checkpoints" / f"{dev['id']}.last.safetensors")
        shipped = EdgeModel.load(out / dev["id"]).predict(x, preprocessed=True).labels
        assert (shipped == predict(best, x)).mean() > 0.99
        assert (shipped == predict(last, x)).mean() < 0.5
    index = json.loads((out / "index.json").read_text())
    assert [d["checkpoint"]["round"] for d in index["devices"]] == [d["shipped"]["round"] for d in results["devices"]]
    # --last ships the last round's model, and says so.
    m_last = export_run(run, tmp_path / "export-last", test_samples=300, quant="fp32", options=opts, last=True)
    for dev in results["devices"]:
        assert m_last[dev["id"]].extra["checkpoint"]["choice"] == "last"
        assert m_last[dev["id"]].extra["checkpoint"]["round"] == final


def _run_over_mqtt(cfg: FleetConfig, devices: list[SimDevice], broker: MosquittoProcess) -> None:
    strat = build_fleet(cfg)[1]
    coord, _agents, stop = start_fleet(cfg, devices, broker.settings(reconnect_min_s=0.2, reconnect_max_s=1.0),
                                       TransportSettings(global_timeout_s=20))
    assert coord is not None
    try:
        reports = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method)).run()
    finally:
        stop()
    assert len(reports) == cfg.run.rounds + 1 and all(len(r.accepted) == 2 for r in reports)


def test_a_device_over_mqtt_keeps_its_best_model_across_a_restart(tmp_path: Path, mosquitto: MosquittoProcess,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = fleet(tmp_path, "bestmqtt")
    state = {i: tmp_path / f"state-{i}" for i in range(2)}
    devices = build_fleet(cfg)[0]
    for i, d in enumerate(devices):
        _keep_best(str(state[i]), d)  # what `fedge edge run --state-dir` does
    sabotage(devices, {ROUNDS})
    _run_over_mqtt(cfg, devices, mosquitto)
    kept: dict[int, tuple[BestRecord, dict[str, torch.Tensor]]] = {}
    for i, d in enumerate(devices):
        meta = read_checkpoint_meta(state[i] / "best.safetensors")
        record = BestRecord.from_meta(meta)
        assert record is not None and record == d.method.best.record and record.round < ROUNDS + 1
        assert record.acc_val is not None and record.acc_val > 0.5
        kept[i] = (record, load_checkpoint(state[i] / "best.safetensors").state_dict())
    # The devices restart: new processes build their models afresh and take back what the state directory kept.
    restarted = build_fleet(cfg)[0]
    for i, d in enumerate(restarted):
        _keep_best(str(state[i]), d)
        assert d.method.best.record == kept[i][0]
        assert f"best model so far from round {kept[i][0].round}" in capsys.readouterr().err
        best = d.method.best.model(d.method.ctx.model)
        assert all(torch.equal(best.state_dict()[k], v) for k, v in kept[i][1].items())
    # A new run in which every round is worse than the kept model does not replace it.
    sabotage(restarted, set(range(1, ROUNDS + 1)))
    _run_over_mqtt(cfg, restarted, mosquitto)
    for i, d in enumerate(restarted):
        assert BestRecord.from_meta(read_checkpoint_meta(state[i] / "best.safetensors")) == kept[i][0]
        assert d.method.best.checks == ROUNDS + 1


# With lr 0.05 constant (issue 45's first defaults) seed 1 missed the target by 1.2 points: x86-gateway-1 ended 6.2
# points below its best (63 -> 57 in the last round), unseen by its saturated validation fold. With the plan's lr 0.1
# annealed by a cosine (issue 45's schedule) no device of either seed ends more than 2 points below its best
# (docs/results.md, "The learning-rate schedule").
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_issue_45_fleet_with_defaults_ends_within_five_points_of_its_best(seed: int) -> None:
    # Issue 45's fleet as a new user writes it (no [train], no [method]): six devices, FedProto on digits,
    # Dirichlet 0.5, 12 rounds. With the defaults before issue 45 (lr 0.1, every last batch alone) a Pi 4 2 GB
    # ended at 22 % after 73 % the round before (docs/results.md).
    cfg = load_fleet(REPO / "benchmarks" / "fleets" / "six-fedproto-defaults.toml")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed))
    assert cfg.train.lr is None and cfg.train.lr_schedule is None and cfg.train.min_tail is None  # the plan decides
    devices, strat = build_fleet(cfg)
    assert {(d.method.ctx.train_cfg.lr, d.method.ctx.train_cfg.lr_schedule) for d in devices} == {(0.1, "cosine")}
    assert {d.method.ctx.train_cfg.min_tail for d in devices} == {8}
    _agents, reports = run_rounds(cfg, devices, strat)
    for d in devices:
        acc = [100 * r.metrics[d.info.device_id]["acc_global"] for r in reports]
        assert len(acc) == 13 and max(acc) > 40  # it learned something worth keeping
        assert acc[-1] >= max(acc) - 5, (d.info.device_id, [round(a) for a in acc])
