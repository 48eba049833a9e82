"""Client sampling (issue 27, item 3): the count, the selections, seeds, the engine and the gate, bad settings."""

from __future__ import annotations

from collections import Counter

import pytest
from fleet_helpers import capture_uploads, tiny_fleet

from fedge.common.messages import Message
from fedge.common.sampling import Sampling, parse_sampling
from fedge.common.transport import Inbound
from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet

# 12 devices of three profiles: 6 Zeros, 3 Pi 4s, 3 gateways
PROFILES = {f"z{i}": "rpi-zero-2w" for i in range(6)} | {f"p{i}": "rpi4-4gb" for i in range(3)} | {
    f"g{i}": "x86-gateway" for i in range(3)}


def test_count_from_a_fraction_or_a_count() -> None:
    assert Sampling(0.1, fleet_size=200).count == 20
    assert Sampling(0.01, fleet_size=20).count == 1  # never zero
    assert Sampling(7, fleet_size=200).count == 7
    assert Sampling(1.0, fleet_size=5).full and not Sampling(4, fleet_size=5).full


@pytest.mark.parametrize("selection", ["uniform", "available", "balanced"])
def test_picks_the_configured_count_seeded_and_repeatable(selection: str) -> None:
    s = Sampling(6, selection, fleet_size=12, seed=4)
    online = list(PROFILES)
    picks = [s.choose(r, PROFILES, online) for r in range(1, 21)]
    assert all(len(p) == 6 == len(set(p)) for p in picks)
    assert picks == [s.choose(r, dict(reversed(PROFILES.items())), reversed(online)) for r in range(1, 21)]
    assert len({tuple(p) for p in picks}) > 10  # rounds differ
    other = Sampling(6, selection, fleet_size=12, seed=5)
    assert [other.choose(r, PROFILES, online) for r in range(1, 21)] != picks  # the seed matters
    # over many rounds every device gets its turn
    assert set().union(*picks) == set(PROFILES)


def test_balanced_spreads_over_profiles() -> None:
    s = Sampling(6, "balanced", fleet_size=12, seed=0)
    for r in range(1, 30):
        got = Counter(PROFILES[d] for d in s.choose(r, PROFILES, PROFILES))
        assert got == {"rpi-zero-2w": 2, "rpi4-4gb": 2, "x86-gateway": 2}, r
    # uniform over this fleet draws Zeros in half of its picks on average; balanced never more than a third
    u = Sampling(6, "available", fleet_size=12, seed=0)
    zeros = sum(PROFILES[d] == "rpi-zero-2w" for r in range(1, 201) for d in u.choose(r, PROFILES, PROFILES))
    assert 0.4 < zeros / 1200 < 0.6
    # 7 of 12: one profile (drawn at random) gets the 7th; with one gateway online the others fill its slots
    seven = Sampling(7, "balanced", fleet_size=12, seed=0)
    assert sorted(Counter(PROFILES[d] for d in seven.choose(1, PROFILES, PROFILES)).values()) == [2, 2, 3]
    online = [d for d in PROFILES if d not in ("g1", "g2")]
    got = Counter(PROFILES[d] for d in s.choose(3, PROFILES, online))
    assert got["x86-gateway"] == 1 and sum(got.values()) == 6 and got["rpi4-4gb"] >= 2


def test_available_never_picks_an_offline_device_uniform_may() -> None:
    online = [d for d in PROFILES if not d.startswith("z")]  # every Zero offline
    avail = Sampling(4, "available", fleet_size=12, seed=1)
    assert all(not d.startswith("z") for r in range(1, 50) for d in avail.choose(r, PROFILES, online))
    uni = Sampling(4, "uniform", fleet_size=12, seed=1)
    assert any(d.startswith("z") for r in range(1, 50) for d in uni.choose(r, PROFILES, online))
    # fewer candidates than the count: all of them
    assert avail.choose(1, PROFILES, ["p0", "g0"]) == ["g0", "p0"]


FLEET = {"run": {"method": "fedavg", "rounds": 1}, "devices": [{"profile": "rpi4-4gb", "count": 4}]}


