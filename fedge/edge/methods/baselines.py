"""Device halves of the baselines: Local, FedAvg within a group, LG-FedAvg, FedProto."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from fedge.common.method_settings import FedAvgSettings, FedProtoSettings, LGFedAvgSettings, LocalSettings
from fedge.common.rounds import EXTRACTOR_ARTIFACT, PROTOTYPES_ARTIFACT, RoundInfo, group_artifact
from fedge.common.settings import MethodSettings
from fedge.edge.methods.base import Arrays, DeviceMethod, load_arrays, model_arrays
from fedge.edge.methods.personal import PersonalMixin
from fedge.edge.models.zoo import EXTRACTOR
from fedge.edge.training import class_feature_stats, train_epochs


class LocalDevice(DeviceMethod):
    """No federation: train on local data only; uploads nothing but the sample count."""

    name = "local"
    settings_type = LocalSettings

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        loss = train_epochs(self.ctx.model, self.ctx.train.x, self.ctx.train.y, self.ctx.train_cfg, self.ctx.rng)
        return {}, {"loss": loss}


class FedAvgDevice(DeviceMethod):
    """FedAvg within an architecture group: upload all weights, get the group average back."""

    name = "fedavg"
    settings_type: ClassVar[type[MethodSettings]] = FedAvgSettings

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [group_artifact(self.ctx.model.spec.name)]

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:
        for arrays in artifacts.values():
            load_arrays(self.ctx.model, arrays)

    def upload(self) -> Arrays:
        return model_arrays(self.ctx.model)

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        loss = train_epochs(self.ctx.model, self.ctx.train.x, self.ctx.train.y, self.ctx.train_cfg, self.ctx.rng)
        return self.upload(), {"loss": loss}


class LGFedAvgDevice(FedAvgDevice):
    """LG-FedAvg as fedge defines it: the common extractor is averaged over every device,
    the rest of the network within the architecture group."""

    name = "lgfedavg"
    settings_type: ClassVar[type[MethodSettings]] = LGFedAvgSettings

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [EXTRACTOR_ARTIFACT, *super().needed_artifacts(info)]


class FedProtoDevice(PersonalMixin, DeviceMethod):
    """FedProto (Tan et al., AAAI 2022): upload per-class feature means and counts; train with
    cross-entropy plus ``lambda * ||g(x) - c_y||^2`` toward the global prototypes.

    ``[method] inference = "head"`` (default) classifies with the local head;
    ``"prototype"`` with the nearest global prototype, as in the paper.
    ``[method] head_protos = w`` (default 0: the paper) adds ``w * CE(h(c_y), y)`` over every
    global prototype, so the head also learns classes the device never sees locally; under
    label skew this is what lets prototypes improve accuracy on the global test set.
    """

    name = "fedproto"
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
            out["acc_global"] = self._proto_accuracy(ctx.global_test.x, ctx.global_test.y)
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


__all__ = ["EXTRACTOR", "FedAvgDevice", "FedProtoDevice", "LGFedAvgDevice", "LocalDevice"]
