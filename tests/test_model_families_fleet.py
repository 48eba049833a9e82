"""A fleet of any model family: [model] family and [data] image_size, the planner choosing among a family's
measured tiers, the emulator's plans following the measured MACs, refusals at load (docs/models.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fedge.edge.models  # noqa: F401  (registers the measurer, as every training process does)
from fedge.common.families import FamilyArch, family_arch
from fedge.emulate.limits import device_plans
from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet
from fedge.fleet.slots import device_arch_spec, device_slots, family_specs
from fedge.profiles import load_profile, plan
from fedge.profiles.planner import train_memory_mb
from fedge.profiles.speed import speed_model


def fleet(family: str = "mobilenet", size: int = 96, method: str = "fedavg", source: str = "<memory>",
          devices: dict[str, int] | None = None) -> Any:
    groups = [{"profile": p, "count": n} for p, n in (devices or {"rpi-zero-2w": 1, "rpi4-4gb": 1}).items()]
    return parse_fleet({"run": {"name": "f", "method": method, "rounds": 1, "dataset": "digits"},
                        "model": {"family": family}, "data": {"image_size": size}, "devices": groups}, source=source)


def mobilenet_tiers(size: int) -> dict[str, FamilyArch]:
    return {t: family_arch("mobilenet", t, in_channels=1, input_size=(size, size))
            for t in ("xs", "s", "m", "l", "xl")}


def test_the_planner_gives_a_pi_zero_2w_a_96px_mobilenet_that_fits_its_memory() -> None:
    zero = load_profile("rpi-zero-2w")
    specs = mobilenet_tiers(96)
    p = plan(zero, specs=specs)
    chosen = specs[p.model_tier]
    assert p.arch == chosen.name == f"mobilenet-{p.model_tier}-96"
    assert p.params == chosen.num_params() and p.macs == chosen.macs()
    assert p.train_memory_mb == train_memory_mb(chosen, p.batch_size) <= zero.budgets.train_memory_mb
    # the biggest tier does not fit the Pi Zero at any batch, so the choice was a real one
    assert train_memory_mb(specs["xl"], 8) > zero.budgets.train_memory_mb or p.model_tier != "xl"
    assert "mobilenet-" in p.reasons["model_tier"] and "tier-" not in p.reasons["model_tier"]
    # a Jetson, with more memory and cores, never gets a smaller tier
    jetson = plan(load_profile("jetson-nano"), specs=specs)
    assert list(specs).index(jetson.model_tier) >= list(specs).index(p.model_tier)


def test_a_96px_round_takes_longer_than_a_32px_one_in_the_plan_and_the_emulators_plans() -> None:
    rpi4 = load_profile("rpi4-4gb")
    big, small = mobilenet_tiers(96)["s"], mobilenet_tiers(32)["s"]
    specs96, specs32 = {"s": big}, {"s": small}
    p96, p32 = plan(rpi4, specs=specs96, samples=300), plan(rpi4, specs=specs32, samples=300)
    # the epochs' part grows with the MACs; the round's fixed costs (per parameter: the same network) do not
    speed = speed_model(rpi4)
    f96, f32 = speed.round_fixed_s(big, p96.batch_size), speed.round_fixed_s(small, p32.batch_size)
    assert p96.round_time_s - f96 > 4 * (p32.round_time_s - f32) and p96.macs > 8 * p32.macs
    assert p96.round_time_s > 3 * p32.round_time_s
    # fedge emulate's per-device plans (the CPU quota follows their MAC rate) see the same
    cfg96 = fleet(size=96, devices={"rpi4-4gb": 1})
    cfg32 = fleet(size=32, devices={"rpi4-4gb": 1})
    (d96,), (d32,) = device_plans(cfg96, {"rpi4-4gb-1": 300}), device_plans(cfg32, {"rpi4-4gb-1": 300})
    e96, e32 = speed.round_fixed_s(big, d96.batch_size), speed.round_fixed_s(small, d32.batch_size)
    assert d96.macs > 8 * d32.macs and d96.round_time_s - e96 > 4 * (d32.round_time_s - e32)
    assert d96.train_memory_mb > d32.train_memory_mb


def test_fleet_slots_carry_the_familys_measured_networks() -> None:
    cfg = fleet(size=64, devices={"rpi-zero-2w": 1, "jetson-nano": 1})
    slots = device_slots(cfg)
    assert [s.arch for s in slots] == [s.plan.arch for s in slots]
    assert all(s.arch.startswith("mobilenet-") and s.arch.endswith("-64") for s in slots)
    assert slots[0].params <= slots[1].params
    assert slots[1].spec.input_shape == (1, 64, 64)
    # a [[devices]] arch names a tier of the family (or its full name)
    assert device_arch_spec(cfg, "s").name == "mobilenet-s-64" == device_arch_spec(cfg, "mobilenet-s-64").name
    with pytest.raises(ConfigError, match="not a tier of"):
        device_arch_spec(cfg, "tier-m")


def test_the_gefl_cnn_family_keeps_its_32px_input_and_plans() -> None:
    with pytest.raises(ConfigError, match="GeFL CNN family takes 1x32x32") as err:
        fleet(family="gefl-cnn", size=96)
    assert 'family = "mobilenet"' in (err.value.hint or "")
    cfg = fleet(family="gefl-cnn", size=32)
    assert family_specs(cfg) is None
    assert device_slots(cfg)[0].arch.startswith("tier-")


STEM_BY_TIER = '''
from torch import nn
TIERS = ("s", "m")

class Net(nn.Module):
    def __init__(self, stem, cin, classes, p):
        super().__init__()
        self.extractor = nn.Sequential(nn.Conv2d(cin, stem, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.embed = nn.Linear(stem, p)
        self.head = nn.Linear(p, classes)

def build(tier, in_channels, input_size, num_classes, embed_dim):
    return Net({"s": 4, "m": 8}[tier], in_channels, num_classes, embed_dim)
'''


def test_a_stem_that_differs_across_tiers_is_refused_for_methods_that_share_it(tmp_path: Path) -> None:
    (tmp_path / "stems.py").write_text(STEM_BY_TIER)
    source = str(tmp_path / "fleet.toml")
    cfg = fleet(family="stems.py:build", size=32, method="lgfedavg", source=source)
    assert cfg.family == f"{tmp_path / 'stems.py'}:build"  # relative to the fleet config
    with pytest.raises(ConfigError, match="stem output differs across tiers") as err:
        family_specs(cfg)
    assert "make the extractor identical at every tier" in (err.value.hint or "")
    ok = fleet(family="stems.py:build", size=32, method="fedavg", source=source)
    assert {s.name for s in (family_specs(ok) or {}).values()} == {"stems-s-32", "stems-m-32"}