@pytest.mark.parametrize(("table", "message", "fix"), [
    ({"sample": 0}, "sample = 0: must be a fraction in (0, 1] or a device count >= 1", "sample = 0.1"),
    ({"sample": -0.5}, "sample = -0.5: must be a fraction", "sample = 0.1"),
    ({"sample": 1.5}, "sample = 1.5: a fraction must be at most 1", "write a count as an integer"),
    ({"sample": 5}, "sample = 5: more devices than the fleet's 4", "sample at most 4 devices"),
    ({"sample": 2, "selection": "random"}, "selection = 'random': unknown selection", "'balanced'"),
    ({"selection": "balanced"}, "selection = 'balanced' without sample", "add sample = 0.1"),
    ({"sample": "10%"}, "sample = '10%': must be a fraction", "sample = 0.1"),
])
def test_bad_settings_are_refused_at_load(table: dict, message: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fleet({**FLEET, "coordinator": table}, source="fleet.toml")
    assert "[coordinator]" in err.value.message and message in err.value.message
    assert err.value.message.startswith("fleet.toml: ")
    assert fix in (err.value.hint or "")


def test_fleet_config_carries_the_sampling() -> None:
    cfg = parse_fleet({**FLEET, "coordinator": {"sample": 0.5, "selection": "balanced"}})
    assert cfg.sampling == Sampling(0.5, "balanced", fleet_size=4, seed=0) and cfg.sampling.count == 2
    assert parse_fleet(FLEET).sampling is None
    assert parse_sampling({}, fleet_size=4, seed=0) is None


def test_engine_asks_only_the_sampled_and_unsampled_devices_send_nothing() -> None:
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 4, rounds=3, profiles=["a", "a", "b", "b"],
                       sampling=Sampling(2, "balanced", fleet_size=4, seed=7))
    uploads = capture_uploads(fleet.agents)
    reports = fleet.engine.run()
    training, final = reports[:-1], reports[-1]
    for rep in training:
        assert len(rep.sampled) == 2 and {"a", "b"} == {fleet.engine.devices[d].profile for d in rep.sampled}
        assert sorted(rep.accepted) == rep.sampled and rep.missing == [] and rep.rejected == {}
        sent = sorted(u.msg.sender for u in uploads if u.msg.round == rep.round)
        assert sent == rep.sampled  # an unsampled device sends nothing at all
    assert final.sampled == [] and len(final.accepted) == 4  # every device evaluates the final model
    for a in fleet.agents:  # and trains only in the rounds it was sampled for
        asked = [r.round for r in training if a.device.device_id in r.sampled]
        assert [t.round for t in a.traffic] == [*asked, final.round]
    # the same seed samples the same devices again
    again = tiny_fleet("fedavg", ["tier-xs"] * 4, rounds=3, profiles=["a", "a", "b", "b"],
                       sampling=Sampling(2, "balanced", fleet_size=4, seed=7))
    assert [r.sampled for r in again.engine.run()] == [r.sampled for r in reports]


def test_the_descriptor_lists_the_sampled_and_the_gate_refuses_the_others() -> None:
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 3, rounds=1, sampling=Sampling(1, fleet_size=3, seed=0))
    uploads = capture_uploads(fleet.agents)
    rep = fleet.engine.run_round(1)
    descriptor = Message.from_bytes(fleet.bus.round_msg or b"")
    assert descriptor.info["round"]["sampled"] == rep.sampled and len(rep.sampled) == 1
    # an unsampled device that answers anyway: the sampled device's real update, sent under its name
    other = next(a for a in fleet.agents if a.device.device_id not in rep.sampled)
    up = uploads[0].msg
    forged = Message("update", other.device.device_id, 1, up.fleet, tensors=up.tensors, info=up.info)
    fleet.engine.gate.begin_round(1, final=False, sampled=rep.sampled)
    assert not fleet.engine.gate.admit(Inbound(forged.to_bytes()), lambda _: None)
    assert fleet.engine.gate.drain().by_device == {other.device.device_id: Counter({"unsampled": 1})}


def test_without_sampling_the_descriptor_has_no_sampled_field() -> None:
    """A device of a release before sampling builds RoundInfo from every key: an unsampled fleet sends none new."""
    from fedge.common.rounds import RoundInfo

    plain = RoundInfo(1, "train", "fedavg")
    assert "sampled" not in plain.to_dict() and RoundInfo.from_dict(plain.to_dict()) == plain
    some = RoundInfo(1, "train", "fedavg", sampled=["d1"])
    assert RoundInfo.from_dict(some.to_dict()) == some and not some.includes("d0") and some.includes("d1")
