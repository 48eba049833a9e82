"""[privacy]: clipping, the Gaussian noise, the accountant, the budget, bad settings (fedge.common.privacy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from fleet_helpers import capture_uploads

from fedge.common.privacy import Mechanism, PrivacySettings, calibrate_noise, clip_rows, privatize
from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet
from fedge.mqtt.broker import MosquittoProcess

dp_accounting = pytest.importorskip("dp_accounting", reason="the privacy extra (dp-accounting) is not installed")


def mech(z: float, *, clip: float = 2.0, sigma_clip: float = 0.5, k: int = 11) -> Mechanism:
    return Mechanism(noise_multiplier=z, delta=1e-5, clip=clip, sigma_clip=sigma_clip, releases_per_round=k,
                     stats=("protos", "sigma"))


def test_noise_scale_matches_the_mechanism() -> None:
    m = mech(1.5)
    rng = np.random.default_rng(0)
    protos = np.zeros((200, 64), np.float32)  # inside the clip: the output is pure noise
    sigma = np.zeros(64, np.float32) + 0.01
    out = privatize({"protos": protos, "sigma": sigma, "counts": np.arange(200)}, m, rng)
    noise = out["protos"].astype(np.float64).ravel()
    want = 1.5 * 2 * 2.0  # z · sensitivity (2 · clip)
    # 12,800 draws: the sample std is within ±2 % of the truth with overwhelming probability (its relative
    # standard error is 1/sqrt(2n) ≈ 0.6 %); the mean within 4 standard errors of 0.
    assert abs(noise.std() / want - 1) < 0.02
    assert abs(noise.mean()) < 4 * want / math.sqrt(noise.size)
    assert m.noise_std("sigma") == pytest.approx(1.5 * 2 * 0.5)
    assert (out["sigma"] >= 0).all()  # σ is clamped after the noise (post-processing)
    np.testing.assert_array_equal(out["counts"], np.arange(200))  # counts are not noised (docs/privacy.md)


def test_clipping_bounds_every_contribution() -> None:
    rng = np.random.default_rng(1)
    protos = rng.normal(0, 3, (10, 64)).astype(np.float32)
    protos[3] *= 0.001  # one short row: left alone
    sigma = np.abs(rng.normal(0, 1, 64)).astype(np.float32)
    out = privatize({"protos": protos, "sigma": sigma}, mech(0.0), rng)  # z = 0: clipping only
    norms = np.linalg.norm(out["protos"], axis=1)
    assert norms.max() <= 2.0 + 1e-5
    assert (np.abs(norms[np.arange(10) != 3] - 2.0) < 1e-5).all()  # long rows end exactly on the bound
    np.testing.assert_allclose(out["protos"][3], protos[3], rtol=1e-6)
    assert np.linalg.norm(out["sigma"]) == pytest.approx(0.5, rel=1e-5)
    # clip_rows keeps directions
    c = clip_rows(np.array([[3.0, 4.0]]), 1.0)
    np.testing.assert_allclose(c, [[0.6, 0.8]])


def test_epsilon_is_the_accountants_own_figure() -> None:
    from dp_accounting.rdp import rdp_privacy_accountant

    m = mech(3.0, k=11)
    for rounds in (1, 5, 20):
        acc = rdp_privacy_accountant.RdpAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(3.0), 11 * rounds)
        assert m.epsilon(rounds) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert m.epsilon(5) > m.epsilon(1) > 0
    assert mech(0.0).epsilon(1) == math.inf
    # Calibration: the z found spends at most ε over the run, and not much less.
    z = calibrate_noise(4.0, 1e-5, 110)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z), 110)
    assert 3.96 < acc.get_epsilon(1e-5) <= 4.0


@pytest.mark.parametrize(("table", "message"), [
    ({"epsilon": 4, "delta": 1.0}, "delta must be in (0, 1), got 1.0"),
    ({"epsilon": 4, "delta": 2}, "delta must be in (0, 1)"),
    ({"noise_multiplier": -0.5}, "noise_multiplier must be a finite number >= 0, got -0.5"),
    ({"epsilon": -1}, "epsilon must be a finite number > 0"),
    ({"epsilon": 4, "noise_multiplier": 1}, "set noise_multiplier or epsilon, not both"),
    ({"epsilon": 4, "clip": 0}, "clip must be a finite number > 0, got 0"),
    ({"epsilon": 4, "on_budget": "ignore"}, "on_budget"),
    ({"clip": 3}, "sets neither noise_multiplier nor epsilon"),
    ({"epsilon": 4, "delat": 1e-5}, "unknown key 'delat'"),
])
def test_bad_settings_are_refused(table: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fleet(fleet_doc("fedproto", table))
    assert message in str(err.value) + (err.value.hint or "")


def test_a_method_without_statistics_is_refused() -> None:
    with pytest.raises(ConfigError, match="applies to fedproto and fedvtc, not 'fedavg'"):
        parse_fleet(fleet_doc("fedavg", {"epsilon": 4}))


def test_settings_alone_stay_off() -> None:
    assert not PrivacySettings().enabled
    assert parse_fleet(fleet_doc("fedproto", None)).privacy_mechanism is None


def fleet_doc(method: str, privacy: dict | None, rounds: int = 2) -> dict:
    doc: dict = {"run": {"method": method, "rounds": rounds, "dataset": "digits"},
                 "partition": {"kind": "iid", "fraction": 0.3},
                 "train": {"local_epochs": 1},
                 "devices": [{"profile": "rpi4-2gb", "count": 2}]}
    if privacy is not None:
        doc["privacy"] = privacy
    return doc


@pytest.mark.slow
def test_fleet_uploads_are_clipped_and_epsilon_is_reported() -> None:
    from fedge.coordinator.engine import EngineConfig, RoundEngine
    from fedge.fleet.devices import build_devices, load_fleet_data
    from fedge.fleet.registry import method_entry
    from fedge.sim.inprocess import connect_inprocess

    cfg = parse_fleet(fleet_doc("fedproto", {"noise_multiplier": 0.0, "clip": 0.5}))
    mech_ = cfg.privacy_mechanism
    assert mech_ is not None and mech_.releases_per_round == 10
    data = load_fleet_data(cfg)
    devices = build_devices(cfg, data)
    _, coord, agents = connect_inprocess([(d.method, d.info) for d in devices])
    seen = capture_uploads(agents)
    strat = method_entry("fedproto").build_strategy(cfg.method_config, num_classes=10, rounds=2)
    reports = RoundEngine(strat, coord, EngineConfig(method="fedproto", privacy=mech_)).run()
    rows = np.concatenate([u.msg.tensors["protos"] for u in seen if "protos" in u.msg.tensors])
    norms = np.linalg.norm(rows, axis=1)
    assert norms.max() <= 0.5 + 1e-4  # every uploaded prototype within the clip
    assert (np.abs(norms - 0.5) < 1e-4).sum() >= 10  # and the features' real norms (3-8) were cut to it
    assert [r.privacy.get("epsilon") for r in reports] == [math.inf, math.inf, None]


def test_the_run_stops_when_its_budget_is_spent() -> None:
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    cfg = parse_fleet(fleet_doc("fedproto", {"noise_multiplier": 5.0, "budget": 4.5}, rounds=4))
    m = cfg.privacy_mechanism
    assert m is not None and m.epsilon(2) <= 4.5 < m.epsilon(3)  # the budget allows exactly two rounds
    res = simulate(cfg)
    assert [r.round for r in res.reports] == [1, 2, 5]  # two training rounds, then the final evaluation
    out = build_results(res)["privacy"]
    assert out["training_rounds_released"] == 2
    assert out["epsilon"] == pytest.approx(m.epsilon(2))
    assert out["epsilon_per_round"] == pytest.approx(m.epsilon(1))
    assert not out["budget_spent"]


@pytest.mark.slow
def test_on_budget_warn_goes_on_and_reports_the_overspend(caplog: pytest.LogCaptureFixture) -> None:
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    cfg = parse_fleet(fleet_doc("fedproto", {"noise_multiplier": 5.0, "budget": 4.5, "on_budget": "warn"},
                                rounds=3))
    m = cfg.privacy_mechanism
    assert m is not None and m.epsilon(2) <= 4.5 < m.epsilon(3)
    with caplog.at_level("WARNING", logger="fedge.coordinator.engine"):
        res = simulate(cfg)
    assert [r.round for r in res.reports] == [1, 2, 3, 4]  # every training round ran, then the final one
    warned = [r.getMessage() for r in caplog.records if "privacy budget" in r.getMessage()]
    assert len(warned) == 1 and "exceeded in round 3" in warned[0], warned
    out = build_results(res)["privacy"]
    assert out["training_rounds_released"] == 3
    assert out["epsilon"] == pytest.approx(m.epsilon(3))
    assert out["budget_spent"] is True
    log_ = build_results(res)["rounds_log"]
    assert [r["epsilon"] for r in log_[:3]] == pytest.approx([m.epsilon(1), m.epsilon(2), m.epsilon(3)])
    assert "epsilon" not in log_[3]  # the final evaluation round releases nothing


def test_received_statistics_are_projected_into_the_clip() -> None:
    from fedge.common.privacy import project_global

    m = mech(1.0)
    rng = np.random.default_rng(2)
    glob: dict[str, dict[str, np.ndarray]] = {
        "prototypes": {"protos": rng.normal(0, 50, (10, 64)).astype(np.float32), "counts": np.ones(10)},
            "other": {"w": np.full(3, 100.0)}}
    out = project_global(glob, m)
    assert np.linalg.norm(out["prototypes"]["protos"], axis=1).max() <= 2.0 + 1e-5
    np.testing.assert_array_equal(out["other"]["w"], glob["other"]["w"])  # other artifacts untouched
    # an inf (a diverged device) becomes finite, not NaN
    assert np.isfinite(clip_rows(np.array([[np.inf, 1.0]]), 1.0)).all()


def test_fedge_coordinator_run_reports_epsilon_each_round(tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    """The standalone coordinator over a real Mosquitto prints ε per round and keeps it in reports.jsonl."""
    import subprocess
    import sys

    from fedge.fleet.config import load_fleet
    from fedge.fleet.devices import build_devices, load_fleet_data
    from fedge.sim.over_mqtt import start_fleet

    path = tmp_path / "fleet.toml"
    path.write_text('[run]\nmethod = "fedproto"\nrounds = 2\ndataset = "digits"\nfleet = "dp"\n\n'
                    '[partition]\nkind = "iid"\nfraction = 0.3\n\n[train]\nlocal_epochs = 1\n\n'
                    '[privacy]\nnoise_multiplier = 5.0\ndelta = 1e-5\n\n'
                    '[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\n')
    cfg = load_fleet(path)
    m = cfg.privacy_mechanism
    assert m is not None
    _, _, stop = start_fleet(cfg, build_devices(cfg, load_fleet_data(cfg)), mosquitto.settings(), coordinator=False)
    state = tmp_path / "state"
    try:
        run = subprocess.run([sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(path), "--broker",
                              mosquitto.url, "--state-dir", str(state), "--round-timeout", "0"],
                             capture_output=True, text=True, timeout=180)
    finally:
        stop()
    assert run.returncode == 0, run.stdout + run.stderr
    for rnd in (1, 2):
        line = next(s for s in run.stdout.splitlines() if s.startswith(f"round {rnd}/3"))
        assert f"ε {m.epsilon(rnd):.3g} at δ 1e-05 (+{m.epsilon(1):.3g}/round)" in line, line
    final = next(s for s in run.stdout.splitlines() if s.startswith("round 3/3"))
    assert "ε" not in final  # the final evaluation releases nothing
    reports = [json.loads(s) for s in (state / "reports.jsonl").read_text().splitlines()]
    assert [r["privacy"].get("epsilon") for r in reports] == pytest.approx([m.epsilon(1), m.epsilon(2), None])
