"""The two networks the privacy audit trains itself (never downloaded).

* :func:`train_feature_net` — the *fixed* feature network whose embedding is the
  audit's second distance space: zoo network CNN-5 trained from a fixed seed on
  images disjoint from every device's training share (one half of the data
  set's test split; the audit's held-out images come from the other half).
* :class:`FeatureInverter` — maps the common extractor's 3×16×16 output back to
  1×32×32 images, so a GeFL-F feature generator is judged in image space, as the
  GeFL article does; it is trained on the audited device's own training images
  through that device's extractor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedge.edge.models import build_model
from fedge.edge.models.zoo import FedgeNet
from fedge.edge.training import TrainConfig, accuracy, train_epochs

FEATURE_ARCH = "cnn5"


def train_feature_net(x: np.ndarray, y: np.ndarray, num_classes: int, *, epochs: int = 15,
                      seed: int = 0) -> tuple[FedgeNet, float]:
    """CNN-5 trained on normalized images ``x``; returns it (eval mode) and its accuracy on ``x`` itself."""
    model = build_model(FEATURE_ARCH, seed=seed, num_classes=num_classes)
    cfg = TrainConfig(lr=0.05, batch_size=32, local_epochs=epochs, momentum=0.9)
    train_epochs(model, x, y, cfg, np.random.default_rng(seed))
    model.eval()
    return model, accuracy(model, x, y)


def embed(model: FedgeNet, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """The network's embedding g(x) of normalized images, (N, p)."""
    model.eval()
    with torch.no_grad():
        return np.concatenate([model.features(torch.from_numpy(np.ascontiguousarray(x[i : i + batch]))).numpy()
                               for i in range(0, len(x), batch)]) if len(x) else np.zeros((0, 1), np.float32)


class FeatureInverter(nn.Module):
    """(B, 3, 16, 16) extractor output -> (B, 1, 32, 32) image in [0, 1]."""

    def __init__(self, channels: int = 3, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(width, width, 4, 2, 1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(width, 1, 3, padding=1), nn.Sigmoid(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def train_inverter(feats: np.ndarray, images01: np.ndarray, *, epochs: int = 60, seed: int = 0) -> FeatureInverter:
    """Fit a :class:`FeatureInverter` on (extractor output, image) pairs with MSE and Adam."""
    torch.manual_seed(seed)
    inv = FeatureInverter(feats.shape[1])
    opt = torch.optim.Adam(inv.parameters(), lr=2e-3)
    f = torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32))
    t = torch.from_numpy(np.ascontiguousarray(images01, dtype=np.float32))
    rng = np.random.default_rng(seed)
    inv.train()
    for _ in range(epochs):
        order = rng.permutation(len(f))
        for i in range(0, len(f), 64):
            idx = order[i : i + 64]
            if len(idx) < 2:
                continue
            loss = ((inv(f[idx]) - t[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    inv.eval()
    return inv


def stem_features(model: FedgeNet, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """The common extractor's output (N, 3, 16, 16) of normalized images, BN in inference mode."""
    model.eval()
    with torch.no_grad():
        return np.concatenate([model.extractor(torch.from_numpy(np.ascontiguousarray(x[i : i + batch]))).numpy()
                               for i in range(0, len(x), batch)])


def invert(inv: FeatureInverter, feats: np.ndarray, batch: int = 256) -> np.ndarray:
    """Images in [0, 1] from extractor outputs."""
    with torch.no_grad():
        return np.concatenate([inv(torch.from_numpy(np.ascontiguousarray(feats[i : i + batch],
                                                                           dtype=np.float32))).numpy()
                               for i in range(0, len(feats), batch)])
