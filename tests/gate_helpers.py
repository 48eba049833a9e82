"""A statistics-only FedProto fleet for gate tests: the real engine and strategy, hand-made device messages.

No model is trained: each device's update is a seeded (C, p) prototype matrix and
class counts that sum to its sample count, so the expected global state is known
exactly and any message the tests inject can be judged against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport
from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.coordinator.strategies.fedproto import FedProtoStrategy

FLEET, CLASSES, DIM = "gate", 10, 64


def device(i: int, **over: object) -> DeviceInfo:
    d = {"device_id": f"d{i}", "arch": "tier-xs", "profile": "test", "upload_precision": "fp32",
         "num_samples": 100 + 10 * i, "feature_dim": DIM, "extra": {}}
    d.update(over)
    return DeviceInfo(**d)  # type: ignore[arg-type]


def hello(dev: DeviceInfo | dict[str, object], sender: str | None = None) -> bytes:
    raw = dev.to_dict() if isinstance(dev, DeviceInfo) else dev
    return Message("hello", sender or str(raw["device_id"]), 0, FLEET, info={"device": raw}).to_bytes()


def honest_arrays(dev: DeviceInfo, rnd: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rnd * 1000 + int(dev.device_id[1:]))
    counts = rng.multinomial(dev.num_samples, np.full(CLASSES, 1 / CLASSES)).astype(np.int64)
    return {"protos": rng.normal(size=(CLASSES, dev.feature_dim)).astype(np.float32), "counts": counts}


def honest_update(dev: DeviceInfo, rnd: int, precision: str = "fp32") -> bytes:
    return Message("update", dev.device_id, rnd, FLEET, tensors=honest_arrays(dev, rnd),
                   info={"metrics": {"acc_global": 0.5}, "bytes_down": 10, "num_samples": dev.num_samples,
                         "loss": 0.1}).to_bytes(precision)


@dataclass
class StatsFleet:
    """The engine plus what each round injects before (``before``) the honest devices' updates."""

    bus: InMemoryBus
    engine: RoundEngine
    devices: list[DeviceInfo]
    before: dict[int, list[bytes]] = field(default_factory=dict)
    hellos_during: dict[int, list[bytes]] = field(default_factory=dict)
    honest: Callable[[DeviceInfo, int], bytes] = honest_update

    def pump(self) -> None:
        rnd = self.engine.gate._round
        self.bus.hellos.extend(self.hellos_during.get(rnd, []))
        self.bus.updates.extend(self.before.get(rnd, []))
        self.bus.updates.extend(self.honest(d, rnd) for d in self.devices)


def stats_fleet(n: int = 3, *, rounds: int = 1, state_dir: Path | None = None, extra_hellos: Sequence[bytes] = (),
                config: EngineConfig | None = None, **kw: object) -> StatsFleet:
    bus = InMemoryBus()
    strat = FedProtoStrategy(num_classes=CLASSES, rounds=rounds)
    cfg = config or EngineConfig(fleet=FLEET, method="fedproto", **kw)  # type: ignore[arg-type]
    devices = [device(i) for i in range(n)]
    bus.hellos.extend(hello(d) for d in devices)
    bus.hellos.extend(extra_hellos)
    engine = RoundEngine(strat, InMemoryCoordinatorTransport(bus), cfg, state_dir=state_dir)
    fleet = StatsFleet(bus, engine, devices)
    bus.pump = fleet.pump
    return fleet


def expected_prototypes(devices: list[DeviceInfo], rnd: int) -> tuple[np.ndarray, np.ndarray]:
    """The count-weighted mean of the honest devices' round-``rnd`` prototypes, and the summed counts."""
    arrays = [honest_arrays(d, rnd) for d in devices]
    counts = np.sum([a["counts"] for a in arrays], axis=0)
    sums = np.sum([a["protos"].astype(np.float64) * a["counts"][:, None] for a in arrays], axis=0)
    return sums / np.maximum(counts, 1)[:, None], counts
