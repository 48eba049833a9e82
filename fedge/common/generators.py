"""Generator architectures as plain data (no torch), so the coordinator can check shapes.

Like :mod:`fedge.common.archs` for the model zoo: the coordinator validates
uploaded generator weights against :meth:`GeneratorSpec.param_shapes` without
importing torch, and the device's :mod:`fedge.edge.generators.modules` builds the torch
modules from the same spec (a test checks that the two agree).

Three kinds, every convolution 4×4 with stride 2 and padding 1 (each halves or
doubles the side), as in the GeFL code:

* ``cvae``: conditional VAE. Encoder: the input plus one constant plane per
  class (one-hot), ``log2(S)`` strided convs with BN+ReLU down to 1×1, channels
  ``w, 2w, 4w, ...``, then linear layers to the mean and log-variance of a
  ``latent_dim`` Gaussian. Decoder: ``Linear(latent + classes → top)``, then the
  mirrored transposed convs. With ``w = 64`` and a 1×32×32 output this is the
  published GeFL CVAE (64 → 1024 channels, latent 16, ≈ 22 M parameters); on the
  3×16×16 extractor output (one level fewer) it is ≈ 5.5 M parameters, the
  published CVAE-F size.
* ``dcgan``: conditional DCGAN (generator *and* discriminator; GeFL averages
  both). Generator: noise and one-hot label each through ``ConvT(·, 4, 1, 0)``
  to 4×4, concatenated, then strided transposed convs halving the channels up
  to the output side. Discriminator: image and label planes each through a
  strided conv, concatenated, strided convs with BN doubling the channels down
  to 4×4, then ``Conv(·→1, 4, 1, 0)``. With ``w = 128`` and 1×32×32 this is the
  published GeFL DCGAN (≈ 3.1 M + 2.6 M parameters, noise 100).
* ``ddpm``: a class-conditional denoising diffusion model with classifier-free
  guidance (GeFL's DDPM; GeFL-F's DDPM-F), **feature level only** (3×16×16 and
  other small maps; at 32×32 its full-resolution activations would exceed the
  tiers' memory allowances). Denoiser: a two-level U-Net — ``Conv3×3(2C → w)`` on
  the noisy sample and a learned per-class map of the same shape (convolutions
  alone cannot place class-specific structure),
  a strided conv down to S/2 with ``2w`` channels, two residual blocks there,
  a transposed conv back up, concatenated with the first conv's output, one
  residual block to ``w`` and ``Conv3×3(w → C)``; residual blocks are GroupNorm,
  SiLU, 3×3 conv, plus a projection of the time + class embedding (``4w``).
  Per-channel running mean and variance of the data (``data_norm``, averaged
  like BN statistics) map samples to and from the unit scale the diffusion assumes.
  GeFL publishes no DDPM-F size; ``paper`` is fedge's choice (w = 32), ``small``
  and ``tiny`` are ¼ and ⅛ of it, which keeps their saved activations (≈ 5.3k × w
  per sample, mostly at full resolution) within the tiers' memory allowances.
* ``vtc``: FedVTC's variational transposed-convolution decoder ψ:
  ``Linear(p → 4w·4·4)``, then transposed convs with BN+ReLU up to the image.
  FedVTC publishes no sizes; ``paper`` is fedge's choice (w = 64).

Tiers trade quality for cost: ``paper`` (published sizes), ``small``
(¼ of the paper width: 1/16 of the parameters and MACs) and ``tiny`` (⅛ width),
which a Raspberry Pi trains in seconds per round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedge.common.archs import trainable_params
from fedge.errors import ConfigError

GENERATOR_KINDS: tuple[str, ...] = ("cvae", "dcgan", "ddpm", "vtc")
GENERATOR_TIERS: tuple[str, ...] = ("tiny", "small", "paper")
DEFAULT_GENERATOR_TIER = "small"
# What a generator generates: the model's input images (GeFL, FedVTC) or the stem's feature maps (GeFL-F).
IMAGE_LEVEL = "image"
FEATURE_LEVEL = "feature"

# Base width w per kind and tier. "paper": the published GeFL sizes (CVAE 64, DCGAN d = 128).
TIER_WIDTH: dict[str, dict[str, int]] = {
    "cvae": {"tiny": 8, "small": 16, "paper": 64},
    "dcgan": {"tiny": 16, "small": 32, "paper": 128},
    "ddpm": {"tiny": 4, "small": 8, "paper": 32},  # sized to the tiers' activation allowances
    "vtc": {"tiny": 16, "small": 32, "paper": 64},
}
# The diffusion: a cosine noise schedule over this many steps (Nichol & Dhariwal 2021); sampling
# takes a DDIM subsequence of them (``[method] ddpm_steps``).
DDPM_TRAIN_STEPS = 1000
DDPM_MAX_SIDE = 16  # feature maps only: see the module docstring

# Latent size: CVAE 16 (GeFL, MNIST/FMNIST), DCGAN noise 100 (GeFL); VTC's input is the feature size p.
DEFAULT_LATENT = {"cvae": 16, "dcgan": 100}


def gn_groups(channels: int) -> int:
    """GroupNorm groups of a DDPM layer: 8 when they divide the channels, else one."""
    return 8 if channels % 8 == 0 else 1


def _log2(n: int) -> int:
    k = n.bit_length() - 1
    return k if n > 0 and 1 << k == n else -1


def generatable(shape: tuple[int, ...]) -> bool:
    """Whether a generator can produce samples of ``shape``: (C, S, S) with S a power of two >= 8."""
    return len(shape) == 3 and shape[0] >= 1 and shape[1] == shape[2] and _log2(shape[1]) >= 3


class _ShapeBook:
    """State-dict shapes as torch's layers name them, written layer by layer (the specs' ``param_shapes``)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}

    def conv(self, name: str, cin: int, cout: int, transposed: bool = False, size: int = 4) -> None:
        self.shapes[f"{name}.weight"] = (cin, cout, size, size) if transposed else (cout, cin, size, size)
        self.shapes[f"{name}.bias"] = (cout,)

    def bn(self, name: str, ch: int) -> None:
        for p in ("weight", "bias", "running_mean", "running_var"):
            self.shapes[f"{name}.{p}"] = (ch,)
        self.shapes[f"{name}.num_batches_tracked"] = ()

    def linear(self, name: str, cin: int, cout: int) -> None:
        self.shapes[f"{name}.weight"] = (cout, cin)
        self.shapes[f"{name}.bias"] = (cout,)

    def resblock(self, name: str, cin: int, cout: int, emb: int) -> None:
        for norm, ch in (("n1", cin), ("n2", cout)):
            self.shapes[f"{name}.{norm}.weight"] = (ch,)
            self.shapes[f"{name}.{norm}.bias"] = (ch,)
        self.conv(f"{name}.c1", cin, cout, size=3)
        self.linear(f"{name}.emb", emb, cout)
        self.conv(f"{name}.c2", cout, cout, size=3)
        if cin != cout:
            self.conv(f"{name}.skip", cin, cout, size=1)

    def up_stack(self, name: str, up: list[int], c_out: int) -> None:
        """``[convT, bn, relu] * (len(up) - 1) + [convT]`` from ``up[0]`` channels to ``c_out``."""
        for i in range(len(up) - 1):
            self.conv(f"{name}.{3 * i}", up[i], up[i + 1], transposed=True)
            self.bn(f"{name}.{3 * i + 1}", up[i + 1])
        self.conv(f"{name}.{3 * (len(up) - 1)}", up[-1], c_out, transposed=True)


