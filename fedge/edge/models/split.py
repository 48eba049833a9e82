"""The split every fedge network declares: ``head ∘ embed ∘ body ∘ extractor``.

Methods share or summarise these parts by name (docs/models.md): ``extractor`` is the stem that
LG-FedAvg averages and GeFL-F's feature generator imitates, ``embed`` gives the features FedProto and
FedVTC summarise, ``head`` maps them to logits. :class:`~fedge.edge.models.zoo.FedgeNet` (the GeFL CNN
family) and :class:`FamilyNet` (every other family) are both a :class:`SplitNet`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedge.common.families import FamilyArch

# Parameter-name prefixes, used by methods that share parts of the network.
EXTRACTOR = "extractor."
BODY = "body."
EMBED = "embed."
HEAD = "head."


class SplitNet(nn.Module):
    """A network with ``extractor``, ``body``, ``embed`` and ``head`` submodules (set by the subclass)."""

    spec: Any
    extractor: nn.Module
    body: nn.Module
    embed: nn.Module
    head: nn.Module

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Embedding g(x) of shape (B, p)."""
        return self.embed(self.body(self.extractor(x)))

    def from_stem(self, z: torch.Tensor) -> torch.Tensor:
        """Logits from extractor output: used by feature-level methods."""
        return self.head(self.embed(self.body(z)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class FamilyNet(SplitNet):
    """A family's network: the four parts its builder returned, and the measured spec."""

    def __init__(self, spec: FamilyArch, extractor: nn.Module, body: nn.Module, embed: nn.Module,
                 head: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        self.extractor, self.body, self.embed, self.head = extractor, body, embed, head

    def build_args(self) -> dict[str, Any]:
        """Arguments that rebuild this module (stored in checkpoints)."""
        return {"spec": self.spec.build_args()}
