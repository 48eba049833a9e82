"""FedVTC: statistics-only uploads, pooled aggregation, missing classes, NaN, ablation switches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fleet_helpers import capture_uploads
from generative_helpers import skewed_fleet

from fedge.common.rounds import VTC_STATS_ARTIFACT, DeviceInfo
from fedge.edge.methods.base import model_arrays
from fedge.errors import ConfigError
from fedge.fleet.registry import method_entry

ARCHS_MIXED = ("cnn3-p32", "cnn1-p32", "cnn9-p32", "cnn4-p32")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_uploads_contain_only_statistics(precision: str) -> None:
    fleet = skewed_fleet("fedvtc", rounds=1, archs=ARCHS_MIXED, epochs=1, precision=precision,
                         method_config={"generator_tier": "tiny"})
    seen = capture_uploads(fleet.agents)
    rep = fleet.engine.run_round(1)
    assert not rep.rejected and len(seen) == 4
    p, c = 32, 10
    sizes = []
    for raw, msg in seen:
        assert set(msg.tensors) == {"protos", "sigma", "counts"}
        assert msg.tensors["protos"].shape == (c, p) and msg.tensors["sigma"].shape == (p,)
        assert msg.tensors["counts"].shape == (c,) and msg.tensors["counts"].dtype == np.int64
        assert rep.bytes_up[msg.sender] == len(raw)  # the engine counts the encoded bytes
        sizes.append(len(raw))
        # counts are the device's true class histogram
        dev = next(a for a in fleet.agents if a.device.device_id == msg.sender)
        np.testing.assert_array_equal(msg.tensors["counts"], np.bincount(dev.method.ctx.train.y, minlength=c))
    # the payload: (C*p + p) floats + C int64 + a small header, whatever the model's size
    float_bytes = 4 if precision == "fp32" else 2
    payload = (c * p + p) * float_bytes + c * 8
    assert all(payload < s < payload + 1200 for s in sizes), sizes
    assert max(sizes) - min(sizes) < 64  # cnn9 (>100k params) sends what cnn1 sends
    biggest = max(a.method.ctx.model.spec.num_params() for a in fleet.agents)
    assert max(sizes) < biggest * 4 / 20


def test_aggregated_prototypes_and_sigma_equal_a_hand_computation() -> None:
    rng = np.random.default_rng(0)
    c, p = 3, 4
    strat = method_entry("fedvtc").build_strategy({}, num_classes=c, rounds=1)
    strat.begin_round(1)
    raw: dict[int, list[np.ndarray]] = {y: [] for y in range(c)}
    for k, counts in enumerate([(5, 0, 7), (2, 9, 0), (4, 3, 6)]):
        feats = {y: rng.normal(loc=rng.normal(0, 2, p), scale=rng.uniform(0.5, 2), size=(n, p))
                 for y, n in enumerate(counts)}
        n = np.asarray(counts)
        protos = np.stack([feats[y].mean(0) if counts[y] else np.zeros(p) for y in range(c)])
        within = sum(((feats[y] - protos[y]) ** 2).sum(0) for y in range(c) if counts[y]) / n.sum()
        arrays = {"protos": protos.astype(np.float32), "sigma": np.sqrt(within).astype(np.float32),
                  "counts": n.astype(np.int64)}
        strat.accumulate(DeviceInfo(f"d{k}", "cnn1-p4", "t", num_samples=int(n.sum()), feature_dim=p), arrays, {})
        for y in range(c):
            raw[y].append(feats[y])
    out = strat.finish_round(1)[VTC_STATS_ARTIFACT]
    pooled = {y: np.concatenate(raw[y]) for y in range(c)}
    np.testing.assert_array_equal(out["counts"], [11, 12, 13])
    for y in range(c):  # count-weighted means = the mean of all the class's features
        np.testing.assert_allclose(out["protos"][y], pooled[y].mean(0), rtol=1e-5, atol=1e-5)
    # pooled within-class variance of all the data: includes the spread of device means
    total = sum(len(pooled[y]) for y in range(c))
    var = sum(((pooled[y] - pooled[y].mean(0)) ** 2).sum(0) for y in range(c)) / total
    np.testing.assert_allclose(out["sigma"], np.sqrt(var), rtol=1e-4)
    # ... which is larger than the plain average of the device sigmas here (device means differ)
    assert np.all(out["sigma"] ** 2 > 0)


def test_a_class_missing_on_every_device_is_never_synthesized() -> None:
    fleet = skewed_fleet("fedvtc", rounds=2, epochs=1, drop_class=9, method_config={"generator_tier": "tiny"})
    fleet.engine.run_round(1)
    stats = fleet.engine.globals[VTC_STATS_ARTIFACT]
    assert stats["counts"][9] == 0 and np.all(stats["protos"][9] == 0) and np.all(np.isfinite(stats["sigma"]))
    fleet.engine.run_round(2)  # devices apply the statistics and fine-tune on decoded images
    for m in fleet.methods():
        assert 9 not in m.g_classes.tolist() and len(m.g_classes) == 9
        x, y = m.synthesize(300)
        assert 9 not in set(y.tolist()) and set(y.tolist()) == set(range(9))
        assert x.shape == (300, 1, 32, 32) and np.all(np.isfinite(x))


def test_synthetic_labels_local_decodes_only_the_devices_own_classes() -> None:
    with pytest.raises(ConfigError, match="synthetic_labels must be 'global' or 'local', got 'all'"):
        skewed_fleet("fedvtc", rounds=1, method_config={"synthetic_labels": "all"})
    fleet = skewed_fleet("fedvtc", rounds=2, epochs=1, method_config={"generator_tier": "tiny",
                                                                       "synthetic_labels": "local"})
    fleet.engine.run_round(1)
    fleet.engine.run_round(2)
    for m in fleet.methods():
        own = set(np.unique(m.ctx.train.y).tolist())
        assert len(own) < 10 and len(m.g_classes) == 10  # three label shards: a few classes each
        _, y = m.synthesize(400)
        assert set(y.tolist()) == own  # every own class, nothing else
        counts = np.bincount(y, minlength=10)[sorted(own)]
        assert counts.min() > 0.5 * 400 / len(own)  # uniform over them, not the device's skew


def test_statistics_with_nan_are_rejected_and_do_not_reach_the_aggregate() -> None:
    fleet = skewed_fleet("fedvtc", rounds=1, epochs=1, method_config={"generator_tier": "tiny"})
    bad = fleet.agents[1].method
    orig = bad.train_round

    def poisoned(info):
        arrays, extra = orig(info)
        arrays["sigma"] = arrays["sigma"].copy()
        arrays["sigma"][0] = np.nan
        return arrays, extra

    bad.train_round = poisoned  # type: ignore[method-assign]
    seen = capture_uploads(fleet.agents)
    rep = fleet.engine.run_round(1)
    assert rep.rejected == {"nonfinite": 1} and "d1" not in rep.accepted
    good = [m for _, m in seen if m.sender != "d1"]
    counts = sum(m.tensors["counts"] for m in good)
    stats = fleet.engine.globals[VTC_STATS_ARTIFACT]
    np.testing.assert_array_equal(stats["counts"], counts)
    assert np.all(np.isfinite(stats["sigma"])) and np.all(np.isfinite(stats["protos"]))


@pytest.mark.slow
def test_ablation_switches_change_what_trains() -> None:
    with pytest.raises(ConfigError, match="finetune"):
        skewed_fleet("fedvtc", rounds=1, method_config={"finetune": "body"})
    with pytest.raises(ConfigError, match="dm"):
        skewed_fleet("fedvtc", rounds=1, method_config={"dm": "no"})
    with pytest.raises(ConfigError, match=r"decoder_lr must be a number > 0, got 0"):
        skewed_fleet("fedvtc", rounds=1, method_config={"decoder_lr": 0.0})
    calls = {"dm": 0, "kl": 0}
    for switch in ({"dm": False}, {"kl": False}, {"finetune": "head"}):
        fleet = skewed_fleet("fedvtc", rounds=2, epochs=1, method_config={"generator_tier": "tiny", **switch})
        m = fleet.methods()[0]
        dm, kl = m._dm_loss, m._kl_loss

        def count_dm(b, dm=dm):
            calls["dm"] += 1
            return dm(b)

        def count_kl(*a, kl=kl):
            calls["kl"] += 1
            return kl(*a)

        m._dm_loss, m._kl_loss = count_dm, count_kl
        fleet.engine.run_round(1)
        before = model_arrays(m.ctx.model)
        calls.update(dm=0, kl=0)
        fleet.engine.run_round(2)  # apply (fine-tune) then train with the global statistics
        after = model_arrays(m.ctx.model)
        # Whichever term is switched off, the round still trained this device's model.
        assert any(not np.array_equal(before[k], after[k]) for k in before), switch
        if switch == {"dm": False}:
            assert calls["dm"] == 0 and calls["kl"] > 0
        elif switch == {"kl": False}:
            assert calls["kl"] == 0 and calls["dm"] > 0
        else:
            assert calls["dm"] > 0 and calls["kl"] > 0
            # head-only fine-tuning: apply_global must leave everything but the head untouched
            m2 = skewed_fleet("fedvtc", rounds=2, epochs=1, method_config={"generator_tier": "tiny", **switch})
            m2.engine.run_round(1)
            dev = m2.methods()[0]
            w0 = model_arrays(dev.ctx.model)
            dev.apply_global(m2.engine.round_info(2), {VTC_STATS_ARTIFACT: m2.engine.globals[VTC_STATS_ARTIFACT]})
            w1 = model_arrays(dev.ctx.model)
            changed = {k for k in w0 if not np.array_equal(w0[k], w1[k])}
            assert changed and all(k.startswith("head.") for k in changed), changed
    _ = torch


def test_decoder_epochs_limit_decoder_training_to_the_last_alternations() -> None:
    with pytest.raises(ConfigError, match=r"decoder_epochs \(4\) exceeds .*local_epochs = 3"):
        skewed_fleet("fedvtc", rounds=1, epochs=3, method_config={"decoder_epochs": 4})
    with pytest.raises(ConfigError, match="decoder_epochs must be an integer >= 1"):
        skewed_fleet("fedvtc", rounds=1, epochs=3, method_config={"decoder_epochs": 0})
    for k in (3, 1):
        fleet = skewed_fleet("fedvtc", rounds=1, epochs=3, method_config={"generator_tier": "tiny",
                                                                         "decoder_epochs": k})
        m = fleet.methods()[0]
        order: list[str] = []
        dec = m._decoder_epoch

        def count_dec(dec=dec, order=order) -> float:
            order.append("decoder")
            return dec()

        m._decoder_epoch = count_dec
        fleet.engine.run_round(1)
        assert order == ["decoder"] * k
        assert m.decoder_trained


@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_recon_noise_scales_the_noise_the_decoder_reconstructs_from(scale: float) -> None:
    """v = g(x) + s·σ_k ⊙ ε: every latent the decoder sees lies s σ_k-noise away from a real feature."""
    with pytest.raises(ConfigError, match=r"recon_noise must be a number >= 0"):
        skewed_fleet("fedvtc", rounds=1, method_config={"recon_noise": -0.5})
    fleet = skewed_fleet("fedvtc", rounds=1, epochs=1,
                         method_config={"generator_tier": "tiny", "dm": False, "recon_noise": scale})
    m = fleet.methods()[0]
    fleet.engine.run_round(1)  # sets σ_k
    seen: list[torch.Tensor] = []
    hook = m.decoder.register_forward_pre_hook(lambda _mod, args: seen.append(args[0].detach().clone()))
    m._decoder_epoch()
    hook.remove()
    m.ctx.model.eval()
    with torch.no_grad():
        z = m.ctx.model.features(torch.from_numpy(m.ctx.train.x))  # (N, p): the frozen model's features
    v = torch.cat(seen)
    assert v.shape == z.shape  # one latent per real sample per epoch
    nearest = torch.cdist(v, z).argmin(1)
    resid = (v - z[nearest]) / m.local_sigma.clamp(min=1e-6)  # in units of σ_k per dimension
    if scale == 0:
        assert float(resid.abs().max()) < 1e-4
    else:
        assert abs(float(resid.std()) - scale) < 0.05 * scale + 0.01
        assert len(set(nearest.tolist())) == len(z)  # each real sample reconstructed once
