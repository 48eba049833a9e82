"""fedge audit privacy: the MND metric, an overfit generator against a normal one, the command on a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fleet_helpers import digits

from fedge.audit.mnd import mnd, nearest
from fedge.audit.networks import train_feature_net
from fedge.audit.privacy import Split, audit_samples, split_test, to01
from fedge.common.generators import GeneratorSpec
from fedge.edge.generators.modules import ConditionalGenerator, build_generator
from fedge.edge.generators.train import GeneratorTrainer


def test_nearest_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    q, r = rng.normal(size=(37, 5)), rng.normal(size=(23, 5))
    d, j = nearest(q, r, chunk=8)
    full = np.linalg.norm(q[:, None] - r[None], axis=2)
    np.testing.assert_array_equal(j, full.argmin(1))
    np.testing.assert_allclose(d, full.min(1), rtol=1e-9, atol=1e-9)


def test_copies_of_the_training_set_score_zero_and_fresh_data_one() -> None:
    rng = np.random.default_rng(1)
    train, val, fresh = (rng.normal(size=(400, 16)) for _ in range(3))
    copies = train[rng.integers(0, 400, 300)] + rng.normal(scale=1e-3, size=(300, 16))
    assert mnd(copies, val, train)[0].ratio < 0.01
    assert 0.9 < mnd(fresh, val, train)[0].ratio < 1.1


def test_the_inversion_round_trip_is_measured_beside_the_samples() -> None:
    from fedge.audit.report import format_audit_table
    from fedge.edge.models import build_model

    rng = np.random.default_rng(2)
    train01, val01 = rng.random((60, 1, 32, 32)).astype(np.float32), rng.random((40, 1, 32, 32)).astype(np.float32)
    split = Split(train01, np.zeros(60, np.int64), val01, np.zeros(40, np.int64), 0.5, 0.25)
    net = build_model("cnn5", seed=0, num_classes=10)  # any fixed network: the mechanics, not the figures
    syn = train01[:40] + 0.01  # near-copies of training images
    plain = audit_samples("g", "d0", syn, split, net).to_dict()
    assert "roundtrip" not in plain
    a = audit_samples("g", "d0", syn, split, net, level="feature", roundtrip01=val01).to_dict()
    rt = a["roundtrip"]
    assert rt["pixel"]["ratio"] == pytest.approx(1.0) and rt["features"]["ratio"] == pytest.approx(1.0)
    assert rt["ratio_synthetic_to_roundtrip"]["pixel"] == pytest.approx(a["pixel"]["ratio"])  # round trip = held-out
    assert a["pixel"]["ratio"] < 0.1
    assert "held-out images through the extractor and the same inverter score ratio 1.000 px" in format_audit_table(
        {"audits": [a]})


def _cvae(x01: np.ndarray, y: np.ndarray, epochs: int) -> ConditionalGenerator:
    g = build_generator(GeneratorSpec("cvae", (1, 32, 32), tier="tiny"), seed=0)
    GeneratorTrainer(g).fit(x01, y, epochs=epochs, batch_size=min(32, len(y)), rng=np.random.default_rng(0),
                            gen=torch.Generator().manual_seed(0))
    g.eval()
    return g


@pytest.mark.slow
def test_an_overfit_generator_scores_clearly_more_memorized() -> None:
    torch.set_num_threads(1)
    train, test = digits()
    m, s = train.norm.mean, train.norm.std
    feat_idx, pool = split_test(test, 0)
    net, acc = train_feature_net(test.x[feat_idx], test.y[feat_idx], 10)
    assert acc > 0.9  # the fixed feature network learned the digits it was given
    rng = np.random.default_rng(0)
    held = pool[:200]
    ratios = {}
    for name, n, epochs in (("overfit", 20, 300), ("normal", 300, 15)):
        idx = rng.permutation(len(train))[:n]
        split = Split(to01(train.x[idx], m, s), train.y[idx], to01(test.x[held], m, s), test.y[held], m, s)
        g = _cvae(split.train01, split.train_y, epochs)
        with torch.no_grad():
            syn = g.sample(torch.from_numpy(split.val_y.astype(np.int64)), torch.Generator().manual_seed(1)).numpy()
        a = audit_samples(name, "d0", syn, split, net)
        ratios[name] = (a.pixel.ratio, a.features.ratio)
        assert len(a.closest) == 8 and a.closest[0][2] <= a.closest[-1][2]
    # measured: overfit 0.45 / 0.47, normal 1.20 / 1.25 (pixels / features; an earlier tree: 0.37 / 0.38, 1.00 / 1.06)
    for space in (0, 1):
        assert ratios["overfit"][space] < 0.6, ratios
        assert ratios["normal"][space] > 0.8, ratios
        assert ratios["overfit"][space] < 0.6 * ratios["normal"][space], ratios


@pytest.fixture(scope="module")
def vtc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-round FedVTC run of two devices, saved as `fedge simulate ... --samples` saves it."""
    from fedge.cli import main

    run = tmp_path_factory.mktemp("run")
    cfg = run / "fleet.toml"
    cfg.write_text('[run]\nmethod = "fedvtc"\nrounds = 2\ndataset = "digits"\n\n[partition]\nkind = "iid"\n'
                   'fraction = 0.3\n\n[train]\nlocal_epochs = 1\n\n[method]\ngenerator_tier = "tiny"\n\n'
                   '[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\n')
    torch.set_num_threads(1)
    assert main(["simulate", str(cfg), "--out", str(run / "out"), "--samples", "--no-progress"]) == 0
    return run / "out"


