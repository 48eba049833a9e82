"""``info.train_s``: what a device reports as its round's work, on its own clock (issue 27's clock honesty)."""

from __future__ import annotations

from typing import Any

from fleet_helpers import digits

from fedge.common.inmemory import InMemoryBus, InMemoryDeviceTransport
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.data.partition import iid_fraction
from fedge.edge.methods import DeviceContext
from fedge.edge.models import build_model
from fedge.edge.training import TrainConfig
from fedge.fleet.registry import method_entry
from fedge.sim.inprocess import connect_inprocess

LINK_S = 100.0  # what each fetch of a global state waits on the link, on the device's clock


class ManualClock:
    """The device's clock: moves only when the link is waited on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowLink(InMemoryDeviceTransport):
    """The in-memory transport, with every fetch of a global state taking :data:`LINK_S` on ``clock``."""

    def __init__(self, bus: InMemoryBus, clock: ManualClock) -> None:
        super().__init__(bus)
        self.clock, self.fetches = clock, 0

    def fetch_global(self, artifact: str) -> bytes | None:
        data = super().fetch_global(artifact)
        if data is not None:
            self.clock.now += LINK_S
            self.fetches += 1
        return data


def test_train_s_leaves_out_the_wait_for_the_global_state() -> None:
    # The virtual clock counts fetching the global state as the download (bytes over the link); the device's
    # train_s is its compute: applying, evaluating, training. A device on a 150 ms link measured the fetch's
    # round trip inside train_s and so looked slower than its compute.
    train, test = digits()
    settings = method_entry("fedavg").parse({})
    parts = iid_fraction(train.y, 2, 0.3, 0)

    def device(i: int) -> tuple[Any, DeviceInfo]:
        model = build_model("tier-xs", seed=0)
        ctx = DeviceContext(f"d{i}", model, train.subset(parts[i][20:]), train.subset(parts[i][:20]),
                            TrainConfig(lr=0.05, batch_size=32, local_epochs=1), "fp32", seed=i,
                            method_config=settings, global_test=test)
        return method_entry("fedavg").build_device(ctx), DeviceInfo(f"d{i}", "tier-xs", "test", "fp32",
                                                                   len(parts[i]) - 20, model.spec.feature_dim)

    bus, coord, agents = connect_inprocess([device(0), device(1)])
    clock = ManualClock()
    link = SlowLink(bus, clock)
    agents[0].transport, agents[0].timer = link, clock
    engine = RoundEngine(method_entry("fedavg").build_strategy(settings, num_classes=10, rounds=3), coord,
                         EngineConfig(method="fedavg"))
    first = engine.run_round(1)  # nothing aggregated yet: nothing to fetch
    assert link.fetches == 0 and first.train_s["d0"] == 0.0
    report = engine.run_round(2)  # round 1's global state is fetched now, and the link takes LINK_S
    assert link.fetches == 1 and clock.now == LINK_S
    assert report.train_s["d0"] == 0.0  # the clock did not move while the device worked
    assert report.bytes_down["d0"] > 0 and report.train_s["d1"] > 0  # the fetch happened; d1 timed its work
