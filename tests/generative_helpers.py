"""Small label-skewed digit fleets for the generative-method tests (built by hand, no profiles)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fleet_helpers import digits

from fedge.common.initseeds import init_seeds
from fedge.common.inmemory import InMemoryBus
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.agent import DeviceAgent
from fedge.edge.data.partition import dirichlet, shards
from fedge.edge.methods import DeviceContext
from fedge.edge.models import build_seeded
from fedge.edge.training import TrainConfig
from fedge.fleet.registry import method_entry
from fedge.sim.inprocess import connect_inprocess

# Small CNNs train ~10x faster single-threaded than with two threads on a busy 2-core machine.
torch.set_num_threads(1)

ARCHS = ("cnn3-p32", "cnn2-p32", "cnn4-p32", "cnn1-p32")

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
    entry = method_entry(method)
    settings = entry.parse(method_config)  # once, for both halves, as a fleet config does
    pairs = []
    for i, (arch, idx) in enumerate(zip(archs, parts, strict=True)):
        model = build_seeded(arch, init_seeds(settings.shared_start(), run_seed=seed, index=i, arch=arch))
        n_test = max(2, len(idx) // 10)
        ctx = DeviceContext(f"d{i}", model, train.subset(idx[n_test:]), train.subset(idx[:n_test]),
                            TrainConfig(lr=0.05, batch_size=32, local_epochs=epochs), precision,
                            seed=seed * 1000 + i, method_config=settings, global_test=test, plan=dict(plan or {}))
        info = DeviceInfo(f"d{i}", model.spec.name, "test", precision, len(idx) - n_test, model.spec.feature_dim)
        pairs.append((entry.build_device(ctx), info))
    bus, coord, agents = connect_inprocess(pairs)
    strat = entry.build_strategy(settings, num_classes=10, rounds=rounds)
    return GenFleet(bus, agents, RoundEngine(strat, coord, EngineConfig(method=method)))
