"""GeFL-F (feature-level GeFL, arXiv 2412.18460), device half.

Three phases, as published for MNIST/FMNIST (20 + 100 + 50 rounds):

1. ``warmup``: LG-FedAvg on the full model — the common extractor (the 3×16×16
   stem) is averaged over every device, the rest within the architecture group.
   This is exactly :class:`~fedge.edge.methods.fedavg.LGFedAvgDevice`, reused.
2. ``generator``: the extractor is frozen at its warm-up average; every device
   trains the same conditional *feature* generator (CVAE-F or DCGAN-F) on the
   extractor's outputs of its data, and the coordinator averages it.
3. ``head``: each round, 1 epoch on generated features, then 5 epochs on real
   features through the frozen extractor. "Head" is everything after the
   extractor (body + embed + head, via :meth:`FedgeNet.from_stem`); it is
   averaged within the architecture group. The generator is frozen (published
   ``freeze_gen = True`` for GeFL-F), so it is downloaded once.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
import torch

from fedge.common.method_settings import GeFLFSettings
from fedge.common.rounds import EXTRACTOR_ARTIFACT, GENERATOR_PHASE, WARMUP_PHASE, RoundInfo, group_artifact
from fedge.common.settings import MethodSettings
from fedge.edge.methods.base import Arrays, DeviceContext, load_arrays, model_arrays
from fedge.edge.methods.fedavg import LGFedAvgDevice
from fedge.edge.methods.gefl import GenerativeMixin
from fedge.edge.models.zoo import EXTRACTOR

log = logging.getLogger(__name__)


@torch.no_grad()
def stem_features(model: Any, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """The frozen extractor's output (N, 3, 16, 16), with BN in inference mode."""
    model.eval()
    out = [model.extractor(torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size]))).numpy()
           for i in range(0, len(x), batch_size)]
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0, *model.spec.stem_shape), np.float32)


class GeFLFDevice(GenerativeMixin, LGFedAvgDevice):
    """GeFL-F with a CVAE-F or DCGAN-F feature generator (``[method] generator``)."""

    settings_type: ClassVar[type[MethodSettings]] = GeFLFSettings
    settings: GeFLFSettings

    def __init__(self, ctx: DeviceContext) -> None:
        super().__init__(ctx)
        self._init_generator(ctx.model.spec.stem_shape)
        self._feats: np.ndarray | None = None  # real stem features, valid while the extractor is frozen

    def _head_params(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.ctx.model.named_parameters() if not n.startswith(EXTRACTOR)]

    def data_changed(self) -> None:
        super().data_changed()
        self._feats = None

    def _real_features(self) -> np.ndarray:
        if self._feats is None:  # the extractor no longer changes after warm-up
            self._feats = stem_features(self.ctx.model, self.ctx.train.x)
        return self._feats

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        if info.phase == WARMUP_PHASE:
            return super().needed_artifacts(info)
        if info.phase == GENERATOR_PHASE:
            return [EXTRACTOR_ARTIFACT, self.gen_artifact]
        out = [EXTRACTOR_ARTIFACT, group_artifact(self.ctx.model.spec.name)]
        if not self.generator_loaded:
            out.append(self.gen_artifact)
        return out

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:
        self._load_generator(artifacts)
        ext = artifacts.get(EXTRACTOR_ARTIFACT)
        if ext and info.phase != WARMUP_PHASE and self._feats is not None:
            # Frozen extractor: the published one must equal ours; if not (a restart), recompute features.
            mine = model_arrays(self.ctx.model, [EXTRACTOR])
            if any(not np.array_equal(mine[k], v) for k, v in ext.items()):
                self._feats = None
        for name, arrays in artifacts.items():
            if name != self.gen_artifact:
                load_arrays(self.ctx.model, arrays)

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        ctx = self.ctx
        if info.phase == WARMUP_PHASE:
            return super().train_round(info)
        feats = self._real_features()
        if info.phase == GENERATOR_PHASE:
            arrays, gloss = self._train_generator(feats, ctx.train.y)
            return arrays, {"gen_loss": gloss, "generator_tier": self.gen_tier}
        # head phase: (B, 3, 16, 16) features through body + embed + head only
        model = ctx.model

        def forward(zb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = model.from_stem(zb)
            return logits, logits

        extra = self._train_target(feats, ctx.train.y, lambda z: z, params=self._head_params(), forward=forward,
                                   rnd=info.round)
        return model_arrays(model, exclude=[EXTRACTOR]), extra


__all__ = ["GeFLFDevice", "stem_features"]
