"""Whole fleets over a real Mosquitto: the same aggregates as in-process, a device dying mid-round, a hung
device and its late update, the coordinator killed and resumed, and hostile payloads from a raw client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
import pytest

from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo
from fedge.common.tensorcodec import decode
from fedge.coordinator.engine import EngineConfig, RoundEngine, RoundReport
from fedge.edge.agent import DeviceAgent
from fedge.errors import PayloadError
from fedge.fleet.config import FleetConfig, load_fleet
from fedge.fleet.devices import SimDevice
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.chunking import split
from fedge.mqtt.client import new_paho_client
from fedge.mqtt.settings import TransportSettings
from fedge.mqtt.topics import FleetTopics
from fedge.sim.inprocess import run_inprocess
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet, simulate

FLEET_TOML = """
[run]
method = "{method}"
rounds = 2
dataset = "digits"
fleet = "{fleet}"
seed = 3

[partition]
kind = "dirichlet"
alpha = 0.5
fraction = 0.25

[train]
lr = 0.05
local_epochs = 1

{method_table}
[[devices]]
profile = "rpi4-2gb"
count = 2
arch = "tier-xs"

[[devices]]
profile = "x86-gateway"
count = 2
arch = "tier-xs"
"""


# A generator method in two rounds: one generator round, one target round (tiny CVAE, one epoch).
METHOD_TABLES = {"gefl": '[method]\ngenerator = "cvae"\ngenerator_tier = "tiny"\ngen_rounds = 1\ngen_epochs = 1\n'}


def fleet_config(tmp: Path, method: str, fleet: str) -> FleetConfig:
    path = tmp / f"{fleet}.toml"
    path.write_text(FLEET_TOML.format(method=method, fleet=fleet, method_table=METHOD_TABLES.get(method, "")))
    return load_fleet(path)




@dataclass
class Run:
    engine: RoundEngine
    reports: list[RoundReport]
    devices: list[SimDevice]


_REFERENCE: dict[str, Run] = {}


def reference(tmp: Path, method: str) -> Run:
    """The in-process run of the fleet (cached per method)."""
    if method not in _REFERENCE:
        cfg = fleet_config(tmp, method, f"ref-{method}")
        devices, strat = build_fleet(cfg)
        coord, _, _ = run_inprocess(cfg, devices)  # the simulator's own in-process wiring
        engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=method))
        _REFERENCE[method] = Run(engine, engine.run(), devices)
    return _REFERENCE[method]


def assert_same_globals(a: dict[str, dict[str, np.ndarray]], b: dict[str, dict[str, np.ndarray]]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), name
        for k in a[name]:
            np.testing.assert_allclose(a[name][k], b[name][k], rtol=1e-5, atol=1e-6, err_msg=f"{name}/{k}")


def run_over_mqtt(cfg: FleetConfig, broker: MosquittoProcess, engine_cfg: EngineConfig | None = None,
                  wire: TransportSettings | None = None, patch: Any = None) -> Run:
    devices, strat = build_fleet(cfg)
    coord, agents, stop = start_fleet(cfg, devices, broker.settings(), wire)
    assert coord is not None
    try:
        if patch is not None:
            patch(agents)
        engine = RoundEngine(strat, coord, engine_cfg or EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method))
        return Run(engine, engine.run(), devices)
    finally:
        stop()


@pytest.mark.parametrize("method", ["fedproto", "fedavg",
                                    pytest.param("gefl", marks=pytest.mark.slow)])  # ~1 min on 2 cores
def test_mqtt_fleet_equals_in_process(tmp_path: Path, mosquitto: MosquittoProcess, method: str) -> None:
    ref = reference(tmp_path, method)
    run = run_over_mqtt(fleet_config(tmp_path, method, f"eq-{method}"), mosquitto)
    assert_same_globals(ref.engine.globals, run.engine.globals)
    assert [sorted(r.accepted) for r in run.reports] == [sorted(r.accepted) for r in ref.reports]
    assert all(not r.rejected for r in run.reports)
    for r_ref, r_mqtt in zip(ref.reports, run.reports, strict=True):
        for dev, m in r_ref.metrics.items():
            assert r_mqtt.metrics[dev] == pytest.approx(m, abs=1e-6)


def test_simulate_transport_mqtt_embedded_broker(tmp_path: Path, embedded_broker: None) -> None:
    """``fedge simulate --transport mqtt``: an in-process amqtt broker, devices in threads, same result."""
    ref = reference(tmp_path, "fedproto")
    res = simulate(fleet_config(tmp_path, "fedproto", "sim-embedded"), transport="mqtt")
    assert [sorted(r.accepted) for r in res.reports] == [sorted(r.accepted) for r in ref.reports]
    for a, b in zip(ref.devices, res.devices, strict=True):
        pa, pb = a.method.global_protos, b.method.global_protos  # type: ignore[attr-defined]
        np.testing.assert_allclose(pa.numpy(), pb.numpy(), rtol=1e-5, atol=1e-6)
    assert res.agents[0].traffic[-1].bytes_up > 0
    # on the real clock the rounds are timed afterwards from the reports: both training rounds, every device
    assert res.clock is not None and [r.round for r in res.clock.rounds] == [1, 2]
    assert all(set(r.devices) == set(rep.accepted) for r, rep in zip(res.clock.rounds, res.reports, strict=False))


def test_sampling_over_mqtt_asks_the_same_devices_as_in_process(tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    """[coordinator] sample over a real broker: the descriptor's round.sampled reaches every device, only the
    sampled ones train and upload, nobody is missing or refused, and the rounds sample what in-process does."""
    from fedge.common.sampling import Sampling

    cfg = fleet_config(tmp_path, "fedavg", "sampled")
    sampling = Sampling(2, "balanced", fleet_size=4, seed=3)
    engine_cfg = EngineConfig(fleet=cfg.run.fleet, method="fedavg", sampling=sampling)
    run = run_over_mqtt(cfg, mosquitto, engine_cfg)
    devices, strat = build_fleet(fleet_config(tmp_path, "fedavg", "sampled-ref"))
    coord, _, _ = run_inprocess(cfg, devices)
    ref_engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method="fedavg", sampling=sampling))
    ref = ref_engine.run()
    assert [r.sampled for r in run.reports] == [r.sampled for r in ref]
    for rep in run.reports[:-1]:
        assert len(rep.sampled) == 2 and sorted(rep.accepted) == rep.sampled
        assert not rep.missing and not rep.rejected
    assert len(run.reports[-1].accepted) == 4
    assert_same_globals(ref_engine.globals, run.engine.globals)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit below
def test_device_killed_mid_round_the_round_completes_with_the_others(tmp_path: Path,
                                                                   mosquitto: MosquittoProcess) -> None:
    cfg = fleet_config(tmp_path, "fedproto", "kill-dev")
    victim = "x86-gateway-2"

    def patch(agents: list[DeviceAgent]) -> None:
        agent = next(a for a in agents if a.device.device_id == victim)
        train = agent.method.train_round

        def crash(info: Any) -> Any:
            if info.round == 2:
                agent.transport.abort()  # type: ignore[attr-defined]  # power cut: TCP drops, no DISCONNECT
                raise SystemExit  # the device's thread dies mid-training
            return train(info)

        agent.method.train_round = crash  # type: ignore[method-assign]

    t0 = time.time()
    run = run_over_mqtt(cfg, mosquitto, patch=patch)
    assert time.time() - t0 < 60  # no waiting for a deadline: the last-will said it is gone
    r1, r2, final = run.reports
    assert len(r1.accepted) == 4 and r2.missing == [victim] and sorted(r2.accepted) == sorted(
        d.info.device_id for d in run.devices if d.info.device_id != victim)
    assert final.phase == "final" and victim not in final.accepted and len(final.accepted) == 3
    survivors = [d.info.num_samples for d in run.devices if d.info.device_id != victim]
    assert int(run.engine.globals[PROTOTYPES_ARTIFACT]["counts"].sum()) == sum(survivors)


def test_hung_device_misses_the_deadline_and_its_late_update_is_dropped(tmp_path: Path,
                                                                        mosquitto: MosquittoProcess) -> None:
    cfg = fleet_config(tmp_path, "fedproto", "hung-dev")
    slow = "rpi4-2gb-1"
    release = threading.Event()

    def patch(agents: list[DeviceAgent]) -> None:
        agent = next(a for a in agents if a.device.device_id == slow)
        train = agent.method.train_round

        def hang(info: Any) -> Any:
            if info.round == 2:
                release.wait(300)  # still connected, and answering only once round 2 is over, however long it took
            return train(info)

        agent.method.train_round = hang  # type: ignore[method-assign]

    # Deadline = 5 x the slowest device's round-1 latency, at least 5 s: a healthy device misses it only if
    # its round 2 takes five times its round 1, whatever this machine's speed; the hung one answers only
    # after round 2 has ended, so it misses any deadline.
    engine_cfg = EngineConfig(fleet=cfg.run.fleet, method="fedproto", deadline_slack=5.0, min_round_s=5.0,
                              round_timeout_s=60.0)

    def on_round(rep: RoundReport) -> None:
        if rep.round == 2:
            release.set()

    devices, strat = build_fleet(cfg)
    coord, agents, stop = start_fleet(cfg, devices, mosquitto.settings())
    assert coord is not None
    try:
        patch(agents)
        engine = RoundEngine(strat, coord, engine_cfg)
        reports = engine.run(on_round=on_round)
    finally:
        release.set()
        stop()
    r1, r2, final = reports
    assert r1.deadline_s == pytest.approx(60.0, abs=1.0)  # nothing known yet about any device
    assert r2.deadline_s >= 4.5 and r2.missing == [slow] and len(r2.accepted) == 3
    assert final.rejected == {"late": 1} and len(final.accepted) == 4


def test_coordinator_killed_and_restarted_resumes_to_the_same_state(tmp_path: Path,
                                                                     mosquitto: MosquittoProcess) -> None:
    ref = reference(tmp_path, "fedproto")
    fleet = "restart"
    cfg = fleet_config(tmp_path, "fedproto", fleet)
    state = tmp_path / "state"
    devices, _ = build_fleet(cfg)

    def slow_round_2(agents: list[DeviceAgent]) -> None:
        for agent in agents:
            train = agent.method.train_round

            def slow(info: Any, train: Any = train) -> Any:
                if info.round == 2:
                    time.sleep(1.5)  # keeps round 2 open long enough to kill the coordinator inside it
                return train(info)

            agent.method.train_round = slow  # type: ignore[method-assign]

    _, agents, stop = start_fleet(cfg, devices, mosquitto.settings(), coordinator=False)
    slow_round_2(agents)
    cmd = [sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(cfg.source),
           "--broker", mosquitto.url, "--state-dir", str(state), "--quorum", "1", "--round-timeout", "0",
           "--deadline-slack", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        end = time.time() + 90
        while time.time() < end and first.poll() is None:
            if (state / "state.json").is_file() and json.loads((state / "state.json").read_text())["completed"] >= 1:
                break
            time.sleep(0.02)
        assert first.poll() is None, first.communicate()[0].decode()
        first.send_signal(signal.SIGKILL)  # mid-round 2: its updates are in flight or queued at the broker
        first.wait(10)
        assert json.loads((state / "state.json").read_text())["completed"] == 1
        second = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=120)
        out = second.stdout.decode()
        assert second.returncode == 0, out
        assert "resuming fedproto on fleet restart after round 1" in out
    finally:
        stop()
    saved = json.loads((state / "state.json").read_text())
    reports = [json.loads(line) for line in (state / "reports.jsonl").read_text().splitlines()]
    assert saved["completed"] == 3 and [r["round"] for r in reports] == [1, 2, 3]  # round 2 counted once
    assert all(len(r["accepted"]) == 4 for r in reports)
    flat = decode((state / "globals.safetensors").read_bytes()).tensors
    resumed = {PROTOTYPES_ARTIFACT: {k.split("/", 1)[1]: v for k, v in flat.items()}}
    assert_same_globals(ref.engine.globals, resumed)


def test_hostile_payloads_are_rejected_and_counted_and_the_run_is_unharmed(tmp_path: Path,
                                                                            mosquitto: MosquittoProcess) -> None:
    ref = reference(tmp_path, "fedproto")
    fleet = "hostile"
    cfg = fleet_config(tmp_path, "fedproto", fleet)
    t = FleetTopics(fleet)
    limit = 50_000
    victim, other = "rpi4-2gb-1", "rpi4-2gb-2"
    captured: dict[int, bytes] = {}
    attacked = threading.Event()
    rogue = new_paho_client("rogue", clean_session=True)  # a raw paho client (1.6 or 2.x)

    def rogue_update(rnd: int, **tensors: np.ndarray) -> bytes:
        return Message("update", "rogue", rnd, fleet, tensors=tensors).to_bytes()

    def attack(rnd: int) -> None:
        up = t.update
        good = Message.from_bytes(captured[1])
        p = rogue.publish
        # The rogue joins and sends its NaN and wrong-shape updates first: the round closes as soon as
        # the genuine devices have answered, and an update after that counts as "late", not "shape".
        dim = good.tensors["protos"].shape[1]
        # as many samples as the copied counts claim: the NaN update must be refused for its NaN, not its counts
        n = int(good.tensors["counts"].sum())
        as_victim = DeviceInfo(victim, "tier-xs", "x", num_samples=n, feature_dim=dim).to_dict()
        p(t.hello("rogue"), Message("hello", victim, 0, fleet, info={"device": as_victim}).to_bytes())  # spoofed
        hello = Message("hello", "rogue", 0, fleet, info={"device": DeviceInfo(
            "rogue", "tier-xs", "x", num_samples=n, feature_dim=dim).to_dict()})
        p(t.hello("rogue"), hello.to_bytes(), qos=1).wait_for_publish(5)
        nan = good.tensors["protos"].copy()
        nan[0, 0] = np.nan
        p(up("rogue"), rogue_update(rnd, protos=nan, counts=good.tensors["counts"]))          # NaN
        p(up("rogue"), rogue_update(rnd, protos=nan[:, :3], counts=good.tensors["counts"]))   # wrong shape
        p(up(victim), b"\x00\x01 not a message at all")                                     # malformed
        p(up(victim), b"\x10" * (limit + 10_000))                                            # oversize
        for frame in split(rogue_update(rnd, w=np.zeros(100_000, np.float32)), 16 * 1024)[:2]:
            p(up(victim), frame)                                                              # oversize, chunked
        bad = bytearray(split(captured[1] + b"\0" * 40_000, 16 * 1024)[0])
        bad[-1] ^= 1
        p(up(victim), bytes(bad))                                                             # checksum
        p(up(victim), Message("update", other, rnd, fleet, tensors=good.tensors).to_bytes())  # spoofed sender
        p(up(victim), captured[1])                                                            # replay of round 1
        # gone again before the final round, so the coordinator does not wait for it
        p(t.status("rogue"), b"offline", qos=1, retain=True).wait_for_publish(5)
        attacked.set()

    def on_message(client: Any, userdata: Any, msg: paho.MQTTMessage) -> None:
        if msg.topic == t.update(victim):
            try:  # the victim's genuine updates (small: never chunked); our own junk echoes back too
                m = Message.from_bytes(bytes(msg.payload))
            except PayloadError:
                return
            if m.sender == victim:
                captured.setdefault(m.round, bytes(msg.payload))
        elif msg.topic == t.round and msg.payload:  # empty: the run is over (the descriptor is cleared)
            rnd = Message.from_bytes(bytes(msg.payload)).round
            if rnd == 2 and not attacked.is_set():
                # not inside paho's callback: a paho callback must never block
                threading.Thread(target=attack, args=(rnd,), daemon=True).start()

    rogue.on_message = on_message
    rogue.connect("127.0.0.1", mosquitto.port)
    rogue.subscribe([(t.update(victim), 1), (t.round, 1)])
    rogue.loop_start()
    try:
        engine_cfg = EngineConfig(fleet=fleet, method="fedproto", max_update_bytes=limit, round_timeout_s=60)
        run = run_over_mqtt(cfg, mosquitto, engine_cfg, TransportSettings(max_message_bytes=limit))
    finally:
        rogue.loop_stop()
        rogue.disconnect()
    assert attacked.is_set()
    rejected: Counter[str] = Counter()
    for r in run.reports:
        rejected.update(r.rejected)
        assert sorted(a for a in r.accepted if a != "rogue") == sorted(d.info.device_id for d in run.devices)
        assert "rogue" not in r.accepted
    for reason in ("malformed", "oversize", "checksum", "spoofed", "stale", "nonfinite", "shape", "hello-spoofed"):
        assert rejected[reason] >= 1, (reason, rejected)
    assert rejected["oversize"] >= 2
    assert_same_globals(ref.engine.globals, run.engine.globals)  # the run is unharmed
