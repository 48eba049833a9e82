"""The thermal guard over MQTT (issue 44): devices say how hot they are in their heartbeats (here through
``fedge edge run --health-override``'s file: fedge's real heartbeat over a real Mosquitto), the fleet monitor keeps
the last one of each, and ``selection = "oort"`` with ``thermal_guard = true`` holds a hot device out of selection —
named in the round report's ``hot`` and counted in ``/metrics`` — until it has cooled below its ``resume_c``; a
heartbeat older than the engine's bound leaves the heat unknown (not held, and the report says why); and
asynchronous mode's task assignment consults the same guard, over Mosquitto and in virtual time."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gate_helpers import FLEET, device
from scaleout_helpers import FAST, StatsDevice, start_devices, stop_devices

from fedge.cli import build_parser
from fedge.common.asyncmode import AsyncSettings
from fedge.common.heat import HeatLimits
from fedge.common.sampling import Sampling
from fedge.common.selection import UtilitySettings
from fedge.coordinator.config import DeviceSlotCheck, EngineConfig
from fedge.coordinator.engine import RoundEngine
from fedge.coordinator.fromfleet import engine_parts
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.report import RoundReport
from fedge.coordinator.strategies.fedproto import FedProtoStrategy
from fedge.edge.health import HealthOverride, HealthSampler, Heartbeat
from fedge.fleet.config import load_fleet
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.observe.metrics import FleetMetrics
from fedge.observe.monitor import FleetMonitor
from fedge.profiles import load_profile
from fedge.profiles.loader import dump_profile
from fedge.profiles.thermal import Thermal

N, ROUNDS = 4, 3
# d2's profile has a [thermal] table (limit 70 °C, resume 60 °C); the others keep the defaults (80 °C, 75 °C)
LIMITS = {"d2": HeatLimits(70.0, 60.0)}
# what each device's heartbeat says before each training round
HEAT: dict[int, dict[str, dict[str, Any]]] = {
    1: {"d0": {"cpu_temp_c": 50.0}, "d1": {"cpu_temp_c": 85.0, "throttled": "0x50006"}, "d2": {"cpu_temp_c": 72.0},
        "d3": {"cpu_temp_c": 50.0}},
    # between resume_c and limit_c: still hot, as they were
    2: {"d1": {"cpu_temp_c": 77.0, "throttled": "0x50000"}, "d2": {"cpu_temp_c": 65.0}},
    # cooled below resume_c; d0 and d3 got hot, so the two slots must go to d1 and d2
    3: {"d0": {"cpu_temp_c": 81.0}, "d1": {"cpu_temp_c": 70.0, "throttled": "0x50000"}, "d2": {"cpu_temp_c": 55.0},
        "d3": {"cpu_temp_c": 60.0, "throttled": "0x6"}},
}


def _heartbeat(dev: StatsDevice, override: Path) -> Heartbeat:
    """fedge's real heartbeat of ``dev`` every 0.1 s, its heat read from the ``--health-override`` file."""
    return Heartbeat(dev.info.device_id, FLEET, HealthSampler("tier-xs", override=HealthOverride(override)),
                     dev.transport.send_health, lambda: (0, 0, None), interval_s=0.1).start()


