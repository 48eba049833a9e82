"""Architecture specs of the model zoo, as plain data (no torch).

The planner and the wire-protocol validator need parameter counts, MACs and
tensor shapes without importing torch, so the arithmetic lives here and
:mod:`fedge.edge.models.zoo` builds the torch modules from the same spec
(a test checks that the two agree).

Every network is ``head ∘ embed ∘ body ∘ extractor``:

* ``extractor``: the GeFL stem, conv(1→3, 3×3, pad 1) + BN + ReLU + maxpool 2,
  giving 3×16×16 from 1×32×32. Identical on every device, so it can be averaged
  fleet-wide (LG-FedAvg, GeFL-F).
* ``body``: the per-architecture "header" of 3×3 convs (pad 1), each followed by
  BN (optional) + ReLU + maxpool 2, then flatten (the size tiers global-average-pool first).
* ``embed``: ``Linear(flat → p)`` with a fleet-wide ``p`` so prototype methods
  (FedProto, FedVTC) compare features across architectures; ``Identity`` in the
  GeFL-exact variant (``embed_dim=None``), where p is the flattened size.
* ``head``: ``Linear(p → classes)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from fedge.errors import ConfigError

STEM_CHANNELS = 3
DEFAULT_EMBED_DIM = 64

# The GeFL target networks (methods.md): header conv channels per model.
GEFL_CHANNELS: dict[int, tuple[int, ...]] = {
    1: (16,),
    2: (16, 32),
    3: (20, 40),
    4: (10, 20),
    5: (16, 32, 64),
    6: (20, 40, 80),
    7: (10, 20, 40),
    8: (16, 32, 64, 128),
    9: (20, 40, 80, 100),
    10: (10, 20, 40, 80),
}

# Size tiers for the planner, smallest first. Parameters span ~60x (test-checked >= 20x).
TIER_CHANNELS: dict[str, tuple[int, ...]] = {
    "xs": (8, 16, 16),
    "s": (16, 32, 32),
    "m": (32, 64, 64),
    "l": (48, 96, 192),
    "xl": (64, 128, 256),
}
TIERS: tuple[str, ...] = tuple(TIER_CHANNELS)


def trainable_params(shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements of a state dict's trainable tensors (BN running statistics excluded)."""
    return sum(
        math.prod(shape)
        for name, shape in shapes.items()
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked"))
    )


