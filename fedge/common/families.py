"""Model families, as plain data (no torch): which families exist, their tiers, and one network's sizes.

A *family* builds a network for a size *tier* and an *input* (channels and a spatial or temporal
shape) and declares where it splits: ``extractor`` (the stem every device may share), ``body``,
``embed`` (the embedding prototype methods summarise) and ``head`` (docs/models.md). The GeFL CNN zoo
(:mod:`fedge.common.archs`: CNN-1..10 and ``tier-*``) is the family ``gefl-cnn``; the others are built
in :mod:`fedge.edge.models.families`, or loaded from the user's ``my_family.py:build``.

The planner, the coordinator and the virtual clock are torch-free, yet a family network's parameters,
MACs and activations are *measured* from the built module (:mod:`fedge.edge.models.measure`). So this
module keeps a registry of measured networks, :class:`FamilyArch` records, filled by a *measurer*: the
torch side (:mod:`fedge.edge.models.families`) registers one when it is imported, and every process
that trains, simulates or exports imports it. A torch-free process that meets a family network nobody
measured gets an error naming the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedge.common.archs import DEFAULT_EMBED_DIM, TIERS, ArchSpec, arch_by_name, trainable_params
from fedge.errors import ConfigError

GEFL_FAMILY = "gefl-cnn"

# Built-in families: their tiers (smallest first) and the input each takes. "image": (C, H, W) at any
# resolution; "spectral": (C, frames, bins), e.g. MFCCs; "series": (C, T), e.g. a 3-axis accelerometer.
BUILTIN_TIERS: Mapping[str, tuple[str, ...]] = {
    GEFL_FAMILY: TIERS,
    "mobilenet": ("xs", "s", "m", "l", "xl"),
    "resnet8": ("xs", "s", "m", "l", "xl"),
    "dscnn": ("xs", "s", "m", "l"),
    "cnn1d": ("xs", "s", "m", "l"),
}
BUILTIN_INPUT: Mapping[str, str] = {
    GEFL_FAMILY: "image", "mobilenet": "image", "resnet8": "image", "dscnn": "spectral", "cnn1d": "series",
}


@dataclass(frozen=True)
class MeasuredSizes:
    """What :func:`fedge.edge.models.measure.measure` found in one built network (one sample)."""

    params: int
    macs: int
    activation_elems: int
    param_shapes: Mapping[str, tuple[int, ...]]
    stem_shape: tuple[int, ...]
    feature_dim: int

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "macs": self.macs, "activation_elems": self.activation_elems,
                "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
                "stem_shape": list(self.stem_shape), "feature_dim": self.feature_dim}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeasuredSizes:
        return cls(int(d["params"]), int(d["macs"]), int(d["activation_elems"]),
                   {k: tuple(v) for k, v in d["param_shapes"].items()}, tuple(d["stem_shape"]), int(d["feature_dim"]))


def family_label(family: str) -> str:
    """The short name a family's networks are named after: ``mobilenet``, or ``my_family`` for
    ``/path/my_family.py:build`` / ``pkg.my_family:build``."""
    if family in BUILTIN_TIERS:
        return family
    target = family.rsplit(":", 1)[0]
    stem = Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_") or "family"


def size_tag(input_size: tuple[int, ...]) -> str:
    """``96`` for a square 96x96 input, ``49x10`` otherwise, ``128`` for a series of 128 steps."""
    if len(input_size) == 2 and input_size[0] == input_size[1]:
        return str(input_size[0])
    return "x".join(str(s) for s in input_size)


@dataclass(frozen=True)
class FamilyArch:
    """One measured network of a family: what :class:`~fedge.common.archs.ArchSpec` is for the GeFL CNNs.

    It answers the same questions (``name``, ``num_params()``, ``macs()``, ``activation_elems()``,
    ``param_shapes()``, ``stem_shape``, ``feature_dim``), so the planner, the coordinator's update
    shapes and the clock treat both alike; the figures are the measured ones.
    """

    family: str
    tier: str
    in_channels: int
    input_size: tuple[int, ...]
    num_classes: int
    embed_dim: int
    sizes: MeasuredSizes = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        """``<family>-<tier>-<size>``, e.g. ``mobilenet-s-96`` (what a device announces as its arch)."""
        return f"{family_label(self.family)}-{self.tier}-{size_tag(self.input_size)}"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: (C, H, W) or (C, T)."""
        return (self.in_channels, *self.input_size)

    @property
    def image_size(self) -> int:
        """The side of a square image input (what image-level generators are sized for)."""
        if len(self.input_size) != 2 or self.input_size[0] != self.input_size[1]:
            raise ConfigError(f"{self.name} takes {'x'.join(map(str, self.input_shape))} inputs, not square images",
                              hint="image-level methods (GeFL's image generators, FedVTC's decoder) need a square "
                                   "image input; use a feature-level method or an image family")
        return self.input_size[0]

    @property
    def stem_shape(self) -> tuple[int, ...]:
        return self.sizes.stem_shape

    @property
    def feature_dim(self) -> int:
        return self.sizes.feature_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.sizes.param_shapes)

    def num_params(self) -> int:
        return self.sizes.params

    def macs(self) -> int:
        return self.sizes.macs

    def activation_elems(self) -> int:
        return self.sizes.activation_elems

    def to_dict(self) -> dict[str, Any]:
        """Plain data: what rebuilds it, its name and its measured figures (an export's manifest records it)."""
        return {**self.build_args(), "name": self.name, "params": self.sizes.params, "macs": self.sizes.macs,
                "activation_elems": self.sizes.activation_elems}

    def build_args(self) -> dict[str, Any]:
        """What rebuilds the network (the sizes are measured again)."""
        return {"family": self.family, "tier": self.tier, "in_channels": self.in_channels,
                "input_size": list(self.input_size), "num_classes": self.num_classes, "embed_dim": self.embed_dim}