@dataclass(frozen=True)
class GeneratorSpec:
    """Everything needed to build (and size) one conditional generator."""

    kind: str
    out_shape: tuple[int, int, int]  # (C, H, W) of the samples
    tier: str = DEFAULT_GENERATOR_TIER
    num_classes: int = 10
    latent_dim: int = 0  # 0: the kind's default (VTC: must be given, it is p)
    width: int = 0  # 0: the tier's width

    def __post_init__(self) -> None:
        if self.kind not in GENERATOR_KINDS:
            raise ConfigError(f"unknown generator kind {self.kind!r}", hint=f"use one of {', '.join(GENERATOR_KINDS)}")
        if self.tier not in GENERATOR_TIERS:
            raise ConfigError(f"unknown generator tier {self.tier!r}", hint=f"use one of {', '.join(GENERATOR_TIERS)}")
        h = self.out_shape[1]
        if not generatable(self.out_shape):
            raise ConfigError(
                f"generator output {self.out_shape} is not (C, S, S) with S a power of two >= 8",
                hint="generate 1x32x32 images or the 3x16x16 extractor output",
            )
        if self.kind == "ddpm" and h > DDPM_MAX_SIDE:
            raise ConfigError(
                f"the ddpm generator is feature-level only (at most {DDPM_MAX_SIDE}x{DDPM_MAX_SIDE}), "
                f"got {self.out_shape}",
                hint="use generator = \"ddpm\" with method = \"geflf\", or a cvae/dcgan generator for images",
            )
        if self.kind == "vtc" and self.latent_dim <= 0:
            raise ConfigError("a VTC decoder needs latent_dim = the model's feature size p")
        if self.num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {self.num_classes}")

    # -- derived sizes --------------------------------------------------------------------
    @property
    def base_width(self) -> int:
        return self.width or TIER_WIDTH[self.kind][self.tier]

    @property
    def latent(self) -> int:
        return self.latent_dim or DEFAULT_LATENT.get(self.kind, 0)

    @property
    def side(self) -> int:
        return self.out_shape[1]

    def cvae_channels(self) -> list[int]:
        """Encoder channels, one per strided conv down to 1×1 (32 → 5 levels, 16 → 4)."""
        return [self.base_width * 2**i for i in range(_log2(self.side))]

    def up_channels(self) -> list[int]:
        """DCGAN generator / VTC channels from 4×4 upward (before the last conv to C)."""
        n = _log2(self.side) - 2  # stride-2 steps from 4×4 to the output side
        return [self.base_width * 2 ** (n - 1 - i) for i in range(n)]

    def disc_channels(self) -> list[int]:
        """DCGAN discriminator channels from S/2 down to 4×4 (after the two input branches)."""
        n = _log2(self.side) - 2
        return [self.base_width * 2**i for i in range(n)]

    # -- parameter shapes -----------------------------------------------------------------
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """State-dict names and shapes (BN buffers included, ``num_batches_tracked`` as ())."""
        book = _ShapeBook()
        {"cvae": self._cvae_shapes, "dcgan": self._dcgan_shapes, "ddpm": self._ddpm_shapes,
         "vtc": self._vtc_shapes}[self.kind](book, self.out_shape[0], self.num_classes)
        return book.shapes

    def _cvae_shapes(self, book: _ShapeBook, c_out: int, k: int) -> None:
        chans = self.cvae_channels()
        cin = c_out + k
        for i, ch in enumerate(chans):  # enc = [conv, bn, relu] * L
            book.conv(f"enc.{3 * i}", cin, ch)
            book.bn(f"enc.{3 * i + 1}", ch)
            cin = ch
        book.linear("mu", chans[-1], self.latent)
        book.linear("logvar", chans[-1], self.latent)
        book.linear("dec_in", self.latent + k, chans[-1])
        rev = chans[::-1]
        for i in range(len(rev) - 1):  # dec = [convT, bn, relu] * (L-1) + [convT]
            book.conv(f"dec.{3 * i}", rev[i], rev[i + 1], transposed=True)
            book.bn(f"dec.{3 * i + 1}", rev[i + 1])
        book.conv(f"dec.{3 * (len(rev) - 1)}", rev[-1], c_out, transposed=True)

    def _dcgan_shapes(self, book: _ShapeBook, c_out: int, k: int) -> None:
        up = self.up_channels()
        half = up[0] // 2
        book.conv("gen.z_in.0", self.latent, half, transposed=True)
        book.bn("gen.z_in.1", half)
        book.conv("gen.y_in.0", k, half, transposed=True)
        book.bn("gen.y_in.1", half)
        book.up_stack("gen.up", up, c_out)
        down = self.disc_channels()
        book.conv("disc.x_in.0", c_out, down[0] // 2)
        book.conv("disc.y_in.0", k, down[0] // 2)
        for i in range(len(down) - 1):
            book.conv(f"disc.down.{3 * i}", down[i], down[i + 1])
            book.bn(f"disc.down.{3 * i + 1}", down[i + 1])
        book.conv(f"disc.down.{3 * (len(down) - 1)}", down[-1], 1)

    def _ddpm_shapes(self, book: _ShapeBook, c_out: int, k: int) -> None:
        w = self.base_width
        emb = 4 * w
        book.shapes["data_norm.running_mean"] = (c_out,)
        book.shapes["data_norm.running_var"] = (c_out,)
        book.linear("t_mlp.0", w, emb)
        book.linear("t_mlp.2", emb, emb)
        book.shapes["y_emb.weight"] = (k + 1, emb)  # the last row is the "no label" token of guidance
        book.shapes["y_map.weight"] = (k + 1, c_out * self.side * self.side)
        book.conv("inc", 2 * c_out, w, size=3)
        book.conv("down", w, 2 * w)
        book.resblock("mid1", 2 * w, 2 * w, emb)
        book.resblock("mid2", 2 * w, 2 * w, emb)
        book.conv("up", 2 * w, w, transposed=True)
        book.resblock("out_block", 2 * w, w, emb)
        book.shapes["out_norm.weight"] = (w,)
        book.shapes["out_norm.bias"] = (w,)
        book.conv("out", w, c_out, size=3)

    def _vtc_shapes(self, book: _ShapeBook, c_out: int, k: int) -> None:
        up = self.up_channels()
        book.linear("dec_in", self.latent, up[0] * 16)
        book.bn("dec_in_bn", up[0])
        book.up_stack("dec", up, c_out)

    def upload_shapes(self) -> dict[str, tuple[int, ...]]:
        """What a device uploads: every float entry (BN counters are never sent)."""
        return {k: v for k, v in self.param_shapes().items() if not k.endswith("num_batches_tracked")}

    def num_params(self) -> int:
        """Trainable parameters (BN running statistics excluded)."""
        return trainable_params(self.param_shapes())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_shape"] = list(self.out_shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GeneratorSpec:
        d = dict(d)
        d["out_shape"] = tuple(d["out_shape"])
        return cls(**d)


def check_tier(tier: str) -> str:
    """``tier`` if it is a generator tier, else a :class:`ConfigError` naming the choices."""
    if tier not in GENERATOR_TIERS:
        raise ConfigError(f"unknown generator tier {tier!r}", hint=f"use one of {', '.join(GENERATOR_TIERS)}")
    return tier