def test_a_hot_device_is_held_out_of_selection_until_it_has_cooled(mosquitto: MosquittoProcess,
                                                                   tmp_path: Path) -> None:
    ids = [f"d{i}" for i in range(N)]
    files = {d: tmp_path / f"{d}.json" for d in ids}
    temps: dict[str, float] = {}

    def heat(rnd: int) -> None:
        for d, fields in HEAT[rnd].items():
            files[d].write_text(json.dumps(fields))
            temps[d] = float(fields["cpu_temp_c"])

    heat(1)
    tr = MqttCoordinatorTransport(mosquitto.settings(), FLEET, FAST, client_id="coord").start()
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=N, quorum_timeout_s=60,
                       sampling=Sampling(2, "oort", fleet_size=N, seed=0,
                                         utility=UtilitySettings(explore=0.0, thermal_guard=True)),
                       slots={d: DeviceSlotCheck(device(i), heat=LIMITS.get(d)) for i, d in enumerate(ids)})
    engine = RoundEngine(FedProtoStrategy(num_classes=10, rounds=ROUNDS), tr, cfg)
    monitor = FleetMonitor(fleet=FLEET, method="fedproto", total_rounds=ROUNDS, transport=tr, poll_s=0.05,
                           fleet_devices={d: device(i) for i, d in enumerate(ids)}).start()
    metrics = FleetMetrics(monitor)
    engine.observers += [monitor, metrics.observer]
    engine.health = monitor.heartbeats
    devs = start_devices(lambda d: mosquitto.settings(), range(N))
    beats = [_heartbeat(d, files[d.info.device_id]) for d in devs]

    def heard(rnd: int) -> bool:
        recs = monitor.health_records()
        return all(d in recs and recs[d].cpu_temp_c == temps[d] for d in ids)

    def wait_heard(rnd: int) -> None:
        end = time.monotonic() + 30
        while not heard(rnd):
            assert time.monotonic() < end, f"round {rnd}: heartbeats not heard: {monitor.health_records()}"
            time.sleep(0.05)

    def next_heat(rep: RoundReport) -> None:  # on the engine's thread, before the next round is chosen
        if rep.round + 1 in HEAT:
            heat(rep.round + 1)
            wait_heard(rep.round + 1)

    wait_heard(1)
    try:
        reports = engine.run(on_round=next_heat)
    finally:
        for b in beats:
            b.stop(last_beat=False)
        stop_devices(devs)
        monitor.stop()
        tr.close()
    r1, r2, r3, final = reports
    assert (r1.hot, r1.sampled) == (["d1", "d2"], ["d0", "d3"])
    assert r1.selection["d1"] == ("hot: its firmware throttles (flags 0x50006) at 85.0 °C: not tasked until it "
                                  "cools")
    assert r1.selection["d2"] == "hot: 72.0 °C, at or above its limit of 70 °C: not tasked until it cools"
    assert (r2.hot, r2.sampled) == (["d1", "d2"], ["d0", "d3"])  # cooler, not yet below resume_c: still held
    assert r2.selection["d1"] == "hot: 77.0 °C, not yet cooled below 75 °C: not tasked until it cools"
    assert r2.selection["d2"] == "hot: 65.0 °C, not yet cooled below 60 °C: not tasked until it cools"
    assert (r3.hot, r3.sampled) == (["d0", "d3"], ["d1", "d2"])  # cooled: tasked again
    assert sorted(r3.accepted) == ["d1", "d2"]
    assert final.hot == [] and sorted(final.accepted) == ids
    assert monitor.thermal_held == 6
    text = metrics.render().decode()
    assert "fedge_thermal_held_total 6.0" in text, text


def test_a_heartbeat_too_old_makes_the_heat_unknown_and_the_device_is_no_longer_held(mosquitto: MosquittoProcess,
                                                                                     tmp_path: Path) -> None:
    """d1 says it is hot and is held in round 1; then its heartbeats stop (its agent still online). Once its last
    heartbeat is older than the engine's bound it says nothing of d1's heat now: round 2 does not hold it, and its
    reason in the report says why (fedge.common.heat.HEAT_MAX_AGE_S)."""
    ids = ["d0", "d1", "d2"]
    files = {d: tmp_path / f"{d}.json" for d in ids}
    for d in ids:
        files[d].write_text(json.dumps({"cpu_temp_c": 85.0 if d == "d1" else 50.0}))
    tr = MqttCoordinatorTransport(mosquitto.settings(), FLEET, FAST, client_id="coord").start()
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=3, quorum_timeout_s=60,
                       sampling=Sampling(2, "oort", fleet_size=3, seed=0,
                                         utility=UtilitySettings(explore=0.0, thermal_guard=True)),
                       slots={d: DeviceSlotCheck(device(i)) for i, d in enumerate(ids)})
    engine = RoundEngine(FedProtoStrategy(num_classes=10, rounds=2), tr, cfg)
    monitor = FleetMonitor(fleet=FLEET, method="fedproto", total_rounds=2, transport=tr, poll_s=0.05,
                           fleet_devices={d: device(i) for i, d in enumerate(ids)}).start()
    metrics = FleetMetrics(monitor)
    engine.observers += [monitor, metrics.observer]
    engine.health = monitor.heartbeats
    engine.heat_max_age_s = 1.0  # ten of these devices' 0.1 s heartbeats
    devs = start_devices(lambda d: mosquitto.settings(), range(3))
    beats = {d.info.device_id: _heartbeat(d, files[d.info.device_id]) for d in devs}
    end = time.monotonic() + 30
    while set(monitor.heartbeats()) != set(ids):
        assert time.monotonic() < end, f"heartbeats not heard: {monitor.heartbeats()}"
        time.sleep(0.05)

    def silence_d1(rep: RoundReport) -> None:  # on the engine's thread, before round 2 is chosen
        if rep.round == 1:
            beats["d1"].stop(last_beat=False)
            time.sleep(1.5)  # past the bound
            assert time.time() - monitor.heartbeats()["d1"][1] > 1.0

    try:
        reports = engine.run(on_round=silence_d1)
    finally:
        for b in beats.values():
            b.stop(last_beat=False)
        stop_devices(devs)
        monitor.stop()
        tr.close()
    r1, r2, _final = reports
    assert (r1.hot, r1.sampled) == (["d1"], ["d0", "d2"])
    assert r1.selection["d1"] == "hot: 85.0 °C, at or above its limit of 80 °C: not tasked until it cools"
    assert r2.hot == [] and "d1" not in engine.selector.guard.hot  # unknown: not held, and no longer remembered hot
    note = r2.selection["d1"]
    assert "heat unknown: its last heartbeat is " in note and "s old (more than 1 s), so the thermal guard does " \
        "not hold it" in note, note
    assert all("heat unknown" not in r2.selection[d] for d in ("d0", "d2"))  # theirs are fresh
    assert monitor.thermal_held == 1


