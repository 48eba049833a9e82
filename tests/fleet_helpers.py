"""Small fleets built by hand (no profiles) for engine-level tests, and what the tests share about fleets:
the digits data set (loaded once) and the capture of every upload a fleet's devices send."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fedge.common.asyncmode import AsyncSettings
from fedge.common.initseeds import init_seeds
from fedge.common.inmemory import InMemoryBus
from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.sampling import Sampling
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.agent import DeviceAgent
from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.data.partition import iid_fraction
from fedge.edge.methods import DeviceContext
from fedge.edge.models import build_seeded
from fedge.edge.training import TrainConfig
from fedge.fleet.registry import method_entry
from fedge.sim.inprocess import connect_inprocess


@dataclass
class Fleet:
    bus: InMemoryBus
    agents: list[DeviceAgent]
    engine: RoundEngine


_DIGITS: tuple[Dataset, Dataset] | None = None


def digits() -> tuple[Dataset, Dataset]:
    """The digits train and test sets, loaded once per test session."""
    global _DIGITS
    if _DIGITS is None:
        _DIGITS = (load_dataset("digits", train=True), load_dataset("digits", train=False))
    return _DIGITS


class Upload(NamedTuple):
    """One update as a device sent it: the encoded bytes and their decoded message."""

    data: bytes
    msg: Message


def capture_uploads(agents: Sequence[DeviceAgent]) -> list[Upload]:
    """Wrap each agent's ``send_update`` so every upload is also kept (in sending order) in the returned list."""
    seen: list[Upload] = []
    for a in agents:
        orig = a.transport.send_update

        def send(data: bytes, orig: Callable[[bytes], None] = orig) -> None:
            seen.append(Upload(data, Message.from_bytes(data)))
            orig(data)

        a.transport.send_update = send  # type: ignore[method-assign]
    return seen


def tiny_fleet(method: str, archs: list[str], *, rounds: int = 2, precision: str = "fp32",
               method_config: dict | None = None, seed: int = 0, profiles: Sequence[str] | None = None,
               sampling: Sampling | None = None, asynchronous: AsyncSettings | None = None) -> Fleet:
    train, test = digits()
    entry = method_entry(method)
    settings = entry.parse(method_config)
    parts = iid_fraction(train.y, len(archs), 0.5, seed)
    pairs = []
    for i, (arch, idx) in enumerate(zip(archs, parts, strict=True)):
        model = build_seeded(arch, init_seeds(settings.shared_start(), run_seed=seed, index=i, arch=arch))
        ctx = DeviceContext(f"d{i}", model, train.subset(idx[20:]), train.subset(idx[:20]),
                            TrainConfig(lr=0.05, batch_size=32, local_epochs=1), precision, seed=seed * 1000 + i,
                            method_config=settings, global_test=test)
        profile = profiles[i] if profiles is not None else "test"
        info = DeviceInfo(f"d{i}", model.spec.name, profile, precision, len(idx) - 20, model.spec.feature_dim)
        pairs.append((entry.build_device(ctx), info))
    bus, coord, agents = connect_inprocess(pairs)
    strat = entry.build_strategy(settings, num_classes=10, rounds=rounds)
    engine = RoundEngine(strat, coord, EngineConfig(method=method, sampling=sampling, asynchronous=asynchronous))
    return Fleet(bus, agents, engine)


def weights(fleet: Fleet, i: int) -> dict[str, np.ndarray]:
    from fedge.edge.methods.base import model_arrays

    return model_arrays(fleet.agents[i].method.ctx.model)