@dataclass(frozen=True)
class ArchSpec:
    """Everything needed to build (and size) one network of the zoo."""

    name: str
    channels: tuple[int, ...]
    embed_dim: int | None = DEFAULT_EMBED_DIM
    batchnorm: bool = True
    in_channels: int = 1
    image_size: int = 32
    num_classes: int = 10
    # Global average pooling before flatten (the tiers): keeps the embedding's fan-in, and so its
    # effective step size under SGD, independent of the last feature map's size. Without it the
    # widest tier diverged at lr 0.05 on label-skewed digits.
    global_pool: bool = False

    def __post_init__(self) -> None:
        if not self.channels or any(c <= 0 for c in self.channels):
            raise ConfigError(f"arch {self.name!r}: channels must be positive, got {self.channels}")
        if self.image_size % (2 ** (len(self.channels) + 1)) != 0:
            raise ConfigError(
                f"arch {self.name!r}: image size {self.image_size} is not divisible by "
                f"2^{len(self.channels) + 1} (one pool per conv)",
                hint="use 32x32 inputs or fewer conv layers",
            )
        if self.embed_dim is not None and self.embed_dim <= 0:
            raise ConfigError(f"arch {self.name!r}: embed_dim must be positive or None")

    # -- shapes ---------------------------------------------------------------
    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One sample's shape (C, H, W)."""
        return (self.in_channels, self.image_size, self.image_size)

    @property
    def stem_shape(self) -> tuple[int, int, int]:
        """Extractor output (C, H, W): the common feature space."""
        s = self.image_size // 2
        return (STEM_CHANNELS, s, s)

    @property
    def flat_dim(self) -> int:
        if self.global_pool:
            return self.channels[-1]
        side = self.image_size // 2 ** (len(self.channels) + 1)
        return self.channels[-1] * side * side

    @property
    def feature_dim(self) -> int:
        """p: the embedding size fed to the head."""
        return self.embed_dim if self.embed_dim is not None else self.flat_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """State-dict names and shapes (trainable parameters and BN buffers)."""
        shapes: dict[str, tuple[int, ...]] = {}

        def conv(prefix: str, cin: int, cout: int, bn_prefix: str) -> None:
            shapes[f"{prefix}.weight"] = (cout, cin, 3, 3)
            shapes[f"{prefix}.bias"] = (cout,)
            if self.batchnorm:
                shapes[f"{bn_prefix}.weight"] = (cout,)
                shapes[f"{bn_prefix}.bias"] = (cout,)
                shapes[f"{bn_prefix}.running_mean"] = (cout,)
                shapes[f"{bn_prefix}.running_var"] = (cout,)
                shapes[f"{bn_prefix}.num_batches_tracked"] = ()

        # The stem always has BN (the published stem does).
        shapes["extractor.0.weight"] = (STEM_CHANNELS, self.in_channels, 3, 3)
        shapes["extractor.0.bias"] = (STEM_CHANNELS,)
        for k in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"extractor.1.{k}"] = (STEM_CHANNELS,)
        shapes["extractor.1.num_batches_tracked"] = ()
        cin = STEM_CHANNELS
        step = 4 if self.batchnorm else 3
        for i, cout in enumerate(self.channels):
            conv(f"body.{i * step}", cin, cout, f"body.{i * step + 1}")
            cin = cout
        if self.embed_dim is not None:
            shapes["embed.weight"] = (self.embed_dim, self.flat_dim)
            shapes["embed.bias"] = (self.embed_dim,)
        shapes["head.weight"] = (self.num_classes, self.feature_dim)
        shapes["head.bias"] = (self.num_classes,)
        return shapes

    def num_params(self) -> int:
        """Trainable parameters (BN running statistics excluded)."""
        return trainable_params(self.param_shapes())

    def macs(self) -> int:
        """Multiply-accumulates of one forward pass on one image."""
        side = self.image_size
        total = STEM_CHANNELS * self.in_channels * 9 * side * side
        side //= 2
        cin = STEM_CHANNELS
        for cout in self.channels:
            total += cout * cin * 9 * side * side
            side //= 2
            cin = cout
        if self.embed_dim is not None:
            total += self.embed_dim * self.flat_dim
        total += self.num_classes * self.feature_dim
        return total

    def activation_elems(self) -> int:
        """Activation elements kept for backward per image (conv, BN, ReLU, pool outputs)."""
        side = self.image_size
        per_block = 4 if self.batchnorm else 3
        total = self.in_channels * side * side
        total += STEM_CHANNELS * side * side * 3 + STEM_CHANNELS * (side // 2) ** 2
        side //= 2
        for cout in self.channels:
            total += cout * side * side * (per_block - 1) + cout * (side // 2) ** 2
            side //= 2
        if self.global_pool:
            total += self.flat_dim
        total += self.feature_dim + self.num_classes
        return total

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchSpec:
        d = dict(d)
        d["channels"] = tuple(d["channels"])
        return cls(**d)


def gefl_cnn(k: int, *, batchnorm: bool = True, embed_dim: int | None = None) -> ArchSpec:
    """GeFL target network CNN-k (1..10). ``embed_dim=None`` keeps the published sizes."""
    if k not in GEFL_CHANNELS:
        raise ConfigError(f"there is no CNN-{k}", hint="GeFL defines CNN-1 ... CNN-10")
    suffix = "" if batchnorm else "-nobn"
    name = f"cnn{k}{suffix}" + ("" if embed_dim is None else f"-p{embed_dim}")
    return ArchSpec(name, GEFL_CHANNELS[k], embed_dim=embed_dim, batchnorm=batchnorm)


def tier_arch(tier: str, *, embed_dim: int = DEFAULT_EMBED_DIM) -> ArchSpec:
    """The network of a planner size tier."""
    if tier not in TIER_CHANNELS:
        raise ConfigError(f"unknown model tier {tier!r}", hint=f"use one of {', '.join(TIERS)}")
    return ArchSpec(f"tier-{tier}", TIER_CHANNELS[tier], embed_dim=embed_dim, global_pool=True)


_NAME = re.compile(r"^(?:cnn(?P<k>\d+)(?P<nobn>-nobn)?|tier-(?P<tier>[a-z]+))(?:-p(?P<p>\d+))?$")


def arch_by_name(name: str, *, embed_dim: int | None = None) -> ArchSpec:
    """Parse an architecture name: ``cnn1``..``cnn10`` (``-nobn``), ``tier-xs``..``tier-xl``,
    optionally suffixed ``-pN`` to set the embedding size. ``embed_dim`` overrides the suffix."""
    m = _NAME.match(name)
    if not m:
        raise ConfigError(
            f"unknown architecture {name!r}",
            hint="use cnn1 ... cnn10 (optionally -nobn), or tier-xs/s/m/l/xl, optionally -p<dim>",
        )
    p = embed_dim if embed_dim is not None else (int(m["p"]) if m["p"] else None)
    if m["tier"]:
        return tier_arch(m["tier"], embed_dim=p or DEFAULT_EMBED_DIM)
    return gefl_cnn(int(m["k"]), batchnorm=not m["nobn"], embed_dim=p)
