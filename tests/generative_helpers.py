"""Small label-skewed digit fleets for the generative-method tests (built by hand, no profiles)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedge.common.inmemory import InMemoryBus
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.coordinator.strategies import strategy
from fedge.edge.agent import DeviceAgent
from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.data.partition import dirichlet, shards
from fedge.edge.methods import DeviceContext, device_method
from fedge.edge.models import build_model
from fedge.edge.training import TrainConfig
from fedge.sim.inprocess import connect_inprocess

# Small CNNs train ~10x faster single-threaded than with two threads on a busy 2-core machine.
torch.set_num_threads(1)

ARCHS = ("cnn3-p32", "cnn2-p32", "cnn4-p32", "cnn1-p32")

_DIGITS: tuple[Dataset, Dataset] | None = None


def digits() -> tuple[Dataset, Dataset]:
    global _DIGITS
    if _DIGITS is None:
        _DIGITS = (load_dataset("digits", train=True), load_dataset("digits", train=False))
    return _DIGITS


@dataclass
class GenFleet:
    bus: InMemoryBus
    agents: list[DeviceAgent]
    engine: RoundEngine

    def methods(self) -> list[Any]:
        return [a.method for a in self.agents]

    def final_global_accuracy(self) -> float:
        rep = self.engine.reports[-1]
        return float(np.mean([m["acc_global"] for m in rep.metrics.values()]))


def skewed_fleet(method: str, *, rounds: int, method_config: dict[str, Any] | None = None, seed: int = 0,
                 archs: tuple[str, ...] = ARCHS, shards_per_device: int = 3, precision: str = "fp32",
                 epochs: int = 2, plan: dict[str, Any] | None = None,
                 drop_class: int | None = None, alpha: float | None = None) -> GenFleet:
    """``len(archs)`` devices, each holding ``shards_per_device`` label shards of the digits
    training set (so a few classes each: Local cannot learn the classes it never sees), or a
    Dirichlet(``alpha``) share when ``alpha`` is given."""
    train, test = digits()
    if drop_class is not None:
        keep = np.flatnonzero(train.y != drop_class)
        train = train.subset(keep)
    parts = (dirichlet(train.y, len(archs), alpha, seed) if alpha is not None
             else shards(train.y, len(archs), shards_per_device, seed))
    cfg = method_config or {}
    pairs = []
    for i, (arch, idx) in enumerate(zip(archs, parts, strict=True)):
        model = build_model(arch, seed=seed * 1000 + i)
        n_test = max(2, len(idx) // 10)
        ctx = DeviceContext(f"d{i}", model, train.subset(idx[n_test:]), train.subset(idx[:n_test]),
                            TrainConfig(lr=0.05, batch_size=32, local_epochs=epochs), precision,
                            seed=seed * 1000 + i, method_config=dict(cfg), global_test=test, plan=dict(plan or {}))
        info = DeviceInfo(f"d{i}", model.spec.name, "test", precision, len(idx) - n_test, model.spec.feature_dim)
        pairs.append((device_method(method)(ctx), info))
    bus, coord, agents = connect_inprocess(pairs)
    strat = strategy(method)(dict(cfg), num_classes=10, rounds=rounds)
    return GenFleet(bus, agents, RoundEngine(strat, coord, EngineConfig(method=method)))