class _Tasks(EngineObserver):
    """Who holds a task at each announcement of each version (asynchronous mode's ``RoundInfo.assigned``)."""

    def __init__(self) -> None:
        self.by_version: dict[int, set[str]] = {}

    def round_started(self, info: Any, expected: Any, pending: Any) -> None:
        if info.assigned is not None:
            self.by_version.setdefault(info.round, set()).update(info.assigned)


def test_async_mode_gives_a_hot_device_no_task_until_its_heartbeat_says_it_has_cooled(mosquitto: MosquittoProcess,
                                                                                      tmp_path: Path) -> None:
    """Asynchronous mode over Mosquitto with real heartbeats: d1 is hot, so version 1 hands its tasks to d0 and d2
    only (d1's unasked update is refused); its heartbeat then says 55 °C, below resume_c, and version 2 tasks it."""
    ids = ["d0", "d1", "d2"]
    files = {d: tmp_path / f"{d}.json" for d in ids}
    temps = {"d0": 50.0, "d1": 85.0, "d2": 50.0}
    for d in ids:
        files[d].write_text(json.dumps({"cpu_temp_c": temps[d]}))
    tr = MqttCoordinatorTransport(mosquitto.settings(), FLEET, FAST, client_id="coord").start()
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=3, quorum_timeout_s=60,
                       asynchronous=AsyncSettings(buffer_size=2, fleet_size=3, thermal_guard=True),
                       slots={d: DeviceSlotCheck(device(i)) for i, d in enumerate(ids)})
    engine = RoundEngine(FedProtoStrategy(num_classes=10, rounds=2), tr, cfg)
    monitor = FleetMonitor(fleet=FLEET, method="fedproto", total_rounds=2, transport=tr, poll_s=0.05, buffer_size=2,
                           fleet_devices={d: device(i) for i, d in enumerate(ids)}).start()
    metrics = FleetMetrics(monitor)
    tasks = _Tasks()
    engine.observers += [monitor, metrics.observer, tasks]
    engine.health = monitor.heartbeats
    devs = start_devices(lambda d: mosquitto.settings(), range(3))
    beats = [_heartbeat(d, files[d.info.device_id]) for d in devs]

    def wait_heard() -> None:
        end = time.monotonic() + 30
        while {d: r.cpu_temp_c for d, (r, _) in monitor.heartbeats().items()} != temps:
            assert time.monotonic() < end, f"heartbeats not heard: {monitor.heartbeats()}"
            time.sleep(0.05)

    def cool_d1(rep: RoundReport) -> None:
        if rep.round == 1:
            temps["d1"] = 55.0
            files["d1"].write_text(json.dumps({"cpu_temp_c": 55.0}))
            wait_heard()

    wait_heard()
    try:
        reports = engine.run(on_round=cool_d1)
    finally:
        for b in beats:
            b.stop(last_beat=False)
        stop_devices(devs)
        monitor.stop()
        tr.close()
    v1, v2, final = reports
    assert tasks.by_version[1] == {"d0", "d2"} and sorted(v1.accepted) == ["d0", "d2"]
    assert v1.hot == ["d1"]
    assert v1.selection["d1"] == "hot: 85.0 °C, at or above its limit of 80 °C: not tasked until it cools"
    assert "d1" in tasks.by_version[2] and v2.hot == []
    assert "d1" not in engine.selector.guard.hot and sorted(final.accepted) == ids
    assert monitor.thermal_held == 1
    assert "fedge_thermal_held_total 1.0" in metrics.render().decode()


