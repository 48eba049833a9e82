"""The model zoo: GeFL CNN layer sizes, the extractor/body/embed/head split, tiers, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedge.common.archs import GEFL_CHANNELS, TIERS, arch_by_name, gefl_cnn, tier_arch
from fedge.edge.models import build_model, load_checkpoint, save_checkpoint
from fedge.errors import CheckpointError, ConfigError

# Linear input sizes published for CNN-1 ... CNN-10 (methods.md).
PUBLISHED_LINEAR_IN = {1: 1024, 2: 512, 3: 640, 4: 320, 5: 256, 6: 320, 7: 160, 8: 128, 9: 100, 10: 80}


@pytest.mark.parametrize("k", range(1, 11))
def test_gefl_cnn_matches_published_layers(k: int) -> None:
    spec = gefl_cnn(k)
    model = build_model(spec)
    convs = [m for m in model.body if isinstance(m, torch.nn.Conv2d)]
    assert tuple(c.out_channels for c in convs) == GEFL_CHANNELS[k]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.body) == len(convs)
    assert model.head.in_features == PUBLISHED_LINEAR_IN[k] and model.head.out_features == 10
    assert isinstance(model.embed, torch.nn.Identity)
    # the shared stem: 1x32x32 -> 3x16x16
    assert model.extractor(torch.zeros(2, 1, 32, 32)).shape == (2, 3, 16, 16)
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    n_torch = sum(p.numel() for p in model.parameters())
    assert n_torch == spec.num_params()
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == spec.param_shapes()


def test_gefl_cnn_parameter_counts() -> None:
    # Hand count for CNN-1: stem conv 30 + BN 6, conv 3->16 448 + BN 32, linear 1024*10+10.
    assert gefl_cnn(1).num_params() == 30 + 6 + 448 + 32 + 10250
    assert gefl_cnn(1, batchnorm=False).num_params() == 30 + 6 + 448 + 10250
    counts = [gefl_cnn(k).num_params() for k in range(1, 11)]
    assert min(counts) == gefl_cnn(4).num_params() and max(counts) == gefl_cnn(9).num_params()


def test_nobn_variant_has_no_batchnorm_in_body() -> None:
    model = build_model("cnn5-nobn")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.body)


def test_shared_embedding_gives_common_feature_dim() -> None:
    dims = {build_model(f"cnn{k}-p64").features(torch.zeros(1, 1, 32, 32)).shape[1] for k in range(1, 11)}
    assert dims == {64}
    assert {tier_arch(t).feature_dim for t in TIERS} == {64}


def test_tiers_span_twenty_times_and_grow() -> None:
    params = [tier_arch(t).num_params() for t in TIERS]
    assert params == sorted(params)
    assert params[-1] / params[0] >= 20


def test_macs_of_cnn1_by_hand() -> None:
    stem = 3 * 1 * 9 * 32 * 32
    conv = 16 * 3 * 9 * 16 * 16
    assert gefl_cnn(1).macs() == stem + conv + 10 * 1024


def test_unknown_architecture_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="unknown architecture 'resnet18'") as e:
        arch_by_name("resnet18")
    assert "cnn1 ... cnn10" in (e.value.hint or "")
    with pytest.raises(ConfigError, match="no CNN-11"):
        arch_by_name("cnn11")


def test_checkpoint_round_trip_without_knowing_the_class(tmp_path: Path) -> None:
    model = build_model("cnn3-p32", seed=1)
    path = save_checkpoint(model, tmp_path / "m.safetensors")
    loaded = load_checkpoint(path)
    assert loaded.spec == model.spec
    x = torch.randn(4, 1, 32, 32)
    model.eval()
    loaded.eval()
    torch.testing.assert_close(loaded(x), model(x))


def test_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a safetensors checkpoint"):
        load_checkpoint(bad)


def test_loading_state_of_another_architecture_names_keys(tmp_path: Path) -> None:
    from fedge.edge.models.checkpoint import load_state

    src = build_model("cnn1")
    dst = build_model("cnn2")
    with pytest.raises(CheckpointError, match=r"wrong shapes|missing keys"):
        load_state(dst, src.state_dict(), source="cnn1.safetensors")
