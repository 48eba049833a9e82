"""Model families: every built-in family at every tier measured, split, shaped and exported; the GeFL CNN
family unchanged; the family contract enforced at load (docs/models.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from fedge.common.archs import GEFL_CHANNELS, TIERS, arch_by_name, gefl_cnn, tier_arch
from fedge.common.families import BUILTIN_TIERS, GEFL_FAMILY, FamilyArch, family_arch, spec_by_name
from fedge.edge.models import FamilyNet, build_family_net, build_model, load_checkpoint, save_checkpoint
from fedge.edge.models.measure import measure
from fedge.errors import ConfigError

# One input per family: MLPerf Tiny's sizes (VWW 96x96, CIFAR-style 32x32, 49x10 MFCCs, 3-axis 128 steps).
INPUTS: dict[str, tuple[int, tuple[int, ...]]] = {
    "mobilenet": (1, (96, 96)), "resnet8": (3, (32, 32)), "dscnn": (1, (49, 10)), "cnn1d": (3, (128,)),
}
CASES = [(f, t) for f in INPUTS for t in BUILTIN_TIERS[f]]


def _arch(family: str, tier: str, classes: int = 10) -> FamilyArch:
    ch, size = INPUTS[family]
    return family_arch(family, tier, in_channels=ch, input_size=size, num_classes=classes)


@pytest.mark.parametrize(("family", "tier"), CASES)
def test_every_builtin_tier_is_measured_split_and_shaped(family: str, tier: str) -> None:
    arch = _arch(family, tier, classes=7)
    net = build_family_net(arch, seed=0)
    assert isinstance(net, FamilyNet) and net.spec is arch
    # parameters: the measured figure is torch's own count, and the state dict's trainable tensors
    assert arch.num_params() == sum(p.numel() for p in net.parameters()) > 0
    assert arch.param_shapes() == {k: tuple(v.shape) for k, v in net.state_dict().items()}
    x = torch.randn(3, *arch.input_shape)
    net.eval()
    stem = net.extractor(x)
    assert tuple(stem.shape[1:]) == arch.stem_shape
    assert net.features(x).shape == (3, 64) and arch.feature_dim == 64
    assert net(x).shape == (3, 7)
    assert torch.allclose(net.from_stem(stem), net(x))
    # the name a device announces resolves to this very record
    assert spec_by_name(arch.name) is arch


@pytest.mark.parametrize("family", list(INPUTS))
def test_tiers_grow_and_share_one_stem(family: str) -> None:
    archs = [_arch(family, t) for t in BUILTIN_TIERS[family]]
    params = [a.num_params() for a in archs]
    assert params == sorted(params) and params[-1] / params[0] >= 8
    assert [a.macs() for a in archs] == sorted(a.macs() for a in archs)
    assert len({a.stem_shape for a in archs}) == 1  # LG-FedAvg / GeFL-F share the stem across tiers


def test_macs_by_hand_for_the_smallest_1d_cnn() -> None:
    a = family_arch("cnn1d", "xs", in_channels=3, input_size=(128,))
    stem = 16 * 64 * 3 * 5  # conv1d 3->16, k5, stride 2: 64 outputs
    block1 = 16 * 64 * 16 * 5  # conv1d 16->16 k5 at 64 steps, then maxpool to 32
    block2 = 32 * 32 * 16 * 5  # conv1d 16->32 k5 at 32 steps
    assert a.macs() == stem + block1 + block2 + 32 * 64 + 64 * 10
    convs_bn = (3 * 16 * 5 + 32) + (16 * 16 * 5 + 32) + (16 * 32 * 5 + 64)  # bias-free convs, BN weight + bias
    assert a.num_params() == convs_bn + (32 * 64 + 64) + (64 * 10 + 10)


def test_macs_by_hand_for_the_smallest_mobilenet_at_96() -> None:
    a = family_arch("mobilenet", "xs", in_channels=1, input_size=(96, 96))
    side, cin, total = 48, 8, 8 * 48 * 48 * 1 * 9  # stem conv 3x3/2 to 8 channels
    for base, stride in ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)):
        side //= stride
        cout = max(8, base // 8)
        total += cin * side * side * 9 + cout * cin * side * side  # depthwise 3x3, pointwise 1x1
        cin = cout
    assert a.macs() == total + cin * 64 + 64 * 10


def test_a_96x96_network_costs_more_than_a_32x32_one() -> None:
    big = family_arch("mobilenet", "s", in_channels=1, input_size=(96, 96))
    small = family_arch("mobilenet", "s", in_channels=1, input_size=(32, 32))
    assert big.num_params() == small.num_params()  # global pooling: the weights do not depend on the size
    assert big.macs() > 8 * small.macs() and big.activation_elems() > 8 * small.activation_elems()
    assert (big.name, small.name) == ("mobilenet-s-96", "mobilenet-s-32")


@pytest.mark.parametrize(("family", "tier"), CASES)
def test_onnx_export_matches_pytorch(family: str, tier: str, tmp_path: Path) -> None:
    from fedge.export.onnx_export import torch_to_onnx

    arch = _arch(family, tier)
    net = build_family_net(arch, seed=1).eval()
    x = torch.randn(4, *arch.input_shape, generator=torch.Generator().manual_seed(0))
    path = torch_to_onnx(net, x[:2], tmp_path / "m.onnx", input_name="input", output_name="logits")
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = net(x).numpy()
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_family_checkpoint_round_trip(tmp_path: Path) -> None:
    arch = _arch("resnet8", "xs")
    net = build_family_net(arch, seed=3)
    loaded = load_checkpoint(save_checkpoint(net, tmp_path / "r.safetensors"), expect=FamilyNet)
    assert loaded.spec == arch
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), loaded.state_dict().values(), strict=True))


# -- the GeFL CNN family: the published protocol's networks, unchanged ------------------------------------
GEFL_NAMES = [f"cnn{k}" for k in GEFL_CHANNELS] + ["cnn3-nobn", "cnn3-p64"] + [f"tier-{t}" for t in TIERS]


@pytest.mark.parametrize("name", GEFL_NAMES)
def test_gefl_family_formulas_equal_the_measured_network(name: str) -> None:
    spec = arch_by_name(name)
    m = measure(build_model(spec), (1, 32, 32))
    assert (m.params, m.macs, m.activation_elems) == (spec.num_params(), spec.macs(), spec.activation_elems())
    assert dict(m.param_shapes) == spec.param_shapes()
    assert m.stem_shape == spec.stem_shape and m.feature_dim == spec.feature_dim


def test_gefl_family_weights_are_bit_identical_to_before_families() -> None:
    # sha256 over (key, seeded initial tensor) of every GeFL CNN and tier, taken before the family interface
    # existed (commit 92ac8be): same modules, same order, same initial weights.
    h = hashlib.sha256()
    for name in GEFL_NAMES:
        for k, v in build_model(name, seed=0).state_dict().items():
            h.update(k.encode())
            h.update(v.numpy().tobytes())
    assert h.hexdigest() == "e8be0dcd3caeb91dd09adc7852956b6fabee7223a88f124bfac9c99ad30aeecf"
    assert BUILTIN_TIERS[GEFL_FAMILY] == TIERS and gefl_cnn(1).num_params() == 10766
    assert spec_by_name("tier-m") == tier_arch("m")


# -- the contract -------------------------------------------------------------------------------------------
GOOD = '''
from torch import nn
TIERS = ("s", "m")

class Net(nn.Module):
    def __init__(self, width, cin, classes, p):
        super().__init__()
        self.extractor = nn.Sequential(nn.Conv2d(cin, 4, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(4, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.embed = nn.Linear(width, p)
        self.head = nn.Linear(p, classes)

def build(tier, in_channels, input_size, num_classes, embed_dim):
    return Net({"s": 8, "m": 16}[tier], in_channels, num_classes, embed_dim)
'''

BROKEN = {
    "missing split": (GOOD.replace("self.embed = nn.Linear(width, p)", "self.emb = nn.Linear(width, p)")
                      .replace("self.head = nn.Linear(p, classes)",
                               "self.head = nn.Linear(p, classes); self.embed = 3"),
                      "declares no embed (missing split)", "set self.extractor, self.body, self.embed and self.head"),
    "wrong embedding": (GOOD.replace("nn.Linear(width, p)", "nn.Linear(width, 5)").replace("nn.Linear(p, classes)",
                                                                                          "nn.Linear(5, classes)"),
                        "embed outputs (2, 5), not (batch, 64)", "make embed output embed_dim features"),
    "wrong logits": (GOOD.replace("nn.Linear(p, classes)", "nn.Linear(p, 3)"),
                     "forward gives (2, 3), not (batch, 10) logits", "map embed_dim features to num_classes"),
    "forward fails": (GOOD.replace("nn.Conv2d(cin, 4", "nn.Conv2d(cin + 2, 4"),
                      "forward on an input of shape (2, 1, 32, 32) fails", "check the layers' channel counts"),
    "own forward": (GOOD.replace("        self.head = nn.Linear(p, classes)\n",
                                 "        self.head = nn.Linear(p, classes)\n\n    def forward(self, x):\n"
                                 "        return self.head(self.embed(self.body(self.extractor(x)))) * 2\n"),
                    "its forward differs from head(embed(body(extractor(x))))", "move any extra step into one of"),
    "no tiers": (GOOD.replace('TIERS = ("s", "m")', ""), "declares no tiers", 'set TIERS = ("s", "m", "l")'),
    "not onnx": (GOOD.replace("class Net", '''
import torch
class MatrixExp(nn.Module):  # no ONNX operator for it
    def forward(self, x):
        return torch.linalg.matrix_exp(x * 0.01)

class Net''').replace("nn.Conv2d(cin, 4, 3, padding=1), nn.ReLU()", "nn.Conv2d(cin, 4, 3, padding=1), MatrixExp()"),
                 "does not export to ONNX", "use layers ONNX has operators for"),
}


def _family(tmp_path: Path, source: str, name: str = "my_family") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return f"{path}:build"


def test_a_users_family_from_a_file_is_measured_like_a_builtin(tmp_path: Path) -> None:
    fam = _family(tmp_path, GOOD)
    a = family_arch(fam, "m", in_channels=1, input_size=(32, 32))
    assert a.name == "my_family-m-32" and a.stem_shape == (4, 32, 32)
    assert a.num_params() == (4 * 9 + 4) + (16 * 4 * 9 + 16) + (16 * 64 + 64) + (64 * 10 + 10)
    assert a.macs() == 32 * 32 * (4 * 9 + 16 * 4 * 9) + 16 * 64 + 64 * 10


@pytest.mark.parametrize("case", list(BROKEN))
def test_contract_violations_are_refused_naming_the_fix(case: str, tmp_path: Path) -> None:
    source, what, fix = BROKEN[case]
    fam = _family(tmp_path, source, name=f"fam_{case.replace(' ', '_')}")
    with pytest.raises(ConfigError) as err:
        family_arch(fam, "s", in_channels=1, input_size=(32, 32))
    assert what in str(err.value) and fix in (err.value.hint or "")


def test_unknown_family_and_tier_name_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a built-in family") as err:
        family_arch("mobilenett", "s", in_channels=1, input_size=(32, 32))
    assert "mobilenet" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="has no tier 'xxl'"):
        family_arch("resnet8", "xxl", in_channels=1, input_size=(32, 32))
    with pytest.raises(ConfigError, match="does not exist"):
        family_arch(f"{tmp_path}/nope.py:build", "s", in_channels=1, input_size=(32, 32))
