"""Small fleets built by hand (no profiles) for engine-level tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedge.common.inmemory import InMemoryBus
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.coordinator.strategies import strategy
from fedge.edge.agent import DeviceAgent
from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.data.partition import iid_fraction
from fedge.edge.methods import DeviceContext, device_method
from fedge.edge.models import build_model
from fedge.edge.training import TrainConfig
from fedge.sim.inprocess import connect_inprocess


@dataclass
class Fleet:
    bus: InMemoryBus
    agents: list[DeviceAgent]
    engine: RoundEngine


def digits() -> tuple[Dataset, Dataset]:
    return load_dataset("digits", train=True), load_dataset("digits", train=False)


def tiny_fleet(method: str, archs: list[str], *, rounds: int = 2, precision: str = "fp32",
               method_config: dict | None = None, seed: int = 0) -> Fleet:
    train, test = digits()
    parts = iid_fraction(train.y, len(archs), 0.5, seed)
    pairs = []
    for i, (arch, idx) in enumerate(zip(archs, parts, strict=True)):
        model = build_model(arch, seed=seed * 1000 + i)
        ctx = DeviceContext(f"d{i}", model, train.subset(idx[20:]), train.subset(idx[:20]),
                            TrainConfig(lr=0.05, batch_size=32, local_epochs=1), precision, seed=seed * 1000 + i,
                            method_config=method_config or {}, global_test=test)
        info = DeviceInfo(f"d{i}", model.spec.name, "test", precision, len(idx) - 20, model.spec.feature_dim)
        pairs.append((device_method(method)(ctx), info))
    bus, coord, agents = connect_inprocess(pairs)
    strat = strategy(method)(method_config or {}, num_classes=10, rounds=rounds)
    engine = RoundEngine(strat, coord, EngineConfig(method=method))
    return Fleet(bus, agents, engine)


def weights(fleet: Fleet, i: int) -> dict[str, np.ndarray]:
    from fedge.edge.methods.base import model_arrays

    return model_arrays(fleet.agents[i].method.ctx.model)
