"""Shared set-up of the export and runtime tests: digits, a briefly trained tiny network, an export.

Cached per process, so each test file trains once (~2 s) whatever it runs.
Holds no tests itself.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.models.zoo import FedgeNet, build_model
from fedge.edge.training import TrainConfig, train_epochs

ARCH = "tier-xs"
# One thread: tiny models gain nothing from two, and on a shared, loaded machine
# OpenMP's spinning threads made training 25x slower.
torch.set_num_threads(1)


@functools.cache
def digits() -> tuple[Dataset, Dataset]:
    """sklearn digits, train and test, through the shared preprocessing."""
    return load_dataset("digits", train=True), load_dataset("digits", train=False)


@functools.cache
def raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 raw digit images as 0..255 pixels (8x8) and their labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images * (255.0 / 16.0)).astype(np.float32), d.target.astype(np.int64)


@functools.cache
def _trained(arch: str) -> FedgeNet:
    train, _ = digits()
    torch.manual_seed(0)
    net = build_model(arch, seed=0)
    train_epochs(net, train.x, train.y, TrainConfig(lr=0.02, batch_size=32, momentum=0.9),
                 np.random.default_rng(0), epochs=3)
    return net.eval()


def trained(arch: str = ARCH) -> FedgeNet:
    """A copy of a tiny network trained 3 epochs on digits (fixed seeds, ~94 % test accuracy)."""
    import copy

    return copy.deepcopy(_trained(arch))


def leftovers(out: Path) -> list[str]:
    """Anything an export left beside ``out`` (staging directories) or in it."""
    found = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    if out.exists():
        found += [f"{out.name}/{p.name}" for p in out.iterdir()]
    return sorted(found)
