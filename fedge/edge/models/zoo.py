"""Torch modules of the model zoo, built from :class:`fedge.common.archs.ArchSpec`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedge.common.archs import STEM_CHANNELS, ArchSpec, arch_by_name
from fedge.common.families import FamilyArch, ModelSpec, spec_by_name
from fedge.common.initseeds import InitSeeds
from fedge.edge.models.split import BODY as BODY
from fedge.edge.models.split import EMBED as EMBED
from fedge.edge.models.split import EXTRACTOR as EXTRACTOR
from fedge.edge.models.split import HEAD as HEAD
from fedge.edge.models.split import SplitNet


def _block(cin: int, cout: int, batchnorm: bool) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1)]
    if batchnorm:
        layers.append(nn.BatchNorm2d(cout))
    layers += [nn.ReLU(inplace=True), nn.MaxPool2d(2)]
    return layers


class FedgeNet(SplitNet):
    """The GeFL CNN family: ``head ∘ embed ∘ body ∘ extractor`` (see :mod:`fedge.common.archs`)."""

    spec: ArchSpec
    extractor: nn.Sequential
    body: nn.Sequential

    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        self.spec = spec
        # (B, 1, 32, 32) -> (B, 3, 16, 16); the stem always has BN, as published.
        self.extractor = nn.Sequential(
            nn.Conv2d(spec.in_channels, STEM_CHANNELS, 3, padding=1),
            nn.BatchNorm2d(STEM_CHANNELS),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        layers: list[nn.Module] = []
        cin = STEM_CHANNELS
        for cout in spec.channels:
            layers += _block(cin, cout, spec.batchnorm)
            cin = cout
        if spec.global_pool:
            layers.append(nn.AdaptiveAvgPool2d(1))
        layers.append(nn.Flatten())
        self.body = nn.Sequential(*layers)  # (B, 3, 16, 16) -> (B, flat)
        self.embed: nn.Module = (
            nn.Linear(spec.flat_dim, spec.embed_dim) if spec.embed_dim is not None else nn.Identity()
        )  # (B, flat) -> (B, p)
        self.head = nn.Linear(spec.feature_dim, spec.num_classes)  # (B, p) -> (B, classes)

    def build_args(self) -> dict[str, Any]:
        """Arguments that rebuild this module (stored in checkpoints)."""
        return {"spec": self.spec.to_dict()}


def build_fedgenet(spec: dict[str, Any]) -> FedgeNet:
    return FedgeNet(ArchSpec.from_dict(spec))


def build_model(arch: str | ArchSpec, *, embed_dim: int | None = None, seed: int | None = None,
                num_classes: int | None = None) -> FedgeNet:
    """Build a zoo network by name or spec; ``seed`` makes the initial weights reproducible."""
    spec = arch if isinstance(arch, ArchSpec) else arch_by_name(arch, embed_dim=embed_dim)
    if num_classes is not None and num_classes != spec.num_classes:
        spec = ArchSpec(**{**spec.to_dict(), "channels": spec.channels, "num_classes": num_classes})
    if seed is None:
        return FedgeNet(spec)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return FedgeNet(spec)


def reinit(module: nn.Module, seed: int) -> None:
    """Draw ``module``'s initial weights again from ``seed``, with torch's default initialiser of each
    layer (``reset_parameters``, in module order; BatchNorm statistics reset too)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def build_network(spec: ModelSpec, *, seed: int | None = None) -> SplitNet:
    """The network of any family: a GeFL CNN (:class:`FedgeNet`) or a family's :class:`FamilyNet`."""
    if isinstance(spec, FamilyArch):
        from fedge.edge.models.families import build_family_net

        return build_family_net(spec, seed=seed)
    return build_model(spec, seed=seed)


def build_seeded(arch: str | ModelSpec, seeds: InitSeeds) -> SplitNet:
    """A device's network from its :class:`~fedge.common.initseeds.InitSeeds`: the whole network from
    ``seeds.model``, then each shared part (``"extractor."``) re-initialised from its own seed."""
    model = build_network(spec_by_name(arch) if isinstance(arch, str) else arch, seed=seeds.model)
    for prefix, seed in seeds.parts:
        reinit(model.get_submodule(prefix.rstrip(".")), seed)
    return model
