"""Issue 17: no device ends worse off than alone — the personal head and the guard on synthetic knowledge.

A small Dirichlet(0.3) digits fleet of four devices with fixed seeds (tests/generative_helpers.py).
The local test splits hold 20-50 digits, so one digit is 2-5 points: the per-device margins
below are one to two digits wide, and the fleet means are held to the issue's 1 point.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from fleet_helpers import digits
from generative_helpers import skewed_fleet

from fedge.common.method_settings import FedProtoSettings, FedVTCSettings, GeFLFSettings, GeFLSettings
from fedge.common.rounds import EXTRACTOR_ARTIFACT, EXTRACTOR_PREFIX, RoundInfo, group_artifact
from fedge.edge.methods.base import model_arrays
from fedge.edge.methods.personal import _predict_with, guarded_step, holdout, personal_fit_epochs
from fedge.errors import ConfigError
from fedge.fleet.registry import method_entry
from fedge.sim.report import format_table, personal_and_guard

PARTITION: dict[str, Any] = {"alpha": 0.3}
NOISY = "d3"  # the largest share (448 training digits): a held-out fold of ~90
GEFL: dict[str, Any] = {"generator": "cvae", "generator_tier": "tiny", "gen_rounds": 2, "gen_epochs": 1,
                        "gen_lr": 0.003, "gen_weight_decay": 0.0, "synthetic_ratio": 2}

_local: dict[int, dict[str, dict[str, float]]] = {}


def local_metrics(rounds: int) -> dict[str, dict[str, float]]:
    """Local's final metrics per device on the same fleet (computed once per length)."""
    if rounds not in _local:
        fleet = skewed_fleet("local", rounds=rounds, epochs=1, **PARTITION)
        _local[rounds] = fleet.engine.run()[-1].metrics
    return _local[rounds]


def _noise(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform noise images in the generator's [0, 1] space, with random labels."""
    x = torch.rand((n, 1, 32, 32), generator=torch.Generator().manual_seed(n)).numpy()
    return x.astype(np.float32), np.random.default_rng(n).integers(0, 10, n)


@pytest.mark.parametrize("bad", [{"val_fraction": 0}, {"val_fraction": 1.0}, {"val_fraction": 1.5}])
@pytest.mark.parametrize("settings", [GeFLSettings, GeFLFSettings, FedVTCSettings, FedProtoSettings])
def test_validation_fraction_outside_0_1_is_refused(settings: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"val_fraction must lie strictly between 0 and 1") as err:
        settings.parse(bad)
    assert "0 leaves nothing to validate on" in (err.value.hint or "")


def test_unknown_or_mistyped_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown key 'personalise' for method 'geflf'") as err:
        method_entry("geflf").parse({"personalise": True})
    assert "did you mean 'personalize'?" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="unknown key 'guard' for method 'fedproto'"):
        FedProtoSettings.parse({"guard": True})  # FedProto trains on no synthetic samples
    with pytest.raises(ConfigError, match="guard must be true or false, got 'yes'"):
        GeFLSettings.parse({"guard": "yes"})
    with pytest.raises(ConfigError, match=r'personalize needs inference = "head"'):
        FedProtoSettings.parse({"personalize": True, "inference": "prototype"})
    with pytest.raises(ConfigError, match="personal_epochs must be an integer >= 1, got 0"):
        FedVTCSettings.parse({"personal_epochs": 0})


def test_holdout_folds_cover_every_sample_once() -> None:
    folds = [holdout(50, 0.2, seed=3, fold=f) for f in range(5)]
    vals = np.concatenate([v for _, v in folds])
    assert sorted(vals.tolist()) == list(range(50))  # five folds of ten, disjoint
    rest, val = folds[0]
    assert len(val) == 10 and len(rest) == 40 and not set(rest) & set(val)
    assert np.array_equal(holdout(50, 0.2, seed=3)[1], val)  # fold 0 is the same at every call


