"""Generators, GeFL and GeFL-F: specs, checkpoints, phases, aggregation, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fleet_helpers import capture_uploads
from generative_helpers import skewed_fleet

from fedge.common.generators import GeneratorSpec, generatable
from fedge.common.rounds import (
    EXTRACTOR_ARTIFACT,
    GENERATOR_PREFIX,
    DeviceInfo,
    RoundInfo,
    generator_artifact,
)
from fedge.coordinator.validation import Rejected, check_arrays
from fedge.edge.generators.grid import write_sample_grids
from fedge.edge.generators.modules import build_generator, load_generator
from fedge.edge.methods.base import model_arrays
from fedge.edge.models.checkpoint import load_checkpoint, save_checkpoint
from fedge.errors import CheckpointError, ConfigError
from fedge.fleet.registry import method_entry

SHAPES = {"image": (1, 32, 32), "feature": (3, 16, 16)}


# The VTC decoder only produces images, the DDPM only features.
KIND_LEVELS = [("cvae", "image"), ("cvae", "feature"), ("dcgan", "image"), ("dcgan", "feature"),
               ("ddpm", "feature"), ("vtc", "image")]


@pytest.mark.parametrize(("kind", "level"), KIND_LEVELS)
@pytest.mark.parametrize("tier", ["tiny", "small"])
def test_spec_shapes_match_torch_modules(kind: str, tier: str, level: str) -> None:
    spec = GeneratorSpec(kind, SHAPES[level], tier=tier, latent_dim=32 if kind == "vtc" else 0)
    gen = build_generator(spec)
    assert {k: tuple(v.shape) for k, v in gen.state_dict().items()} == spec.param_shapes()
    assert sum(p.numel() for p in gen.parameters()) == spec.num_params()
    if kind != "vtc":
        out = gen.sample(torch.tensor([0, 3, 9]), torch.Generator().manual_seed(0))
        assert tuple(out.shape) == (3, *SHAPES[level])
        assert bool(torch.isfinite(out).all())


def test_only_square_power_of_two_shapes_are_generatable() -> None:
    assert generatable((1, 32, 32)) and generatable((3, 16, 16)) and generatable((16, 8, 8))
    for shape in ((32, 25, 5), (3, 16, 8), (3, 12, 12), (3, 4, 4), (0, 16, 16), (16, 64), (1, 1, 16, 16)):
        assert not generatable(shape), shape
    with pytest.raises(ConfigError, match="generator output \\(32, 25, 5\\) is not \\(C, S, S\\)"):
        GeneratorSpec("cvae", (32, 25, 5))


def test_paper_tier_has_the_published_sizes() -> None:
    # methods.md: CVAE at 32x32 ~22 M parameters, DCGAN ~3 M + 2.6 M, CVAE-F ~5.5 M.
    assert 21e6 < GeneratorSpec("cvae", (1, 32, 32), tier="paper").num_params() < 23e6
    assert 5.3e6 < GeneratorSpec("dcgan", (1, 32, 32), tier="paper").num_params() < 6.0e6
    assert 5.2e6 < GeneratorSpec("cvae", (3, 16, 16), tier="paper").num_params() < 5.8e6
    # tiers get smaller
    sizes = [GeneratorSpec("cvae", (1, 32, 32), tier=t).num_params() for t in ("tiny", "small", "paper")]
    assert sizes == sorted(sizes) and sizes[2] > 50 * sizes[0]


def test_generator_checkpoint_round_trips(tmp_path) -> None:
    for spec in (GeneratorSpec("cvae", (1, 32, 32), tier="tiny"), GeneratorSpec("dcgan", (3, 16, 16), tier="tiny"),
                 GeneratorSpec("ddpm", (3, 16, 16), tier="tiny")):
        gen = build_generator(spec, seed=3)
        with torch.no_grad():  # move running statistics away from their defaults so they are checked too
            for name, buf in gen.named_buffers():
                if name.endswith("running_mean"):
                    buf.uniform_(-1, 1)
        path = save_checkpoint(gen, tmp_path / f"{spec.kind}.safetensors")
        back = load_checkpoint(path)
        assert type(back) is type(gen) and back.spec == spec
        for k, v in gen.state_dict().items():
            assert torch.equal(v, back.state_dict()[k]), k
        labels = torch.arange(10)
        gen.eval()
        back.eval()
        a = gen.sample(labels, torch.Generator().manual_seed(1))
        b = back.sample(labels, torch.Generator().manual_seed(1))
        assert torch.equal(a, b)


def test_generator_checkpoint_for_the_wrong_shape_is_refused(tmp_path) -> None:
    feat = build_generator(GeneratorSpec("cvae", (3, 16, 16), tier="tiny"))
    path = save_checkpoint(feat, tmp_path / "feature-cvae.safetensors")
    want = GeneratorSpec("cvae", (1, 32, 32), tier="tiny")
    with pytest.raises(CheckpointError, match=r"\(3, 16, 16\).*needs a cvae generator for \(1, 32, 32\)"):
        load_generator(path, expect=want)
    # ... and a GeFL device configured with it fails at start-up with the same error
    with pytest.raises(CheckpointError, match="needs a cvae generator"):
        skewed_fleet("gefl", rounds=2, method_config={"gen_rounds": 1, "generator_tier": "tiny",
                                                      "generator_checkpoint": str(path)})
    # weights that do not fit the stored architecture are refused by the checkpoint loader
    tensors = {k: v.clone() for k, v in feat.state_dict().items()}
    tensors["mu.weight"] = torch.zeros(3, 3)
    import safetensors.torch

    from fedge.edge.models.checkpoint import read_checkpoint_meta

    bad = tmp_path / "bad.safetensors"
    safetensors.torch.save_file(tensors, str(bad), metadata=read_checkpoint_meta(path))
    with pytest.raises(CheckpointError, match="wrong shapes"):
        load_generator(bad)


def test_generator_tier_comes_from_the_plan_and_method_overrides_it() -> None:
    fleet = skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1}, plan={"generator_tier": "tiny"})
    assert {m.gen_tier for m in fleet.methods()} == {"tiny"}
    fleet = skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1, "generator_tier": "small"},
                         plan={"generator_tier": "tiny"})
    assert {m.gen_tier for m in fleet.methods()} == {"small"}
    with pytest.raises(ConfigError, match="no generator tier"):
        skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1}, plan={"generator_tier": "none"})
    with pytest.raises(ConfigError, match="leaves no target rounds"):
        method_entry("gefl").build_strategy({"gen_rounds": 5}, num_classes=10, rounds=5)


def test_gefl_averages_the_generator_over_all_devices_then_trains_targets() -> None:
    cfg = {"gen_rounds": 1, "generator_tier": "tiny", "gen_epochs": 1}
    fleet = skewed_fleet("gefl", rounds=2, method_config=cfg, epochs=1)
    uploads: dict[str, dict[str, np.ndarray]] = {}
    strat = fleet.engine.strategy
    orig = strat.accumulate

    def spy(device, arrays, info, *at):
        uploads[device.device_id] = dict(arrays)
        orig(device, arrays, info, *at)

    strat.accumulate = spy  # type: ignore[method-assign]
    rep = fleet.engine.run_round(1)
    assert rep.phase == "generator" and not rep.rejected and len(rep.accepted) == 4
    art = generator_artifact("cvae", "tiny", "image")
    glob = fleet.engine.globals[art]
    spec = GeneratorSpec("cvae", (1, 32, 32), tier="tiny")
    names = {GENERATOR_PREFIX + k for k in spec.upload_shapes()}
    assert {GENERATOR_PREFIX + k for k in glob} == names == set(uploads["d0"])
    n = {a.device.device_id: a.device.num_samples for a in fleet.agents}
    for name in ("enc.0.weight", "dec_in.bias", "enc.1.running_var"):
        expected = sum(n[d] * uploads[d][GENERATOR_PREFIX + name].astype(np.float64) for d in n) / sum(n.values())
        np.testing.assert_allclose(glob[name], expected, rtol=1e-5, atol=1e-7)
    # target round: every device loads the average, trains its own net, shares the extractor (LG-FedAvg)
    before = [model_arrays(m.ctx.model) for m in fleet.methods()]
    rep = fleet.engine.run_round(2)
    assert rep.phase == "target" and not rep.rejected
    assert all("syn_loss" in rep.info[d] for d in n)  # one synthetic epoch happened
    for m, b in zip(fleet.methods(), before, strict=True):
        assert m.generator_loaded
        np.testing.assert_array_equal(model_arrays(m.generator)["enc.0.weight"], glob["enc.0.weight"])
        assert not np.array_equal(model_arrays(m.ctx.model)["head.weight"], b["head.weight"])
    assert EXTRACTOR_ARTIFACT in fleet.engine.globals


def test_generator_upload_of_the_wrong_tier_is_rejected() -> None:
    strat = method_entry("gefl").build_strategy({"gen_rounds": 2, "generator_tier": "tiny"}, num_classes=10, rounds=3)
    dev = DeviceInfo("d0", "cnn3-p32", "test", num_samples=10, feature_dim=32)
    small = build_generator(GeneratorSpec("cvae", (1, 32, 32), tier="small"))
    arrays = {GENERATOR_PREFIX + k: v for k, v in model_arrays(small).items()}
    with pytest.raises(Rejected, match="shape"):
        check_arrays(arrays, strat.expected_update(dev, 1), "d0")
    tiny = build_generator(GeneratorSpec("cvae", (1, 32, 32), tier="tiny"))
    check_arrays({GENERATOR_PREFIX + k: v for k, v in model_arrays(tiny).items()}, strat.expected_update(dev, 1), "d0")


def test_geflf_freezes_the_averaged_extractor_and_trains_heads_on_features(tmp_path) -> None:
    cfg = {"warmup_rounds": 1, "gen_rounds": 1, "generator_tier": "tiny", "gen_epochs": 1}
    fleet = skewed_fleet("geflf", rounds=3, method_config=cfg, epochs=1)
    uploads = capture_uploads(fleet.agents)
    phases = [fleet.engine.run_round(r).phase for r in (1, 2, 3)]
    assert phases == ["warmup", "generator", "head"]
    ext = fleet.engine.globals[EXTRACTOR_ARTIFACT]
    fleet.engine.run_round(4)  # final: apply + evaluate
    for m in fleet.methods():
        mine = model_arrays(m.ctx.model, ["extractor."])
        for k, v in ext.items():
            np.testing.assert_array_equal(mine[k], v)  # frozen at the warm-up average
        assert m.generator_loaded and m.gen_spec.out_shape == (3, 16, 16)
    # head-phase uploads carry no extractor and no generator: the rest of each model's weights only
    rep = fleet.engine.reports[2]
    assert not rep.rejected and len(rep.accepted) == 4
    by_round = {r: {u.msg.sender: set(u.msg.tensors) for u in uploads if u.msg.round == r} for r in (1, 3)}
    for m in fleet.methods():
        own = set(model_arrays(m.ctx.model))
        extractor = {k for k in own if k.startswith("extractor.")}
        assert extractor and extractor <= by_round[1][m.ctx.device_id]  # the warm-up shares the extractor
        head = by_round[3][m.ctx.device_id]
        assert head and head <= own - extractor, sorted(head - (own - extractor))
        assert not any(k.startswith(GENERATOR_PREFIX) for k in head)
    grids = write_sample_grids(fleet.methods(), tmp_path, per_class=2)
    assert [g.name for g in grids] == [generator_artifact("cvae", "tiny", "feature") + ".png"]
    ckpt = tmp_path / "checkpoints" / "generators" / (generator_artifact("cvae", "tiny", "feature") + ".safetensors")
    assert load_generator(ckpt).spec.out_shape == (3, 16, 16)


def test_gefl_rounds_are_deterministic() -> None:
    cfg = {"gen_rounds": 1, "generator_tier": "tiny", "gen_epochs": 1}
    glob = []
    for _ in range(2):
        fleet = skewed_fleet("gefl", rounds=2, method_config=cfg, epochs=1)
        fleet.engine.run_round(1)
        fleet.engine.run_round(2)
        glob.append(fleet.engine.globals)
    for art, arrays in glob[0].items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(v, glob[1][art][k])


def test_method_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="generator must be"):
        skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1, "generator": "ddpm"})
    with pytest.raises(ConfigError, match="gen_epochs"):
        skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1, "gen_epochs": "5"})
    # a zero learning rate would silently freeze the generator
    with pytest.raises(ConfigError, match=r"gen_lr must be a number > 0, got 0"):
        skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1, "gen_lr": 0})
    _ = RoundInfo  # (imported for type context)


def test_generator_upload_bytes_follow_the_upload_precision() -> None:
    """The engine counts encoded bytes: a tiny CVAE (0.36 M floats) costs ~4/2/1 bytes a float."""
    cfg = {"gen_rounds": 1, "generator_tier": "tiny", "gen_epochs": 1}
    spec = GeneratorSpec("cvae", (1, 32, 32), tier="tiny")
    floats = sum(int(np.prod(s)) for s in spec.upload_shapes().values())
    per_float = {}
    for precision in ("fp32", "fp16", "int8"):
        fleet = skewed_fleet("gefl", rounds=2, method_config=cfg, epochs=1, precision=precision,
                             archs=("cnn3-p32", "cnn1-p32"))
        rep = fleet.engine.run_round(1)
        assert not rep.rejected
        per_float[precision] = max(rep.bytes_up.values()) / floats
    assert 4.0 <= per_float["fp32"] < 4.1
    assert 2.0 <= per_float["fp16"] < 2.1
    assert 1.0 <= per_float["int8"] < 1.1


# -- DDPM-F --------------------------------------------------------------------------------
def test_ddpm_is_feature_level_only() -> None:
    with pytest.raises(ConfigError, match="feature-level only"):
        GeneratorSpec("ddpm", (1, 32, 32))
    with pytest.raises(ConfigError, match="generator must be one of cvae, dcgan, got 'ddpm'") as err:
        skewed_fleet("gefl", rounds=3, method_config={"gen_rounds": 1, "generator": "ddpm"})
    assert 'method = "geflf"' in str(err.value.hint)
    with pytest.raises(ConfigError, match="ddpm_steps must be an integer >= 1"):
        skewed_fleet("geflf", rounds=4, method_config={"generator": "ddpm", "warmup_rounds": 1, "gen_rounds": 1,
                                                       "ddpm_steps": 0})


def toy_features(n_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-negative 3x16x16 maps: class c is a fixed random pattern plus noise, like stem features."""
    rng = np.random.default_rng(seed)
    means = rng.uniform(0, 2, (10, 3, 16, 16)).astype(np.float32)
    y = np.repeat(np.arange(10), n_per_class)
    x = np.maximum(means[y] + 0.2 * rng.standard_normal((len(y), 3, 16, 16)).astype(np.float32), 0)
    return x, y, means


