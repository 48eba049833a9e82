"""The thermal model and guard (issue 44): a profile's [thermal] table, heating and cooling on the virtual clock,
a throttled device computing slower, and ``thermal_guard`` skipping a hot device until it has cooled."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fedge.common.archs import tier_arch
from fedge.common.heat import HeatGuard, HeatLimits, HeatReading, hot_after
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
    probe = HeatGuard()
    while not probe.judge("hot", selection_facts(clock, rnd, {})["hot"].heat):  # back to back until it throttles
        clock.sync_round(rnd, {"hot": work})
        rnd += 1
        assert rnd < 20, "never got hot"
    facts = selection_facts(clock, rnd, {})
    assert facts["cool"].heat is None and facts["hot"].heat is not None
    reason = HeatGuard().judge("hot", facts["hot"].heat)
    temp = clock.devices["hot"].temperature(clock.now)
    assert temp is not None and temp >= 60.0  # at its limit: its (simulated) firmware throttles, and says so
    assert reason == f"hot: its firmware throttles (flags 0x6) at {temp:.1f} °C"
    devices = {d: DeviceInfo(d, "tier-m", "rpi4-4gb", "fp32", 200, 64) for d in clock.devices}
    guard = Sampling(3, "oort", fleet_size=3, seed=0, utility=UtilitySettings(explore=0.0, thermal_guard=True))
    sel = Selector()
    sel.trained = set(devices)  # every device trained before: no exploration

    def choose(sampling: Sampling, system: dict, selector: Selector = sel) -> list[str]:
        return selector.choose(sampling, rnd, devices, set(devices), [], system, lambda d: None)

    assert choose(guard, facts) == ["cool", "other"]  # every slot but its own
    assert sel.why["hot"] == reason + ": not tasked until it cools" and sel.held == ["hot"]
    # without the guard it is tasked, hot or not
    other = Selector()
    other.trained = set(devices)
    assert "hot" in choose(replace(guard, utility=UtilitySettings(explore=0.0)), facts, other) and other.held == []
    # a minute idle later it has cooled: tasked again
    clock.now += 60.0
    cooled = selection_facts(clock, rnd, {})
    assert choose(guard, cooled) == ["cool", "hot", "other"] and sel.held == []


def test_hot_until_cooled_below_resume() -> None:
    """One decision with hysteresis: hot at the limit or when the firmware throttles, cool again only below resume_c
    with the flags clear."""
    lim = HeatLimits(60.0)
    assert lim.resume == 55.0 and HeatLimits(60.0, 50.0).resume == 50.0
    assert not hot_after(False, 59.9, lim) and hot_after(False, 60.0, lim)
    assert hot_after(True, 57.0, lim) and not hot_after(False, 57.0, lim)  # between the two: as it was
    assert not hot_after(True, 54.9, lim)
    assert hot_after(False, 40.0, lim, flags=0x50006) and not hot_after(True, 40.0, lim, flags=0x50000)
    assert not hot_after(False, None, lim, flags=0x1)  # under-voltage alone is not heat
    assert hot_after(True, None, lim, flags=0x4) and not hot_after(True, None, lim, flags=0)
    g = HeatGuard()
    assert g.judge("d", HeatReading(61.0, lim)) == "hot: 61.0 °C, at or above its limit of 60 °C"
    assert g.judge("d", HeatReading(57.0, lim)) == "hot: 57.0 °C, not yet cooled below 55 °C"
    assert g.judge("d", HeatReading(54.0, lim)) == "" and g.judge("d", HeatReading(57.0, lim)) == ""
    assert g.judge("d", HeatReading(45.0, lim, flags=0x50006)) == ("hot: its firmware throttles (flags 0x50006) at "
                                                                   "45.0 °C")
    assert g.judge("d", None) == "" and "d" in g.hot  # no new reading: the memory stays


def test_the_firmware_throttles_until_the_device_has_cooled_below_resume() -> None:
    box = replace(BOX, resume_c=50.0)
    dev = pi4("hot", 0, thermal=box)
    dev.temp_c, dev.temp_at = 61.0, 0.0  # hot: idling from 61 °C toward 41.6 °C
    dev.hot = True
    cross = 2.0 * math.log((61.0 - 41.6) / (50.0 - 41.6))  # when it reaches 50 °C
    assert dev.throttled(cross - 0.01) and not dev.throttled(cross + 0.01)
    dev.hot = False  # the same temperatures without having reached the limit: never throttled
    assert not dev.throttled(cross - 0.01)


@pytest.mark.parametrize(("table", "message"), [
    ({"c_per_w": 8.0, "tau_s": 2.0, "limit_c": 60.0, "resume_c": 60.0}, "thermal.resume_c = 60: must be below limit_c"),
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


def test_the_guard_is_a_key_of_async_mode_and_needs_sample_in_sync_rounds() -> None:
    base = {"run": {"method": "fedavg", "rounds": 1, "dataset": "digits"},
            "devices": [{"profile": "rpi4-4gb", "count": 4, "arch": "tier-xs"}]}
    cfg = parse_fleet({**base, "coordinator": {"mode": "async", "buffer_size": 2, "thermal_guard": True}})
    assert cfg.asynchronous is not None and cfg.asynchronous.thermal_guard and cfg.sampling is None
    assert not parse_fleet({**base, "coordinator": {"mode": "async"}}).asynchronous.thermal_guard  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="thermal_guard without sample") as err:
        parse_fleet({**base, "coordinator": {"thermal_guard": True}}, source="fleet.toml")
    assert err.value.hint is not None and 'mode = "async"' in err.value.hint
    with pytest.raises(ConfigError, match="'thermal_guard' = 'yes' is not bool"):
        parse_fleet({**base, "coordinator": {"mode": "async", "thermal_guard": "yes"}})


def test_a_stale_reading_is_unknown_and_the_guard_forgets_it_was_hot() -> None:
    guard = HeatGuard()
    lim = HeatLimits(70.0, 60.0)
    assert guard.judge("d", HeatReading(75.0, lim)).startswith("hot: ")
    assert guard.judge("d", HeatReading(75.0, lim, stale="heat unknown: old")) == "" and "d" not in guard.hot
    assert guard.judge("d", HeatReading(65.0, lim)) == ""  # fresh again, between resume_c and limit_c: not hot
