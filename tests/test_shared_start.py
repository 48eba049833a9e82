"""Issue 25: every part a method averages starts from the same weights on the devices that average it.

FedAvg of independently initialised networks mixes unrelated hidden units (McMahan et al., 2017);
fedge derives each averaged part's seed from the run's seed and the part (fedge.common.initseeds).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from fleet_helpers import digits

from fedge.common.initseeds import SharedStart, init_seeds, part_seed
from fedge.common.inmemory import InMemoryDeviceTransport
from fedge.common.messages import Message
from fedge.common.rounds import EXTRACTOR_PREFIX, DeviceInfo, RoundInfo, group_artifact
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.agent import DeviceAgent
from fedge.edge.data.partition import iid_fraction
from fedge.edge.methods import DeviceContext
from fedge.edge.methods.base import model_arrays
from fedge.edge.models import build_model, build_seeded
from fedge.edge.training import TrainConfig
from fedge.fleet.config import FleetConfig, parse_fleet
from fedge.fleet.devices import SimDevice, build_devices, load_fleet_data
from fedge.fleet.registry import BUILTIN_SETTINGS, method_entry
from fedge.sim.inprocess import connect_inprocess
from fedge.sim.report import build_results
from fedge.sim.simulate import simulate

ARCHS = ["tier-xs", "tier-s"]  # cycled over 4 devices: d0, d2 are tier-xs; d1, d3 tier-s

# (method, [method] table) -> (the group's network shared, the extractor shared over the fleet). Written
# out, not derived, so a change to what a method shares has to change this table too.
CASES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "local": ("local", {}, False, False),
    "fedavg": ("fedavg", {}, True, False),
    "lgfedavg": ("lgfedavg", {}, True, True),
    "fedproto": ("fedproto", {}, False, False),
    "gefl": ("gefl", {"gen_rounds": 1, "generator_tier": "tiny"}, True, True),
    "gefl-noavg": ("gefl", {"gen_rounds": 1, "generator_tier": "tiny", "avg_extractor": False}, True, False),
    "geflf": ("geflf", {"warmup_rounds": 1, "gen_rounds": 1, "generator_tier": "tiny"}, True, True),
    "fedvtc": ("fedvtc", {"generator_tier": "tiny"}, False, False),
}


def _fleet(method: str, method_cfg: dict[str, Any], *, seed: int = 0, count: int = 4) -> FleetConfig:
    return parse_fleet({
        "run": {"method": method, "rounds": 3, "dataset": "digits", "seed": seed},
        "partition": {"kind": "iid", "fraction": 0.3},
        "train": {"lr": 0.05, "local_epochs": 1, "batch_size": 16},
        "devices": [{"profile": "rpi3b", "count": count, "archs": ARCHS}],
        "method": method_cfg,
    })


def _state(d: SimDevice, prefix: str = "") -> dict[str, np.ndarray]:
    return {k: v for k, v in model_arrays(d.method.ctx.model).items() if k.startswith(prefix)}


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_every_built_in_method_is_in_the_table() -> None:
    assert {s.method for s in BUILTIN_SETTINGS} == {m for m, *_ in CASES.values()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_averaged_parts_start_equal_and_the_rest_does_not(case: str) -> None:
    method, table, group, fleet = CASES[case]
    cfg = _fleet(method, table)
    devices = build_devices(cfg, load_fleet_data(cfg))
    assert [d.info.arch for d in devices] == ARCHS * 2
    assert cfg.method_config.shared_start() == SharedStart(group, (EXTRACTOR_PREFIX,) if fleet else ())
    # Devices of one architecture: the whole network equal before the first local step, or not at all.
    for a, b in ((0, 2), (1, 3)):
        assert _equal(_state(devices[a]), _state(devices[b])) is group, (case, a, b)
    # The stem, across architectures: equal exactly when the fleet averages it.
    stems = [_state(d, EXTRACTOR_PREFIX) for d in devices]
    assert len(stems[0]) == 6  # conv weight and bias, BN weight, bias, running mean and variance
    assert _equal(stems[0], stems[1]) is fleet, case


def test_seeds_depend_on_the_run_and_the_part_only() -> None:
    a = init_seeds(SharedStart(group=True, fleet=(EXTRACTOR_PREFIX,)), run_seed=3, index=0, arch="tier-m")
    b = init_seeds(SharedStart(group=True, fleet=(EXTRACTOR_PREFIX,)), run_seed=3, index=7, arch="tier-m")
    assert a == b
    assert a.model == part_seed(3, "group/tier-m") != part_seed(4, "group/tier-m")
    assert a.parts == (("extractor.", part_seed(3, "extractor")),)
    # The documented formula (docs/protocol.md), so a device written elsewhere derives the same number.
    import hashlib

    digest = hashlib.sha256(b"fedge-init/3/group/tier-m").digest()
    assert a.model == int.from_bytes(digest[:8], "big") >> 1 < 2**63
    per_device = init_seeds(SharedStart(), run_seed=3, index=7, arch="tier-m")
    assert per_device.model == 3007 and per_device.parts == ()
    torch.manual_seed(per_device.model)  # accepted by torch: no overflow


def test_a_reinitialised_part_is_the_same_on_every_architecture() -> None:
    seeds = init_seeds(SharedStart(fleet=(EXTRACTOR_PREFIX,)), run_seed=0, index=0, arch="x")
    nets = [build_seeded(arch, seeds) for arch in ("tier-xs", "tier-l", "cnn3")]
    stems = [model_arrays(n, [EXTRACTOR_PREFIX]) for n in nets]
    assert _equal(stems[0], stems[1]) and _equal(stems[0], stems[2])
    # ... and a fresh draw, not the model seed's stem.
    plain = model_arrays(build_model("tier-xs", seed=seeds.model), [EXTRACTOR_PREFIX])
    assert not _equal(stems[0], plain)


def test_a_device_that_joins_later_starts_from_the_current_global_state() -> None:
    train, test = digits()
    settings = method_entry("fedavg").parse({})
    parts = iid_fraction(train.y, 3, 0.5, 0)

    def device(i: int, seed: int) -> tuple[Any, Any]:
        model = build_model("tier-xs", seed=seed)  # a fresh initialisation of its own, on purpose
        ctx = DeviceContext(f"d{i}", model, train.subset(parts[i][20:]), train.subset(parts[i][:20]),
                            TrainConfig(lr=0.05, batch_size=32, local_epochs=1), "fp32", seed=i,
                            method_config=settings, global_test=test)
        return method_entry("fedavg").build_device(ctx), DeviceInfo(f"d{i}", "tier-xs", "test", "fp32",
                                                                   len(parts[i]) - 20, model.spec.feature_dim)

    bus, coord, agents = connect_inprocess([device(0, 0), device(1, 0)])
    engine = RoundEngine(method_entry("fedavg").build_strategy(settings, num_classes=10, rounds=4), coord,
                         EngineConfig(method="fedavg"))
    engine.run_round(1)
    engine.run_round(2)
    after_two = Message.from_bytes(bus.globals[group_artifact("tier-xs")]).tensors  # retained after round 2
    late_method, late_info = device(2, 99)
    late = DeviceAgent(late_method, InMemoryDeviceTransport(bus), late_info)
    seen: dict[str, np.ndarray] = {}
    train_round = late_method.train_round

    def first_step(info: RoundInfo) -> Any:
        seen.update(model_arrays(late_method.ctx.model))
        return train_round(info)

    late_method.train_round = first_step
    late.hello()
    agents.append(late)  # the bus steps it from now on
    engine.run_round(3)
    assert seen, "the late device never trained"
    assert after_two.keys() <= seen.keys()
    assert all(np.array_equal(seen[k], v) for k, v in after_two.items())
    assert not _equal(seen, model_arrays(build_model("tier-xs", seed=99)))  # not its own fresh start


def _final_acc(cfg: FleetConfig) -> float:
    return float(build_results(simulate(cfg))["summary"]["mean_final_acc_global"])


@pytest.mark.slow
def test_fedavg_of_one_group_learns_from_one_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 devices of one architecture, IID digits, 3 rounds: as shipped (one start) against the same
    fleet whose devices start from their own seeds, as fedge did before issue 25. Measured: 80.4 %
    against 10.4 % (chance: the first averages cancel out); with 5 rounds 88.4 % against 57.3 %.

    Pinned: every last batch alone (``min_tail = 1``) and no validation fold, the shares these figures were
    measured on (134 samples a device: 5 SGD steps an epoch; re-measured with the pins: 79.8 %, 80.4 % with one
    torch thread). Issue 45's defaults give each device 4 (121
    samples after its 13-image fold, or the last 6 joined to the batch before), and this fleet sits on the
    steepest part of its curve at round 3 (mean 24 % after round 2): measured 39.8 % at round 3, then 82.0 %
    and 89.1 % at rounds 4 and 5 against 86.4 % and 88.0 % pinned — a fraction of a round later, not worse.
    """
    cfg = parse_fleet({
        "run": {"method": "fedavg", "rounds": 3, "dataset": "digits", "seed": 0},
        "partition": {"kind": "iid"},
        "train": {"lr": 0.05, "local_epochs": 2, "batch_size": 32, "min_tail": 1, "val_fraction": 0.0,
                  "lr_schedule": "constant"},  # measured at one rate (issue 45's plan anneals it)
        "devices": [{"profile": "rpi4-4gb", "count": 8, "arch": "tier-m"}],
    })
    shared = _final_acc(cfg)
    import fedge.fleet.devices as devices_mod

    orig = devices_mod.init_seeds
    monkeypatch.setattr(devices_mod, "init_seeds", lambda start, **kw: orig(SharedStart(), **kw))
    own = _final_acc(cfg)
    assert shared >= 0.75, shared
    assert shared - own >= 0.30, (shared, own)
