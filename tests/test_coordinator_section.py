"""``[coordinator]`` as one typed section, parsed once at load, and one engine configuration for
``fedge simulate`` and ``fedge coordinator run``: a typo is refused with the closest key, every value is
range-checked, robust aggregation means the same in a simulation as over MQTT, and what a simulation cannot
apply (wall-clock deadlines, the quorum) is refused naming why."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.common.coordinator_section import Aggregation, CoordinatorSection
from fedge.common.rounds import RoundInfo
from fedge.coordinator.engine import RoundEngine, RoundReport
from fedge.edge.methods.fedproto import FedProtoDevice
from fedge.errors import ConfigError
from fedge.fleet.config import FleetConfig, load_fleet, parse_fleet
from fedge.fleet.devices import SimDevice
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet, run_rounds, simulate

FLEET: dict[str, Any] = {"run": {"method": "fedavg", "rounds": 1},
                         "devices": [{"profile": "rpi4-2gb", "count": 4, "arch": "tier-xs"}]}


def refused(table: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_fleet({**FLEET, "coordinator": table}, source="fleet.toml")
    return err.value


def test_a_typo_is_refused_with_the_closest_key(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[run]\nmethod = "fedavg"\nrounds = 1\n[[devices]]\nprofile = "rpi4-2gb"\n'
                    "[coordinator]\nquorom = 0.8\n")
    with pytest.raises(ConfigError) as err:
        load_fleet(path)
    assert err.value.message == f"{path}: [coordinator] unknown key 'quorom'"
    assert err.value.hint == "did you mean 'quorum'?"
    # what the section resolves itself is no key of the table
    assert refused({"sampling": {"sample": 2}}).message == "fleet.toml: [coordinator] unknown key 'sampling'"


@pytest.mark.parametrize(("table", "message", "fix"), [
    ({"quorum": 1.5}, "quorum = 1.5: must be a fraction in [0, 1]", "quorum = 0.8"),
    ({"min_devices": -1}, "min_devices = -1: must be >= 0", "e.g. 1"),
    ({"deadline_slack": -2.0}, "deadline_slack = -2: must be a finite number >= 0", "slowest expected device"),
    ({"round_timeout_s": float("inf")}, "round_timeout_s = inf: must be a finite number >= 0", "300"),
    ({"min_round_s": 10, "max_round_s": 5}, "min_round_s = 10 > max_round_s = 5", "must not exceed"),
    ({"max_update_bytes": 0}, "max_update_bytes = 0: must be >= 1", "64 MiB"),
    ({"aggregation": "trimmed", "trim": 0.5}, "trim must be in [0, 0.5), got 0.5", ""),
    ({"aggregation": "mode"}, "unknown aggregation 'mode'", "mean, trimmed, median"),
    ({"clip": -1.0}, "clip must be >= 0 (0: off), got -1.0", ""),
    ({"mode": "asynch"}, "mode = 'asynch': unknown mode", '"async"'),
    ({"quorum": "most"}, "key 'quorum' = 'most' is not float | None", "e.g. 0.8"),
])
def test_every_value_is_range_checked_at_load(table: dict[str, Any], message: str, fix: str) -> None:
    err = refused(table)
    assert err.message == f"fleet.toml: [coordinator] {message}"
    assert fix in (err.hint or "")


def test_the_section_is_typed_and_flags_override_it_without_losing_what_was_resolved() -> None:
    cfg = parse_fleet({**FLEET, "coordinator": {"aggregation": "median", "quorum": 0.9, "sample": 2}})
    section = cfg.coordinator
    assert isinstance(section, CoordinatorSection)
    assert section.aggregation_rule() == Aggregation("median", 0.2, 0.0)
    assert section.sampling is not None and section.sampling.count == 2 and section.asynchronous is None
    flagged = section.override(quorum=0.3, clip=2.0)
    assert (flagged.quorum, flagged.aggregation_rule()) == (0.3, Aggregation("median", 0.2, 2.0))
    assert flagged.sampling == section.sampling
    with pytest.raises(ConfigError, match=r"quorum = 2: must be a fraction"):
        section.override(quorum=2)


@pytest.mark.parametrize(("table", "says", "fix"), [
    ({"deadline_slack": 3.0}, "[coordinator] deadline_slack = 3.0: fedge simulate runs rounds on the virtual clock, "
                              "whose deadline is [clock] deadline_s", "--deadline-slack to fedge coordinator run"),
    ({"min_round_s": 60}, "min_round_s = 60: fedge simulate runs rounds on the virtual clock", "--min-round"),
    ({"quorum": 0.8}, "[coordinator] quorum = 0.8: in fedge simulate every device says hello before round 1 and "
                      "[clock] availability decides who is online", "--quorum to fedge coordinator run"),
])
def test_what_a_simulation_cannot_apply_is_refused_naming_why(table: dict[str, Any], says: str, fix: str) -> None:
    cfg = parse_fleet({**FLEET, "coordinator": table}, source="fleet.toml")  # fine for fedge coordinator run
    with pytest.raises(ConfigError) as err:
        simulate(cfg)
    assert err.value.message.startswith("fleet.toml: ") and says in err.value.message
    assert "host's speed" in err.value.message or "real devices to connect" in err.value.message
    assert fix in (err.value.hint or "")


# -- robust aggregation means the same in a simulation as over MQTT ---------------------------------------------

POISONED_FLEET = """
[run]
method = "fedproto"
rounds = 3
dataset = "digits"
fleet = "robust"
seed = 1

