"""The thermal model and guard (issue 44): a profile's [thermal] table, heating and cooling on the virtual clock,
a throttled device computing slower, and ``thermal_guard`` skipping a hot device until it has cooled."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fedge.common.archs import tier_arch
from fedge.common.rounds import DeviceInfo
from fedge.common.sampling import Sampling
from fedge.common.selection import UtilitySettings
from fedge.coordinator.selecting import Selector
from fedge.errors import ConfigError, ProfileError
from fedge.fleet.availability import Availability
from fedge.fleet.clock import DeviceClock, FleetClock, Participation, TrainWork
from fedge.fleet.config import parse_fleet
from fedge.fleet.energy import selection_facts
from fedge.profiles import load_profile, parse_profile
from fedge.profiles.speed import speed_model
from fedge.profiles.thermal import Thermal

# a Pi 4 in a closed box: 8 °C per W, 2 s time constant, throttling at 60 °C to 60 % of its speed; idle (2.7 W) it
# settles at 41.6 °C, busy (6.4 W) it would reach 71.2 °C
BOX = Thermal(c_per_w=8.0, tau_s=2.0, limit_c=60.0, throttle_share=0.6, ambient_c=20.0)


def pi4(name: str, index: int, thermal: Thermal | None = BOX) -> DeviceClock:
    p = load_profile("rpi4-4gb")
    return DeviceClock(name, index, speed_model(p), p.network, Availability(), TrainWork(tier_arch("m"), 64, 200, 1),
                       power=p.power, thermal=thermal)


def test_the_model_heats_toward_its_steady_state_and_cools_back() -> None:
    assert BOX.after(20.0, 6.4, 0.0) == 20.0
    assert BOX.after(20.0, 6.4, 2.0) == pytest.approx(71.2 + (20 - 71.2) * math.exp(-1))
    assert BOX.after(70.0, 2.7, 1e9) == pytest.approx(41.6)  # idle for ever: the idle steady state


def test_a_device_heats_with_its_work_and_computes_slower_when_throttled() -> None:
    hot, cool = pi4("hot", 0), pi4("cool", 1, thermal=None)
    clock = FleetClock([hot, cool])
    work = Participation(1000, 1000, trained=True)
    t0 = hot.timing(1, bytes_down=1000, bytes_up=1000, work=hot.work)
    r1 = clock.sync_round(1, {"hot": work, "cool": work})
    rec = r1.devices["hot"]
    assert rec.temp_c == pytest.approx(20.0) and r1.devices["cool"].temp_c is None  # the air's, at the start
    # by hand: idle while it downloads, busy while it computes, idle while it uploads
    temp = BOX.after(BOX.after(BOX.after(20.0, 2.7, t0.download_s), 6.4, t0.compute_s), 2.7, t0.upload_s)
    assert hot.temperature(rec.finish_s) == pytest.approx(temp)
    for rnd in range(2, 20):  # back to back until it throttles
        r = clock.sync_round(rnd, {"hot": work})
        if (r.devices["hot"].temp_c or 0.0) >= 60.0:  # at or past its limit when this task started
            break
    else:
        pytest.fail("never reached its limit")
    assert r.devices["hot"].compute_s == pytest.approx(t0.compute_s / 0.6)  # at 60 % of its speed
    # idle for a while, it cools below its limit and computes at full speed again
    clock.now += 30.0
    assert not hot.throttled(clock.now) and hot.temperature(clock.now) == pytest.approx(41.6, abs=0.1)
    again = clock.sync_round(99, {"hot": work})
    assert again.devices["hot"].compute_s == pytest.approx(t0.compute_s)


def test_the_guard_skips_a_hot_device_and_tasks_it_again_once_it_has_cooled() -> None:
    clock = FleetClock([pi4("hot", 0), pi4("cool", 1, thermal=None), pi4("other", 2, thermal=None)])
    work = Participation(1000, 1000, trained=True)
    rnd = 1
    while not selection_facts(clock, rnd, {})["hot"].hot:  # back to back until its next task would be too hot
        clock.sync_round(rnd, {"hot": work})
        rnd += 1
        assert rnd < 20, "never got hot"
    facts = selection_facts(clock, rnd, {})
    assert facts["hot"].hot.startswith("hot: ") and "60 °C" in facts["hot"].hot and facts["cool"].hot == ""
    devices = {d: DeviceInfo(d, "tier-m", "rpi4-4gb", "fp32", 200, 64) for d in clock.devices}
    guard = Sampling(3, "oort", fleet_size=3, seed=0, utility=UtilitySettings(explore=0.0, thermal_guard=True))

    def choose(sampling: Sampling, system: dict) -> tuple[list[str], dict[str, str]]:
        sel = Selector()
        sel.trained = set(devices)  # every device trained before: no exploration
        return sel.choose(sampling, rnd, devices, set(devices), [], system, lambda d: None), sel.why

    chosen, why = choose(guard, facts)
    assert chosen == ["cool", "other"]  # every slot but its own
    assert why["hot"] == facts["hot"].hot + ": not tasked until it cools"
    # without the guard it is tasked, hot or not
    assert "hot" in choose(replace(guard, utility=UtilitySettings(explore=0.0)), facts)[0]
    # a minute idle later it has cooled: tasked again
    clock.now += 60.0
    cooled = selection_facts(clock, rnd, {})
    assert cooled["hot"].hot == "" and choose(guard, cooled)[0] == ["cool", "hot", "other"]


@pytest.mark.parametrize(("table", "message"), [
    ({"c_per_w": 0.0, "tau_s": 2.0, "limit_c": 60.0}, "thermal.c_per_w = 0: must be > 0"),
    ({"c_per_w": 8.0, "tau_s": -1.0, "limit_c": 60.0}, "thermal.tau_s = -1: must be > 0 seconds"),
    ({"c_per_w": 8.0, "tau_s": 2.0, "limit_c": 20.0}, "thermal.limit_c = 20: must be above ambient_c = 25"),
    ({"c_per_w": 8.0, "tau_s": 2.0, "limit_c": 60.0, "throttle_share": 0.0}, "thermal.throttle_share = 0"),
])
def test_bad_thermal_tables_are_refused_naming_the_key(table: dict, message: str) -> None:
    d = load_profile("rpi4-4gb").to_dict() | {"thermal": table}
    with pytest.raises(ProfileError) as err:
        parse_profile(d, source="box.toml")
    assert message in err.value.message


def test_a_thermal_model_needs_a_power_model() -> None:
    d = load_profile("rpi4-4gb").to_dict() | {"thermal": BOX.to_dict()}
    d.pop("power")
    with pytest.raises(ProfileError) as err:
        parse_profile(d, source="box.toml")
    assert err.value.message.startswith("box.toml: ") and "no [power] table" in err.value.message


def test_the_guard_is_a_key_of_the_utility_selections() -> None:
    base = {"run": {"method": "fedavg", "rounds": 1, "dataset": "digits"},
            "devices": [{"profile": "rpi4-4gb", "count": 4, "arch": "tier-xs"}]}
    cfg = parse_fleet({**base, "coordinator": {"sample": 2, "selection": "energy", "thermal_guard": True}})
    assert cfg.sampling is not None and cfg.sampling.utility.thermal_guard
    with pytest.raises(ConfigError, match='thermal_guard = True applies to selection = "oort" or "energy"'):
        parse_fleet({**base, "coordinator": {"sample": 2, "selection": "balanced", "thermal_guard": True}},
                    source="fleet.toml")
