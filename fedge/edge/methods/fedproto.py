"""FedProto (Tan et al., AAAI 2022), device half: per-class feature means up, global prototypes down."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedge.common.method_settings import FedProtoSettings
from fedge.common.rounds import PROTOTYPES_ARTIFACT, RoundInfo
from fedge.edge.methods.base import Arrays, DeviceMethod
from fedge.edge.methods.personal import PersonalMixin
from fedge.edge.training import class_feature_stats, train_epochs


class FedProtoDevice(PersonalMixin, DeviceMethod):
    """FedProto (Tan et al., AAAI 2022): upload per-class feature means and counts; train with
    cross-entropy plus ``lambda * ||g(x) - c_y||^2`` toward the global prototypes.

    ``[method] inference = "head"`` (default) classifies with the local head;
    ``"prototype"`` with the nearest global prototype, as in the paper.
    ``[method] head_protos = w`` (default 0: the paper) adds ``w * CE(h(c_y), y)`` over every
    global prototype, so the head also learns classes the device never sees locally; under
    label skew this is what lets prototypes improve accuracy on the global test set.
    """

    settings_type = FedProtoSettings
    settings: FedProtoSettings

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.lam = self.settings.lam
        self.inference = self.settings.inference
        self.head_protos = self.settings.head_protos
        self.global_protos: torch.Tensor | None = None  # (C, p)
        self.proto_mask: torch.Tensor | None = None  # (C,) classes some device has seen

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [PROTOTYPES_ARTIFACT]

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:
        arrays = artifacts.get(PROTOTYPES_ARTIFACT)
        if arrays:
            self.global_protos = torch.from_numpy(arrays["protos"].astype(np.float32))
            self.proto_mask = torch.from_numpy(arrays["counts"] > 0)

    def _proto_loss(self, model: Any, xb: torch.Tensor, yb: torch.Tensor,
                    logits: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        assert self.global_protos is not None and self.proto_mask is not None
        keep = self.proto_mask[yb]
        if not bool(keep.any()):
            return feats.sum() * 0.0
        target = self.global_protos[yb[keep]]
        loss = self.lam * torch.nn.functional.mse_loss(feats[keep], target)
        if self.head_protos > 0:
            classes = torch.nonzero(self.proto_mask).flatten()
            logits_p = model.head(self.global_protos[classes])  # (C', classes)
            loss = loss + self.head_protos * torch.nn.functional.cross_entropy(logits_p, classes)
        return loss

    def evaluate(self) -> dict[str, float]:
        if self.inference == "head" or self.global_protos is None:
            return super().evaluate()
        ctx = self.ctx
        out = {"acc_local": self._proto_accuracy(ctx.local_test.x, ctx.local_test.y)}
        if ctx.global_test is not None:
            test, protos, mask = ctx.global_test, self.global_protos, self.proto_mask
            assert mask is not None
            # nearest-prototype predictions depend on the model and the prototypes it measures against
            key = protos.numpy().tobytes() + mask.numpy().tobytes()
            out["acc_global"] = self.global_accuracy(lambda: self._proto_accuracy(test.x, test.y),
                                                     kind="nearest-prototype", extra=key)
        return out

    @torch.no_grad()
    def _proto_accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        assert self.global_protos is not None and self.proto_mask is not None
        if len(y) == 0:
            return float("nan")
        self.ctx.model.eval()
        feats = self.ctx.model.features(torch.from_numpy(x))  # (N, p)
        dist = torch.cdist(feats, self.global_protos)  # (N, C)
        dist[:, ~self.proto_mask] = float("inf")
        return float((dist.argmin(1).numpy() == y).mean())

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        ctx = self.ctx
        extra = self._proto_loss if self.global_protos is not None else None
        loss = train_epochs(ctx.model, ctx.train.x, ctx.train.y, ctx.train_cfg, ctx.rng, extra_loss=extra)
        sums, _, counts = class_feature_stats(ctx.model, ctx.train.x, ctx.train.y, ctx.num_classes)
        protos = sums / np.maximum(counts, 1)[:, None]
        return {"protos": protos.astype(np.float32), "counts": counts}, {"loss": loss}