@pytest.mark.slow
def test_fedge_audit_privacy_on_a_fedvtc_run(vtc_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    index = json.loads((vtc_run / "checkpoints" / "generators" / "index.json").read_text())
    assert index == {"rpi4-2gb-1": "vtc-rpi4-2gb-1", "rpi4-2gb-2": "vtc-rpi4-2gb-2"}
    assert main(["audit", "privacy", str(vtc_run), "--held-out", "100"]) == 0
    out = capsys.readouterr().out
    assert "vtc-rpi4-2gb-1" in out and "ratio px" in out
    report = json.loads((vtc_run / "audit" / "privacy.json").read_text())
    assert [a["device"] for a in report["audits"]] == ["rpi4-2gb-1", "rpi4-2gb-2"]
    # the fixed network and the split are stated in the report
    assert report["feature_network"]["arch"] == "cnn5" and "disjoint" in report["feature_network"]["trained_on"]
    assert report["split"]["n_train_max"] == 1000 and report["split"]["n_val_max"] == 100
    for a in report["audits"]:
        assert a["kind"] == "vtc" and a["n_val"] == a["n_synthetic"] == 100
        assert 0 < a["n_train"] <= 1000
        assert a["pixel"]["ratio"] > 0 and a["features"]["ratio"] > 0
        assert Path(a["figure"]).is_file() and Path(a["figure"]).stat().st_size > 1000


@pytest.mark.slow
def test_a_geflf_feature_generator_is_judged_through_the_inverter(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    cfg = tmp_path / "fleet.toml"
    cfg.write_text('[run]\nmethod = "geflf"\nrounds = 3\ndataset = "digits"\n\n[partition]\nkind = "iid"\n'
                   'fraction = 0.1\n\n[train]\nlocal_epochs = 1\n\n[method]\ngenerator_tier = "tiny"\n'
                   'warmup_rounds = 1\ngen_rounds = 1\ngen_epochs = 1\n\n'
                   '[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\n')
    torch.set_num_threads(1)
    run = tmp_path / "out"
    assert main(["simulate", str(cfg), "--out", str(run), "--samples", "--no-progress"]) == 0
    assert main(["audit", "privacy", str(run), "--held-out", "60"]) == 0
    out = capsys.readouterr().out
    assert "held-out images through the extractor and the same inverter score ratio" in out
    report = json.loads((run / "audit" / "privacy.json").read_text())
    assert len(report["audits"]) == 2
    for a in report["audits"]:
        assert a["level"] == "feature" and a["n_val"] == a["n_synthetic"] == 60
        rt = a["roundtrip"]
        assert rt["pixel"]["validation"] == pytest.approx(a["pixel"]["validation"])  # the same held-out set
        assert rt["ratio_synthetic_to_roundtrip"]["pixel"] == pytest.approx(
            a["pixel"]["synthetic"] / rt["pixel"]["synthetic"])
        assert Path(a["figure"]).is_file()


def test_a_run_without_generators_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    (tmp_path / "results.json").write_text(json.dumps({"config": "x.toml", "method": "fedproto"}))
    assert main(["audit", "privacy", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "holds no generator checkpoints" in err and "--samples" in err