def test_guarded_step_keeps_the_better_branch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    x = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    y = np.array([0, 1])

    def set_weights(w: list[list[float]]) -> None:
        with torch.no_grad():
            model.weight.copy_(torch.tensor(w))
            model.bias.zero_()

    right, wrong = [[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]
    d = guarded_step(model, lambda: set_weights(wrong), lambda: set_weights(right), x, y, tolerance=0.0)
    assert (not d.used, d.effect) == (True, -100.0)
    assert torch.equal(model.weight, torch.tensor(right))  # the branch without synthetic samples was restored
    d = guarded_step(model, lambda: set_weights(right), lambda: set_weights(wrong), x, y, tolerance=0.0)
    assert d.used and d.effect == 100.0 and torch.equal(model.weight, torch.tensor(right))
    # more slack than the harm keeps even the harmful branch
    d = guarded_step(model, lambda: set_weights(wrong), lambda: set_weights(right), x, y, tolerance=150.0)
    assert d.used and torch.equal(model.weight, torch.tensor(wrong))


def test_guard_skips_noise_and_the_device_stays_near_local() -> None:
    """A device whose synthetic samples are noise: the guard skips them when they hurt and draws them at
    half weight afterwards (measured: −1.1 points on the held-out fold in the first target round,
    skipped; a tie at weight 0.5 won on loss, kept; −1.1 at weight 0.5, skipped), and the device's
    local accuracy ends within 5 points (two of its 49 test digits) of Local's after as many real
    epochs (measured: 89.8 %, Local's; 81.6 % with ``guard_refit = false``, whose held-out fold sits
    out every verdict's epoch — here a round's only real epoch)."""
    rounds = 5  # 2 generator + 3 target rounds
    # the guard as it ships (on the fleet's extractor too, tested below; without it the noisy device
    # also carries the averaged stem, which costs it more than the noise does)
    fleet = skewed_fleet("gefl", rounds=rounds, method_config={**GEFL, "guard": True}, epochs=1, **PARTITION)
    fleet.methods()[3]._synthetic = _noise  # the fault: this device's generator yields noise
    reports = fleet.engine.run()
    assert not any(r.rejected for r in reports)
    decisions = [r.info[NOISY] for r in reports if "guard_used" in r.info.get(NOISY, {})]
    assert len(decisions) == rounds - GEFL["gen_rounds"]  # one verdict per target round
    skipped = [d for d in decisions if not d["guard_used"]]
    assert len(skipped) >= 1, decisions
    assert all(d["guard_effect"] <= 0 for d in skipped)  # a skip is a measured loss (or a tie on loss)
    # the weight follows the verdicts: halved after a skip, doubled (at most 1) after a measured help
    weights = [d["guard_weight"] for d in decisions]
    assert weights[0] == 1.0
    for d, w, nxt in zip(decisions, weights, [*weights[1:], fleet.methods()[3].synthetic_weight], strict=True):
        assert nxt == (w / 2 if not d["guard_used"] else min(1.0, 2 * w) if d["guard_effect"] > 0 else w), decisions
    assert min(weights[1:]) <= 0.5, decisions  # after the first harm the noise is drawn at half weight
    # results.json: one entry per target round, with the verdict, its measured effect and the weight
    logged = personal_and_guard(reports, NOISY)["guard"]
    assert [g["round"] for g in logged] == [r.round for r in reports if "guard_used" in r.info.get(NOISY, {})]
    assert [(g["used"], g["effect"], g["weight"]) for g in logged] == [
        (d["guard_used"], d["guard_effect"], d["guard_weight"]) for d in decisions]
    local = local_metrics(rounds - GEFL["gen_rounds"])[NOISY]["acc_local"]  # as many real epochs
    mine = reports[-1].metrics[NOISY]["acc_local"]
    assert mine >= local - 0.05, f"{NOISY}: {mine:.3f} vs Local {local:.3f}"


@pytest.mark.slow
def test_guard_keeps_the_groups_extractor_where_the_fleets_hurts() -> None:
    """GeFL averages the common extractor over every architecture (the published ``avg_FE = 1``);
    with the guard each device also judges that average against its group's own stem. On this fleet
    of four architectures the average hurts (measured: refused in 8 of 8 device-rounds, at −23 to −74
    points on the held-out fold and once on a tie lost on loss), and keeping the group's stem ends at
    30.1 % mean global accuracy against 24.6 % with ``guard_extractor = false`` (local 76.7 % against
    56.6 %)."""
    rounds = 5  # 2 generator + 3 target rounds; the first target round has no averaged stem yet
    runs = {}
    for judged in (True, False):
        fleet = skewed_fleet("gefl", rounds=rounds, method_config={**GEFL, "guard": True, "guard_extractor": judged},
                             epochs=1, **PARTITION)
        runs[judged] = (fleet, fleet.engine.run())
    fleet, reports = runs[True]
    for dev in reports[-1].metrics:
        logged = personal_and_guard(reports, dev)["guard_stem"]
        assert [g["round"] for g in logged] == [4, 5]
        assert all(g["effect"] <= 0 for g in logged if not g["used"])  # a rejection is a measured loss
    assert "guard_stem" not in personal_and_guard(runs[False][1], "d0")
    rejected = sum(not g["used"] for dev in reports[-1].metrics for g in personal_and_guard(reports, dev)["guard_stem"])
    assert rejected >= 4, rejected

    def mean_acc(rep: list[Any], key: str) -> float:
        return float(np.mean([m[key] for m in rep[-1].metrics.values()]))
    assert mean_acc(reports, "acc_global") >= mean_acc(runs[False][1], "acc_global")

    # The mechanics, byte for byte: a hostile fleet stem is refused and the group's stays; the group's
    # own stem sent as the fleet's is a tie and kept; without the group's stem (a coordinator that
    # did not send it) the fleet's is loaded as it is.
    dev = fleet.methods()[0]
    model = dev.ctx.model
    own = model_arrays(model)
    stem_keys = [k for k in own if k.startswith(EXTRACTOR_PREFIX)]
    assert stem_keys
    rng = np.random.default_rng(0)
    hostile = {k: (own[k] + rng.normal(0, 1, own[k].shape)).astype(own[k].dtype) for k in stem_keys}
    group = group_artifact(model.spec.name)
    info = RoundInfo(rounds + 1, "target", "gefl")
    dev.apply_global(info, {EXTRACTOR_ARTIFACT: hostile, group: own})
    assert not dev.stem_decision.used and dev.stem_decision.effect < 0
    assert all(np.array_equal(model_arrays(model)[k], own[k]) for k in stem_keys)
    poisoned = {k: np.full_like(own[k], np.nan) for k in stem_keys}  # a NaN stem is refused the same way
    dev.apply_global(info, {EXTRACTOR_ARTIFACT: poisoned, group: own})
    assert not dev.stem_decision.used
    assert all(np.array_equal(model_arrays(model)[k], own[k]) for k in stem_keys)
    dev.apply_global(info, {EXTRACTOR_ARTIFACT: {k: own[k].copy() for k in stem_keys}, group: own})
    assert dev.stem_decision.used and dev.stem_decision.effect == 0
    dev.stem_decision = None
    rest = {k: v for k, v in own.items() if k not in stem_keys}
    dev.apply_global(info, {EXTRACTOR_ARTIFACT: hostile, group: rest})
    assert dev.stem_decision is None
    assert all(np.array_equal(model_arrays(model)[k], hostile[k]) for k in stem_keys)


@pytest.mark.slow
def test_personal_head_never_falls_behind_local() -> None:
    """FedProto with a personal head: every device within 6 points (two of the smallest split's
    digits) of Local on its own split, the mean within the issue's 1 point, and the personal head
    chosen where the federated one falls short (d1: measured 50.0 % federated, 85.7 % personal)."""
    rounds = 4
    reports = skewed_fleet("fedproto", rounds=rounds, method_config={"personalize": True}, epochs=1,
                           **PARTITION).engine.run()
    final = reports[-1].metrics
    local = local_metrics(rounds)
    for dev, m in final.items():
        assert m["acc_local"] >= local[dev]["acc_local"] - 0.06, (dev, m, local[dev])
        # the chosen predictor is never the worse of the two on the held-out split
        assert (m["personal"] == 1.0) == (m["val_gain_personal"] >= 0)  # a tie goes to the personal one
        assert {"acc_local_generic", "acc_global", "acc_global_personal"} <= set(m)
    assert np.mean([m["acc_local"] for m in final.values()]) >= np.mean(
        [m["acc_local"] for m in local.values()]) - 0.01
    assert any(m["acc_local"] > m["acc_local_generic"] + 0.1 for m in final.values())
    extras = {dev: personal_and_guard(reports, dev) for dev in final}
    assert all(e["final_personal"] == final[dev]["personal"] for dev, e in extras.items())
    assert all("guard" not in e for e in extras.values())  # FedProto has no synthetic samples


def _own_distribution_accuracy(predict: Any, train_y: np.ndarray, test: Any) -> float:
    """Accuracy on the device's own label distribution, from the 450-digit test set: each class's
    accuracy weighted by the class's share of the device's training data (its 2-digit local split is
    too small to measure a difference)."""
    share = np.bincount(train_y, minlength=10) / len(train_y)
    pred = predict(test.x)
    return float(sum(share[c] * (pred[test.y == c] == c).mean() for c in range(10) if share[c] > 0))


@pytest.mark.slow
def test_a_tiny_device_gets_enough_personal_steps_to_match_local() -> None:
    """Dirichlet(0.1), seed 1, GeFL-F: d0 holds 23 training digits (one batch, mostly 2s) and shares
    its architecture with d3 (385 digits, no 2s), so the head averaged within the group serves d0
    badly (measured: 51.3 % on d0's distribution) — table 2's client-17 at α = 0.1 (15 images,
    federated model 0 % on its split). Local takes one step per epoch of every round (36 here); a
    personal fit counted in epochs alone took 5. With the step floor (the default,
    `personal_min_steps` = 100) d0's personal head is at most 2 points below Local's model on
    d0's own distribution (measured: 95.1 % vs Local's 87.3 %); without it (`personal_min_steps` = 0,
    the fit before the floor) it is more than 3 points below (measured: 82.7 %).

    The head (FedBABU-style, `personal_part = "head"`): since the group's devices start from one
    point (issue 25), the federated features are good enough that 5 steps of the whole model already
    reach Local (95.0 % without the floor, 94.6 % with it); the head alone still needs the steps."""
    rounds, epochs, tiny = 12, 3, 0
    archs = ("cnn1-p32", "cnn2-p32", "cnn3-p32", "cnn1-p32")  # d0 and d3 share an architecture
    config = {"warmup_rounds": 2, "gen_rounds": 2, "generator_tier": "tiny", "gen_epochs": 1}
    test = digits()[1]
    local = skewed_fleet("local", rounds=rounds, epochs=epochs, alpha=0.1, seed=1, archs=archs)
    local.engine.run()
    fleet = skewed_fleet("geflf", rounds=rounds, epochs=epochs, alpha=0.1, seed=1, archs=archs,
                         method_config=config)
    fleet.engine.run()
    device = fleet.methods()[tiny]
    ctx = device.ctx
    assert len(ctx.train) == 23 and ctx.train_cfg.batch_size >= len(ctx.train)  # one batch: one step per epoch
    alone = _own_distribution_accuracy(_predict_with(local.methods()[tiny].ctx.model), ctx.train.y, test)
    federated = _own_distribution_accuracy(_predict_with(ctx.model), ctx.train.y, test)
    default = GeFLFSettings.parse({**config, "personalize": True, "personal_part": "head"})
    assert default.personal_min_steps == 100
    accuracy = {}
    for floor in (100, 0):
        device.settings = dataclasses.replace(default, personal_min_steps=floor)
        predict, choice = device.personal_predictor()
        assert choice.personal, (floor, choice)  # the federated model serves d0 worse either way
        accuracy[floor] = _own_distribution_accuracy(predict, ctx.train.y, test)
    print(f"d0 on its own distribution: personal {accuracy}, federated {federated:.3f}, Local {alone:.3f}")
    assert federated < alone - 0.3  # the group's head: the situation the floor is for
    assert accuracy[100] >= alone - 0.02, (accuracy, alone)
    assert accuracy[0] < alone - 0.03, (accuracy, alone)  # the floor is what closes the gap


def test_personal_fit_epochs_reach_the_step_floor() -> None:
    assert personal_fit_epochs(15, 64, 5, 100) == 100  # one batch per epoch
    assert personal_fit_epochs(480, 64, 5, 100) == 13  # 8 batches per epoch: ceil(100 / 8)
    assert personal_fit_epochs(1280, 64, 5, 100) == 5  # 20 batches: the 5 epochs already take 100 steps
    assert personal_fit_epochs(15, 64, 5, 0) == 5  # no floor
    assert personal_fit_epochs(0, 64, 5, 100) == 5
    with pytest.raises(ConfigError, match="personal_min_steps must be an integer >= 0, got -1"):
        GeFLFSettings.parse({"personal_min_steps": -1})


def test_table_shows_the_chosen_predictor_and_the_guard() -> None:
    dev = {"id": "d0", "profile": "pi4", "arch": "cnn1", "params": 10, "final_acc_global": 0.5, "best_acc_global": 0.5,
           "final_acc_local": 0.9, "final_acc_local_generic": 0.7, "final_personal": 1.0,
           "guard": [{"round": 3, "used": False}, {"round": 4, "used": True}],
           "guard_stem": [{"round": 4, "used": False}],
           "bytes_up": [1024], "bytes_down": [2048], "upload_precision": "fp32"}
    results = {"devices": [dev], "method": "gefl", "dataset": "digits", "rounds": 4, "seconds": 1.0,
               "summary": {"mean_final_acc_global": 0.5, "mean_best_acc_global": 0.5, "mean_final_acc_local": 0.9,
                           "mean_final_acc_local_generic": 0.7, "mean_final_acc_global_personal": 0.45,
                           "personal_devices": 1, "guard_used": 1, "guard_decisions": 2,
                           "guard_stem_used": 0, "guard_stem_decisions": 1}}
    table = format_table(results)
    header, row = table.splitlines()[0], table.splitlines()[2]
    assert "local, federated %" in header and "synthetic kept" in header and "fleet stem kept" in header
    assert row.split()[6:11] == ["90.0", "70.0", "personal", "1/2", "0/1"]
    assert "personal predictor chosen on 1 of 1 devices" in table and "kept in 1 of 2 device-rounds" in table
    assert "the fleet's extractor kept in 0 of 1 device-rounds (else the group's own)" in table