def test_each_device_is_judged_by_its_profiles_limits(tmp_path: Path) -> None:
    """``fedge coordinator run``'s engine: with ``thermal_guard``, each slot carries its profile's ``[thermal]``
    limits (a profile without the table: the defaults); without the guard no profile is read for them."""
    box = Thermal(c_per_w=8.0, tau_s=60.0, limit_c=65.0, resume_c=58.0)
    (tmp_path / "hot-pi.toml").write_text(dump_profile(replace(load_profile("rpi4-4gb"), thermal=box)))
    fleet = """
[run]
method = "fedavg"
rounds = 2
dataset = "digits"

[coordinator]
sample = 2
selection = "oort"
thermal_guard = {guard}

[[devices]]
profile = "hot-pi.toml"
count = 2
arch = "tier-xs"

[[devices]]
profile = "x86-gateway"
count = 1
arch = "tier-xs"
"""
    args = build_parser().parse_args(["coordinator", "run", "--config", "f.toml", "--state-dir", "s"])
    for guard in ("true", "false"):
        path = tmp_path / f"{guard}.toml"
        path.write_text(fleet.format(guard=guard))
        engine_cfg, _ = engine_parts(args, load_fleet(path), any_device=False)
        assert engine_cfg.slots is not None
        heat = {d: c.heat for d, c in engine_cfg.slots.items()}
        assert heat == ({"hot-pi-1": HeatLimits(65.0, 58.0), "hot-pi-2": HeatLimits(65.0, 58.0), "x86-gateway-1": None}
                        if guard == "true" else dict.fromkeys(heat))


HOT_BOX = "c_per_w = 10.0\ntau_s = 0.2\nambient_c = 25.0\nlimit_c = 74.0\nresume_c = 62.0\nthrottle_share = 0.6\n"
"""A Pi 4 in a hot enclosure (benchmarks/thermal.py's): idle it settles at 52 °C, busy it would reach 89 °C."""


def _async_fleet(tmp_path: Path, guard: bool) -> Path:
    from fedge.profiles import builtin_dir

    pi4 = (builtin_dir() / "rpi4-4gb.toml").read_text().replace('name = "rpi4-4gb"', 'name = "rpi4-hot"')
    (tmp_path / "rpi4-hot.toml").write_text(pi4 + "\n[thermal]\n" + HOT_BOX)
    path = tmp_path / f"async-{guard}.toml"
    path.write_text(f"""
[run]
method = "fedavg"
rounds = 12
dataset = "digits"
seed = 0

[train]
local_epochs = 2
batch_size = 16
val_fraction = 0.0

[simulation]
threads = 1

[coordinator]
mode = "async"
buffer_size = 2
thermal_guard = {str(guard).lower()}

[[devices]]
profile = "rpi4-hot.toml"
count = 2
arch = "tier-xs"

[[devices]]
profile = "x86-gateway"
count = 2
arch = "tier-xs"
""")
    return path


@pytest.mark.slow  # three simulations: ~45 s on the shared machine
def test_async_task_assignment_gives_a_hot_device_no_task_until_it_has_cooled(tmp_path: Path) -> None:
    """Asynchronous mode in virtual time: with ``thermal_guard`` no Pi 4 starts a task while its (simulated) firmware
    throttles it; the versions that held one name it in ``hot`` with the guard's reason. Without the guard the same
    fleet starts tasks throttled."""
    from fedge.fleet.config import load_fleet
    from fedge.sim.simulate import simulate

    runs = {g: simulate(load_fleet(_async_fleet(tmp_path, g)), out_dir=None) for g in (False, True)}
    for g, res in runs.items():
        assert res.clock is not None
        pi4 = [w for d in res.clock.devices if d.startswith("rpi4-hot") for w, _ in res.clock.work(d)]
        throttled = sum(w.throttled for w in pi4)
        held = [(r.round, d, r.selection[d]) for r in res.reports for d in r.hot]
        if not g:
            assert throttled > 0 and held == [], (throttled, held)
            continue
        assert throttled == 0, [(w.start_s, w.temp_c) for w in pi4 if w.throttled]
        assert held and {d for _, d, _ in held} <= {"rpi4-hot-1", "rpi4-hot-2"}, held
        assert all(w.startswith("hot: ") and w.endswith(": not tasked until it cools") for _, _, w in held), held
        # a held device is tasked again once it has cooled: Pi 4 tasks start after the first hold
        first = min(r for r, _, _ in held)
        assert any(d.startswith("rpi4-hot") for r in res.reports if r.round > first for d in r.accepted)
    # the same run, again: deterministic in virtual time
    again = simulate(load_fleet(_async_fleet(tmp_path, True)), out_dir=None)
    assert [(r.accepted, r.hot, r.selection) for r in again.reports] == \
        [(r.accepted, r.hot, r.selection) for r in runs[True].reports]
