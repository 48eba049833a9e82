"""Model families on the device side: building a family's network and measuring it (docs/models.md).

:mod:`fedge.common.families` holds the torch-free side (the names, the tiers, the measured
:class:`~fedge.common.families.FamilyArch` records); importing this package registers the measurer that
fills them, so any process that trains, simulates or exports can plan any family.
"""

from __future__ import annotations

import torch
from torch import nn

from fedge.common.families import FamilyArch, MeasuredSizes, family_arch, register_measurer
from fedge.edge.models.families.contract import build_parts, check_onnx_export, load_family
from fedge.edge.models.measure import measure
from fedge.edge.models.split import FamilyNet, SplitNet

__all__ = ["build_family_net", "family_arch", "load_family"]


class _Unmeasured(SplitNet):
    def __init__(self, parts: tuple[nn.Module, ...]) -> None:
        super().__init__()
        self.extractor, self.body, self.embed, self.head = parts


class TorchMeasurer:
    """Builds a family's network (holding it to the contract) and measures it; checks ONNX export once a family."""

    def __init__(self) -> None:
        self._exported: set[tuple[str, tuple[int, ...]]] = set()

    def tiers(self, family: str) -> tuple[str, ...]:
        return load_family(family)[1]

    def measure(self, family: str, tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int,
                embed_dim: int) -> MeasuredSizes:
        net = _Unmeasured(build_parts(family, tier, in_channels, input_size, num_classes, embed_dim))
        shape = (in_channels, *input_size)
        if (family, shape) not in self._exported:
            check_onnx_export(net, shape, f"family {family!r} at tier {tier!r}")
            self._exported.add((family, shape))
        return measure(net, shape)


register_measurer(TorchMeasurer())


def build_family_net(spec: FamilyArch, *, seed: int | None = None) -> FamilyNet:
    """The network ``spec`` describes; ``seed`` makes its initial weights reproducible."""
    args = (spec.family, spec.tier, spec.in_channels, spec.input_size, spec.num_classes, spec.embed_dim)
    if seed is None:
        return FamilyNet(spec, *build_parts(*args))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return FamilyNet(spec, *build_parts(*args))


def rebuild_family_net(spec: dict[str, object]) -> FamilyNet:
    """Checkpoint builder: the arguments of :meth:`FamilyArch.build_args` back to a network."""
    size = spec["input_size"]
    assert isinstance(size, list)
    arch = family_arch(str(spec["family"]), str(spec["tier"]), in_channels=int(str(spec["in_channels"])),
                       input_size=tuple(int(s) for s in size), num_classes=int(str(spec["num_classes"])),
                       embed_dim=int(str(spec["embed_dim"])))
    return build_family_net(arch)