def test_cvae_kl_weight_scales_only_the_kl_term() -> None:
    """β-VAE loss: sum-MSE + β·KL. One full batch from the same weights and noise, so the reported
    loss is linear in β: β = 0.5 sits halfway between β = 0 (reconstruction only) and β = 1 (GeFL)."""
    from fedge.edge.generators.train import GeneratorTrainer

    x, y, _ = toy_features(4, seed=0)

    def first_loss(beta: float) -> float:
        gen = build_generator(GeneratorSpec("cvae", (3, 16, 16), tier="tiny"), seed=0)
        return GeneratorTrainer(gen, kl_weight=beta).fit(x, y, epochs=1, batch_size=len(y),
                                                         rng=np.random.default_rng(0),
                                                         gen=torch.Generator().manual_seed(0))

    rec, half, full = first_loss(0.0), first_loss(0.5), first_loss(1.0)
    assert full > rec  # the KL term of an untrained encoder is positive
    assert half == pytest.approx((rec + full) / 2, rel=1e-5)


@pytest.mark.slow
def test_ddpm_learns_class_conditional_features() -> None:
    from fedge.edge.generators.train import GeneratorTrainer, sample_dataset

    x, y, means = toy_features(64, seed=0)
    gen = build_generator(GeneratorSpec("ddpm", (3, 16, 16), tier="small"), seed=0)
    before = sample_dataset(gen, 200, np.arange(10), torch.Generator().manual_seed(1))
    # 400 steps (the default lr 1e-3 needs ~3x more: it learns the same, slower)
    loss = GeneratorTrainer(gen, lr=3e-3).fit(x, y, epochs=20, batch_size=32, rng=np.random.default_rng(0),
                                              gen=torch.Generator().manual_seed(0))
    assert np.isfinite(loss) and loss < 0.6  # mean over the epochs; ε-prediction MSE starts at ~1
    # the running data statistics found the data's scale
    np.testing.assert_allclose(gen.state_dict()["data_norm.running_mean"].numpy(), x.mean(axis=(0, 2, 3)), rtol=0.05)
    xs, ys = sample_dataset(gen, 200, np.arange(10), torch.Generator().manual_seed(1))
    assert xs.shape == (200, 3, 16, 16) and xs.min() >= 0 and np.isfinite(xs).all()

    def nearest_class_rate(samples: np.ndarray, labels: np.ndarray) -> float:
        d = ((samples[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
        return float((d.argmin(axis=1) == labels).mean())

    # every sample lies nearest its own class's pattern; before training, chance (~0.1)
    assert nearest_class_rate(xs, ys) >= 0.9
    assert nearest_class_rate(*before) <= 0.3
    # and its class mean is much closer to the truth than the gap between classes (~1.15 per value)
    err = np.mean([np.sqrt(((xs[ys == c].mean(axis=0) - means[c]) ** 2).mean()) for c in range(10)])
    assert err < 0.5, err


def test_geflf_with_ddpm_averages_the_denoiser_and_samples_features(tmp_path) -> None:
    cfg = {"generator": "ddpm", "warmup_rounds": 1, "gen_rounds": 1, "generator_tier": "tiny", "gen_epochs": 1,
           "ddpm_steps": 5, "ddpm_guidance": 2.0}
    fleet = skewed_fleet("geflf", rounds=3, method_config=cfg, epochs=1)
    assert all((m.generator.sample_steps, m.generator.guidance) == (5, 2.0) for m in fleet.methods())
    assert fleet.engine.run_round(1).phase == "warmup"
    rep = fleet.engine.run_round(2)
    assert rep.phase == "generator" and not rep.rejected and len(rep.accepted) == 4
    glob = fleet.engine.globals[generator_artifact("ddpm", "tiny", "feature")]
    # the upload is exactly the spec's: weights plus the running data statistics, averaged
    assert set(glob) == set(GeneratorSpec("ddpm", (3, 16, 16), tier="tiny").upload_shapes())
    assert "data_norm.running_var" in glob and not np.allclose(glob["data_norm.running_var"], 1.0)
    rep = fleet.engine.run_round(3)
    assert rep.phase == "head" and not rep.rejected
    assert all("syn_loss" in info for info in rep.info.values())
    # the sample grid and checkpoint work as for the other generators
    grids = write_sample_grids(fleet.methods(), tmp_path, per_class=2)
    assert [g.name for g in grids] == [generator_artifact("ddpm", "tiny", "feature") + ".png"]
    ckpt = tmp_path / "checkpoints" / "generators" / (generator_artifact("ddpm", "tiny", "feature") + ".safetensors")
    back = load_generator(ckpt, expect=GeneratorSpec("ddpm", (3, 16, 16), tier="tiny"))
    np.testing.assert_array_equal(model_arrays(back)["data_norm.running_var"], glob["data_norm.running_var"])