ModelSpec = ArchSpec | FamilyArch
"""Any network the planner sizes: a GeFL CNN spec (formulas, equal to the measured figures) or a family's."""


class Measurer(Protocol):
    """What the torch side provides: a family's tiers, and one measured network."""

    def tiers(self, family: str) -> tuple[str, ...]: ...

    def measure(self, family: str, tier: str, in_channels: int, input_size: tuple[int, ...],
                num_classes: int, embed_dim: int) -> MeasuredSizes: ...


_MEASURERS: list[Measurer] = []
_BY_KEY: dict[tuple[Any, ...], FamilyArch] = {}
_BY_NAME: dict[str, FamilyArch] = {}


def register_measurer(m: Measurer) -> None:
    """Called by :mod:`fedge.edge.models.families` on import (once)."""
    if not any(type(x) is type(m) for x in _MEASURERS):
        _MEASURERS.append(m)


def _need_measurer(what: str) -> Measurer:
    if not _MEASURERS:
        raise ConfigError(f"{what} is measured from the built network, and this process has no torch side loaded",
                          hint="run it where fedge's device side (torch) is installed: fedge simulate, fedge edge, "
                               "fedge export, or import fedge.edge.models before planning")
    return _MEASURERS[0]


def family_tiers(family: str) -> tuple[str, ...]:
    """The tiers of ``family``, smallest first."""
    if family in BUILTIN_TIERS:
        return BUILTIN_TIERS[family]
    return _need_measurer(f"family {family!r}").tiers(family)


def family_arch(family: str, tier: str, *, in_channels: int, input_size: tuple[int, ...],
                num_classes: int = 10, embed_dim: int = DEFAULT_EMBED_DIM) -> FamilyArch:
    """The measured network of ``family`` at ``tier`` for this input (measured once per process)."""
    key = (family, tier, in_channels, tuple(input_size), num_classes, embed_dim)
    if key not in _BY_KEY:
        sizes = _need_measurer(f"{family_label(family)}-{tier}").measure(
            family, tier, in_channels, tuple(input_size), num_classes, embed_dim)
        arch = FamilyArch(family, tier, in_channels, tuple(input_size), num_classes, embed_dim, sizes)
        if trainable_params(arch.param_shapes()) != sizes.params:
            raise ConfigError(f"{arch.name}: its state dict holds trainable tensors outside its parameters",
                              hint="register constant tensors as buffers named running_* or leave them out")
        _BY_KEY[key] = arch
        _BY_NAME[arch.name] = arch
    return _BY_KEY[key]


def registered_arch(name: str) -> FamilyArch | None:
    """The family network of that name measured in this process (the latest, if several inputs share one)."""
    return _BY_NAME.get(name)


def spec_by_name(name: str, *, embed_dim: int | None = None) -> ModelSpec:
    """A network by the name a device announces: a family network measured in this process, else a GeFL CNN
    (:func:`fedge.common.archs.arch_by_name`)."""
    found = registered_arch(name)
    if found is not None:
        return found
    try:
        return arch_by_name(name, embed_dim=embed_dim)
    except ConfigError as exc:
        if re.match(r"^[a-z0-9_]+-[a-z0-9]+-\d+(x\d+)?$", name):
            raise ConfigError(f"architecture {name!r} looks like a family network that this process has not measured",
                              hint="load the fleet config ([model] family) first, in a process with fedge's device "
                                   "side installed") from exc
        raise