[partition]
kind = "dirichlet"
alpha = 1.0

[method]
inference = "prototype"

[coordinator]
aggregation = "{rule}"
trim = 0.2

[[devices]]
profile = "rpi4-2gb"
count = 5
arch = "tier-xs"
"""


class PoisoningFedProto(FedProtoDevice):
    """Uploads its prototypes sign-flipped and scaled by 10 (as ``benchmarks/robustness.py``'s poisoners)."""

    def train_round(self, info: RoundInfo) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, extra = super().train_round(info)
        arrays["protos"] = (-10.0 * arrays["protos"]).astype(np.float32)
        return arrays, extra


def poisoned(cfg: FleetConfig) -> tuple[list[SimDevice], Any]:
    """The fleet of ``cfg`` with its first device (20 % of five) poisoning, and the coordinator's strategy."""
    devices, strat = build_fleet(cfg)
    devices[0].method = PoisoningFedProto(devices[0].method.ctx)
    return devices, strat


def honest_accuracy(reports: list[RoundReport]) -> dict[str, float]:
    return {d: m["acc_global"] for d, m in sorted(reports[-1].metrics.items()) if not d.endswith("-1")}


@pytest.mark.slow
def test_a_simulated_trimmed_fleet_with_poisoners_ends_where_the_mqtt_run_does(tmp_path: Path, mosquitto: Any) -> None:
    from fedge.coordinator.fromfleet import engine_parts

    path = tmp_path / "fleet.toml"
    path.write_text(POISONED_FLEET.format(rule="trimmed"))
    cfg = load_fleet(path)
    _, sim_reports = run_rounds(cfg, *poisoned(cfg))
    simulated = honest_accuracy(sim_reports)

    # The same fleet config through `fedge coordinator run`'s engine configuration, over a real Mosquitto (the
    # flags turn its wall-clock deadline off: the rounds wait for every device, as in the simulation).
    devices, _ = poisoned(cfg)
    args = argparse.Namespace(deadline_slack=0.0, round_timeout=0.0)
    engine_cfg, strat = engine_parts(args, cfg, any_device=False)
    assert engine_cfg.aggregation == Aggregation("trimmed", 0.2, 0.0)
    coord, _, stop = start_fleet(cfg, devices, mosquitto.settings())
    assert coord is not None
    try:
        over_mqtt = honest_accuracy(RoundEngine(strat, coord, engine_cfg).run())
    finally:
        stop()
    assert list(simulated) == ["rpi4-2gb-2", "rpi4-2gb-3", "rpi4-2gb-4", "rpi4-2gb-5"]
    # Exactly: the robust rule combines the updates in an order fixed by their content, not by their arrival
    # (before, one device's accuracy ended 0.498 over MQTT vs 0.544 simulated when the arrival order differed).
    assert over_mqtt == simulated

    # ... and the rule was applied in the simulation: the plain mean of the same fleet is poisoned
    path.write_text(POISONED_FLEET.format(rule="mean"))
    mean_cfg = load_fleet(path)
    _, mean_reports = run_rounds(mean_cfg, *poisoned(mean_cfg))
    plain = honest_accuracy(mean_reports)
    # Measured: 0.45 vs 0.29 with issue 45's defaults (lr 0.05, min_tail 8, a validation fold), 0.49 vs 0.23 before
    # them; a rule that was not applied gives the same figure twice.
    assert np.mean(list(simulated.values())) > np.mean(list(plain.values())) + 0.1, (simulated, plain)
