"""[privacy] secure_aggregation in fedge simulate (fedge.sim.secure): the coordinator gets group sums only."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedge.common.privacy import PrivacySettings
from fedge.common.rounds import DeviceInfo, group_artifact
from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet
from fedge.secagg.fixedpoint import plan_field
from fedge.secagg.rounds import group_parameters
from fedge.secagg.terms import device_terms, segments
from fedge.sim.simulate import simulate


def fleet_doc(method: str, privacy: dict[str, Any] | None, *, devices: list[dict[str, Any]] | None = None,
              coordinator: dict[str, Any] | None = None, clock: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"run": {"method": method, "rounds": 1, "dataset": "digits", "seed": 3},
                           "partition": {"kind": "iid", "fraction": 0.15}, "train": {"local_epochs": 1},
                           "devices": devices or [{"profile": "rpi4-2gb", "count": 4, "arch": "tier-xs"}]}
    for key, table in (("privacy", privacy), ("coordinator", coordinator), ("clock", clock)):
        if table is not None:
            doc[key] = table
    return doc


@pytest.mark.parametrize(("method", "extra", "why"), [
    ("gefl", {}, "secure aggregation sums fedavg, fedproto, fedvtc uploads"),
    ("fedavg", {"coordinator": {"aggregation": "trimmed"}}, "trimmed / median .* a masked sum hides"),
    ("fedproto", {"coordinator": {"aggregation": "median"}}, "trimmed / median"),
    ("fedavg", {"coordinator": {"clip": 2.0}}, "trimmed / median \\(or clip > 0\\)"),
    ("fedavg", {"coordinator": {"mode": "async"}}, 'mode = "async" .* masks cancel only'),
])
def test_what_cannot_run_on_masked_sums_is_refused_at_load(method: str, extra: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=f"secure_aggregation: .*{why}"):
        parse_fleet(fleet_doc(method, {"secure_aggregation": True}, **extra))


@pytest.mark.parametrize(("table", "why"), [
    ({"clipping_range": 0.0}, "clipping_range must be a finite number > 0"),
    ({"field_bits": 8}, r"field_bits must be 0 \(chosen from the group size\) or in \[16, 64\]"),
    ({"threshold": 1}, "threshold = 1 would let any one share"),
    ({"neighbours": -2}, "neighbours must be >= 0"),
])
def test_bad_secure_aggregation_settings_are_refused(table: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_fleet(fleet_doc("fedavg", {"secure_aggregation": True, **table}))


def test_a_group_smaller_than_the_threshold_is_refused_naming_it() -> None:
    settings = PrivacySettings(secure_aggregation=True, threshold=3)
    assert group_parameters(settings, "tier-xs", 4) == (3, 3)
    with pytest.raises(ConfigError, match="group 'tier-s' has 2 device\\(s\\), fewer than the threshold 3"):
        group_parameters(settings, "tier-s", 2)
    with pytest.raises(ConfigError, match="group 'tier-m' has 1 device"):  # a sum of one is that device's values
        group_parameters(PrivacySettings(secure_aggregation=True), "tier-m", 1)
    cfg = parse_fleet(fleet_doc("fedavg", {"secure_aggregation": True, "threshold": 3},
                                devices=[{"profile": "rpi4-2gb", "count": 3, "arch": "tier-xs", "id_prefix": "a"},
                                         {"profile": "rpi4-2gb", "count": 2, "arch": "tier-s", "id_prefix": "b"}]))
    with pytest.raises(ConfigError, match="group 'tier-s' has 2 device"):
        simulate(cfg)  # before any round
    doc = fleet_doc("fedavg", {"secure_aggregation": True})
    doc["simulation"] = {"backend": "process"}
    with pytest.raises(ConfigError, match="secure_aggregation runs in the simulation with the sequential backend only "
                                          "\\(here: backend 'process'\\)"):
        simulate(parse_fleet(doc))


def test_statistics_terms_sum_to_the_strategies_sufficient_statistics() -> None:
    """FedVTC's terms summed are N, S1 = Σ n μ and S2 = Σ n (σ² + μ²); the counts come back exact."""
    rng = np.random.default_rng(0)
    spec = {"protos": ((3, 4), "float"), "counts": ((3,), "int"), "sigma": ((4,), "float")}
    ups = [{"protos": rng.normal(0, 1, (3, 4)), "counts": rng.integers(0, 50, 3), "sigma": rng.uniform(0, 1, 4)}
           for _ in range(5)]
    plan = plan_field(5, segments("fedvtc", spec, clip=8.0, cap=50.0))
    total = sum(plan.encode(device_terms("fedvtc", u, num_samples=50, cap=50.0, clip=8.0)) for u in ups)
    got = plan.decode_sum(np.asarray(total, dtype=plan.dtype), 5)
    n = sum(u["counts"] for u in ups)
    assert np.array_equal(np.rint(got["counts"]), n)
    s2 = sum(u["counts"][:, None] * (u["sigma"][None, :] ** 2 + u["protos"] ** 2) for u in ups)
    assert np.abs(got["s2"] - s2).max() <= plan.max_error(plan.segments[2])


