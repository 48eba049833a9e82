"""The energy model (issue 44): ``[power]`` in a profile, joules per task and per round on the virtual clock, the
refusals at load, and results.json's energy."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_clock import TWO as TWO_FLEET

from fedge.errors import ProfileError
from fedge.fleet.config import load_fleet
from fedge.fleet.energy import EnergyLedger
from fedge.profiles import builtin_dir, list_profiles, load_profile
from fedge.profiles.power import LINKS
from fedge.sim.report import build_results, format_table
from fedge.sim.simulate import simulate

TWO = TWO_FLEET.format(method="fedavg", clock="")  # a Pi Zero 2 W and a Pi 4 on tier-xs, 2 rounds of digits

BASE = (builtin_dir() / "rpi4-4gb.toml").read_text()
POWER = '[power]\nidle_w = 2.7\nbusy_w = 6.4\nlink = "ethernet"\n'


def test_every_builtin_has_a_cited_power_model() -> None:
    for name in list_profiles():
        p = load_profile(name)
        assert p.power is not None and 0 < p.power.idle_w < p.power.busy_w, name
        text = (builtin_dir() / f"{name}.toml").read_text()
        assert "# Power:" in text, f"{name} does not say where its power figures come from"
    zero = load_profile("rpi-zero-2w").power
    assert zero is not None and zero.battery_j == pytest.approx(37 * 3600) and zero.floor_j == pytest.approx(3.7 * 3600)


def test_joules_per_task_are_the_profiles_power_times_the_clocks_times(tmp_path: Path) -> None:
    path = tmp_path / "two.toml"
    path.write_text(TWO)
    res = simulate(load_fleet(path), out_dir=None)
    doc = build_results(res)
    zero, pi4 = doc["devices"]
    # by hand, from the clock's own times and bytes: the Zero (0.6 W idle, 3.0 W busy, LTE-M: 15.4 µJ per byte up,
    # 3.0 down) computes at busy power and moves bytes at idle power plus its radio's energy per byte
    per_round = []
    for i in (0, 1):
        v = zero["virtual"][i]
        task = (3.0 * v["compute_s"] + 0.6 * (v["download_s"] + v["upload_s"])
                + 15.4e-6 * zero["bytes_up"][i] + 3.0e-6 * zero["bytes_down"][i])
        assert v["joules"] == pytest.approx(task, rel=1e-12)
        # the Zero is the slowest: busy the whole round, no idling
        span = doc["rounds_log"][i]["virtual_end_s"] - doc["rounds_log"][i]["virtual_start_s"]
        assert v["finish_s"] - v["start_s"] == pytest.approx(span)
        assert zero["joules_per_round"][i] == pytest.approx(task, rel=1e-9)
        # the Pi 4 (2.7 / 6.4 W, Ethernet: 0.03 µJ per byte each way) idles for the rest of the round
        w = pi4["virtual"][i]
        p4 = (6.4 * w["compute_s"] + 2.7 * (w["download_s"] + w["upload_s"])
              + 0.03e-6 * (pi4["bytes_up"][i] + pi4["bytes_down"][i]))
        assert w["joules"] == pytest.approx(p4, rel=1e-12)
        idle = 2.7 * (span - (w["finish_s"] - w["start_s"]))
        assert pi4["joules_per_round"][i] == pytest.approx(p4 + idle, rel=1e-9)
        assert doc["rounds_log"][i]["joules"] == pytest.approx(task + p4 + idle, rel=1e-9)
        per_round.append(task + p4 + idle)
    assert zero["joules_per_round"][2] is None  # the final evaluation takes no virtual time
    e = doc["clock"]["energy"]
    assert e["fleet_j"] == pytest.approx(sum(per_round), rel=1e-9)
    assert e["task_j"] == pytest.approx(sum(zero["virtual"][i]["joules"] + pi4["virtual"][i]["joules"] for i in (0, 1)))
    assert zero["joules"] + pi4["joules"] == pytest.approx(e["fleet_j"])
    # the battery: 37 Wh less what the Zero spent
    assert zero["battery_left_j"] == pytest.approx(37 * 3600 - zero["joules"])
    assert "battery_left_j" not in pi4
    # time to accuracy carries the fleet's joules by each point (0 at the start, everything at the end)
    tta = doc["time_to_accuracy"]
    assert tta[0]["fleet_j"] == 0 and tta[-1]["fleet_j"] == pytest.approx(e["fleet_j"])
    assert "energy:" in format_table(doc)


def test_a_task_cut_short_costs_only_what_was_done() -> None:
    from fedge.common.archs import tier_arch
    from fedge.fleet.availability import Availability
    from fedge.fleet.clock import DeviceClock, Timing, TrainWork
    from fedge.profiles.speed import speed_model

    p = load_profile("rpi4-2gb")  # LTE: 3.51 µJ per byte up, 0.42 down
    c = DeviceClock("d", 0, speed_model(p), p.network, Availability(), TrainWork(tier_arch("m"), 64, 500, 1),
                    power=p.power)
    t = Timing(1.0, 10.0, 2.0)
    full = c.task_j(t, bytes_down=1000, bytes_up=2000)
    assert full == pytest.approx(6.4 * 10 + 2.7 * 3 + 3.51e-6 * 2000 + 0.42e-6 * 1000)
    # offline 6 s in: the download and 5 s of compute, no upload
    assert c.task_j(t, bytes_down=1000, bytes_up=2000, worked_s=6.0) == pytest.approx(6.4 * 5 + 2.7 + 0.42e-6 * 1000)
    # half the upload: half its seconds and half its bytes
    assert c.task_j(t, bytes_down=1000, bytes_up=2000, worked_s=12.0) == pytest.approx(
        6.4 * 10 + 2.7 * 2 + 3.51e-6 * 1000 + 0.42e-6 * 1000)


@pytest.mark.parametrize(
    ("table", "key", "fix"),
    [
        ('idle_w = -1.0\nbusy_w = 6.4\nlink = "ethernet"', "power.idle_w = -1: must be a finite number >= 0", "idle"),
        ('idle_w = 2.7\nbusy_w = 1.0\nlink = "ethernet"', "power.busy_w = 1: is below idle_w = 2.7", "at least"),
        ('idle_w = 2.7\nbusy_w = 6.4\nlink = "wlan"', "power.link = 'wlan': unknown link kind", "wifi"),
        ('idle_w = 2.7\nbusy_w = 6.4\nlink = "lte"\nbattery_wh = 10.0\nfloor_wh = 12.0',
         "power.floor_wh = 12: is not below the battery's capacity (battery_wh = 10)", "lower it"),
        ('idle_w = 2.7\nbusy_w = 6.4\nlink = "lte"\nfloor_wh = 1.0', "power.floor_wh = 1: is set but the device has "
         "no battery", "battery_wh"),
        ('idle_w = 2.7\nbusy_w = 6.4\nlink = "lte"\nup_uj_per_byte = -3.0', "power.up_uj_per_byte = -3", "µJ"),
        ('idle_w = 2.7\nbusy_w = 6.4\nlink = "lte"\nbatery_wh = 3.0', "unknown key 'batery_wh'", "battery_wh"),
    ],
)
def test_bad_power_tables_are_refused_naming_the_key(tmp_path: Path, table: str, key: str, fix: str) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(BASE.replace(POWER, "") + "\n[power]\n" + table + "\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in info.value.message and key in info.value.message
    assert info.value.hint is not None and fix in info.value.hint


def test_a_users_profile_overrides_the_figures(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(BASE.replace(POWER, "") + '\n[power]\nidle_w = 1.0\nbusy_w = 2.0\nlink = "wifi"\n'
                    'up_uj_per_byte = 1.0\nbattery_wh = 2.0\nfloor_wh = 0.5\n')
    p = load_profile(path).power
    assert p is not None and p.up_j_per_byte == pytest.approx(1e-6)
    assert p.down_j_per_byte == pytest.approx(LINKS["wifi"][1] * 1e-6)  # not overridden: the link's
    assert (p.battery_j, p.floor_j) == (pytest.approx(7200), pytest.approx(1800))


def test_a_profile_without_power_has_no_joules(tmp_path: Path) -> None:
    prof = tmp_path / "nopower.toml"
    prof.write_text(BASE.replace(POWER, "").replace('name = "rpi4-4gb"', 'name = "nopower"'))
    path = tmp_path / "two.toml"
    path.write_text(TWO.replace('profile = "rpi4-4gb"', 'profile = "nopower.toml"'))
    res = simulate(load_fleet(path), out_dir=None)
    assert res.clock is not None
    ledger = EnergyLedger(res.clock)
    assert ledger.device_j("nopower-1") is None and ledger.without_power() == 1
    doc = build_results(res)
    assert doc["clock"]["energy"]["devices_without_power"] == 1
    assert doc["clock"]["energy"]["fleet_j"] == pytest.approx(doc["devices"][0]["joules"])


def test_metrics_estimate_a_live_devices_power_from_its_heartbeat() -> None:
    from fedge.common.messages import Message
    from fedge.common.rounds import DeviceInfo
    from fedge.common.transport import Inbound
    from fedge.observe.metrics import device_gauges
    from fedge.observe.monitor import FleetMonitor

    devices = {"pi4": DeviceInfo("pi4", "tier-m", "rpi4-4gb", "fp32", 100, 64),
               "mine": DeviceInfo("mine", "tier-m", "my-board.toml", "fp32", 100, 64)}
    mon = FleetMonitor(fleet="f", method="fedavg", total_rounds=1, fleet_devices=devices, live=False)
    for dev in devices:
        # the agent used 1.5 of the board's 4 cores since its previous heartbeat
        health = {"seq": 1, "sent": 1e9, "agent_uptime_s": 10.0, "fedge_version": "x", "model": "tier-m",
                  "model_round": 0, "last_round": 0, "cpu_percent": 150.0, "cpu_count": 4}
        assert mon.add_health(Inbound(Message("health", dev, 0, "f", info={"health": health}).to_bytes()))
    text = device_gauges(mon)
    # 2.7 W idle + (6.4 - 2.7) W x 1.5 / 4 = 4.0875 W; a profile the coordinator does not know has no estimate
    assert 'fedge_device_power_watts_estimate{device="pi4",profile="rpi4-4gb"} 4.0875\n' in text
    assert 'power_watts_estimate{device="mine"' not in text