@pytest.mark.parametrize(("method", "artifact"), [
    pytest.param("fedavg", group_artifact("tier-xs"), marks=pytest.mark.slow),  # ~20 s here: two runs of tier-xs
    ("fedproto", "prototypes"),
])
def test_a_secure_round_publishes_the_plain_rounds_global_state(method: str, artifact: str) -> None:
    plain = simulate(parse_fleet(fleet_doc(method, None)))
    secure = simulate(parse_fleet(fleet_doc(method, {"secure_aggregation": True})))
    assert set(secure.globals) == set(plain.globals) and artifact in secure.globals
    for name, want in plain.globals[artifact].items():
        got = secure.globals[artifact][name]
        assert got.shape == want.shape
        # fixed-point steps of a 32-bit field for 4 devices (~1e-8 of ±8) and float32 rounding of the mean
        assert np.abs(got.astype(np.float64) - want).max() <= 1e-5, name
    assert secure.reports[0].accepted == plain.reports[0].accepted  # every device's metrics still arrive


def test_a_group_below_the_threshold_is_abandoned_and_nothing_is_aggregated(caplog: pytest.LogCaptureFixture) -> None:
    """Every update misses the round's deadline in virtual time: the group's sum is abandoned, no global state is
    published, the devices are reported missing."""
    with caplog.at_level("WARNING", logger="fedge.sim.secure"):
        res = simulate(parse_fleet(fleet_doc("fedavg", {"secure_aggregation": True}, clock={"deadline_s": 0.001})))
    assert "round 1: group tier-xs's secure sum abandoned: group 'tier-xs' round 1: 0 devices advertised keys, " \
           "fewer than the threshold 3" in caplog.text
    assert res.globals == {}
    assert res.reports[0].missing == sorted(a.device.device_id for a in res.agents)


def test_a_coordinator_over_mqtt_sums_securely_and_workers_refuse() -> None:
    """`fedge coordinator run` gets the settings (its rounds are SecureRound, fedge.coordinator.secure); aggregation
    workers, which carry no stage messages, refuse the fleet naming why (relays carry them:
    tests/test_secagg_relays.py)."""
    import argparse

    from fedge.coordinator.fromfleet import engine_parts, refuse_secure_in_parts

    cfg = parse_fleet(fleet_doc("fedavg", {"secure_aggregation": True, "clipping_range": 4.0}))
    engine_cfg, _ = engine_parts(argparse.Namespace(), cfg, any_device=False)
    assert engine_cfg.secure is not None and engine_cfg.secure.clipping_range == 4.0
    with pytest.raises(ConfigError, match="runs with one coordinator per broker tree; aggregation workers do not "
                                          "carry its stage messages"):
        refuse_secure_in_parts(cfg, "aggregation workers")
    plain, _ = engine_parts(argparse.Namespace(), parse_fleet(fleet_doc("fedavg", None)), any_device=False)
    assert plain.secure is None


@pytest.mark.parametrize("method", ["fedproto", "fedvtc"])
def test_a_statistics_strategy_publishes_the_same_from_a_secure_sum(method: str) -> None:
    """The coordinator half fed one secure group sum publishes what it publishes from the plain uploads."""
    from fedge.common.rounds import class_stats_spec
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.coordinator.strategies.fedvtc import FedVTCStrategy
    from fedge.secagg.inprocess import run_group
    from fedge.secagg.messages import RoundSetup

    cls = FedProtoStrategy if method == "fedproto" else FedVTCStrategy
    rng = np.random.default_rng(5)
    spec = class_stats_spec(4, 6, with_sigma=method == "fedvtc")
    ups: dict[str, dict[str, np.ndarray]] = {
        f"d{i}": {"protos": rng.normal(0, 2, (4, 6)).astype(np.float32), "counts": rng.integers(0, 30, 4),
                  "sigma": rng.uniform(0, 1, 6).astype(np.float32)} for i in range(5)}
    for u in ups.values():
        u["counts"][0] = 0  # a class some devices lack
        if method == "fedproto":
            del u["sigma"]
    plain, secure = cls(num_classes=4, rounds=1), cls(num_classes=4, rounds=1)
    plain.begin_round(1)
    secure.begin_round(1)
    for dev, u in ups.items():
        plain.accumulate(DeviceInfo(dev, "tier-xs", "p", feature_dim=6), u, {})
    plan = plan_field(5, segments(method, spec, clip=8.0, cap=30.0))
    setup = RoundSetup(1, "fleet", tuple(sorted(ups)), 4, 3, plan, b"s")
    result = run_group(setup, {d: device_terms(method, u, num_samples=30, cap=30.0, clip=8.0) for d, u in ups.items()})
    secure.accumulate_group_sum("fleet", result.sums)
    (art, want), = plain.finish_round(1).items()
    got = secure.finish_round(1)[art]
    assert np.array_equal(got["counts"], want["counts"])
    for key in want:
        assert np.abs(got[key].astype(np.float64) - want[key]).max() <= 1e-5, key
