"""Issue 12's crash and poisoning cases over a real Mosquitto, against the real coordinator transport and
engine: one statistics fleet (3 devices on MqttDeviceTransport), an attacker publishing raw bytes on device
topics, a coordinator restart that gets the bad retained hellos again, and a mutated sample with statuses."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gate_helpers import CLASSES, FLEET, device, expected_prototypes, hello, honest_update
from test_fuzz import Mutator
from test_gate import DEEP, DEEP_HELLO, int8_update, raw_message, update

from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT
from fedge.coordinator.config import DeviceSlotCheck
from fedge.coordinator.engine import EngineConfig, RoundEngine, RoundReport
from fedge.coordinator.strategies.fedproto import FedProtoStrategy
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.chunking import split
from fedge.mqtt.client import new_paho_client
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.topics import FleetTopics


class Devices:
    """Three honest devices: answer each new round once ``go`` is set for it (after the attack)."""

    def __init__(self, broker: MosquittoProcess, go: dict[int, threading.Event]) -> None:
        self.devs = [device(i) for i in range(3)]
        self.go = go
        self.transports = [MqttDeviceTransport(broker.settings(), FLEET, d.device_id).start() for d in self.devs]
        for d, t in zip(self.devs, self.transports, strict=True):
            t.send_hello(hello(d))
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(3)]
        for th in self.threads:
            th.start()

    def loop(self, i: int) -> None:
        t, d, answered = self.transports[i], self.devs[i], set()
        while not self.stop.is_set():
            raw = t.current_round()
            if raw:
                msg = Message.from_bytes(raw)
                rnd, phase = msg.round, msg.info["round"]["phase"]
                if (msg.info["run"], rnd) not in answered and self.go.setdefault(rnd, threading.Event()).wait(0.1):
                    answered.add((msg.info["run"], rnd))
                    data = (Message("update", d.device_id, rnd, FLEET, info={"metrics": {"acc_global": 1.0}})
                            .to_bytes() if phase == "final" else honest_update(d, rnd))
                    t.send_update(data)
                    continue
            t.wait_for_round(0.1)

    def close(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(5)
        for t in self.transports:
            t.close()


def run_coordinator(broker: MosquittoProcess, state: Path, rounds: int, *, stop_after: int | None = None,
                    on_round: Any = None) -> tuple[RoundEngine, list[RoundReport]]:
    strat = FedProtoStrategy(num_classes=CLASSES, rounds=rounds)
    transport = MqttCoordinatorTransport(broker.settings(), FLEET).start()
    # d0-d2 have slots (as `fedge coordinator run` builds from the fleet config), so the fleet's embedding
    # size is known before any hello: retained hellos arrive in the broker's order, and without slots the
    # first registered one (d8's, p = 32, when it came first) would set it and lock the honest devices out.
    # Every wait is bounded: a device that is never registered fails the test within seconds.
    slots = {d.device_id: DeviceSlotCheck(d, tuple(range(CLASSES))) for d in (device(i) for i in range(3))}
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=3, round_timeout_s=20, quorum_timeout_s=20,
                       allowed_devices=frozenset({"d0", "d1", "d2", "d7", "d8"}), slots=slots)
    engine = RoundEngine(strat, transport, cfg, state_dir=state)
    reports = []
    try:
        start = engine.completed + 1
        for rnd in range(start, (stop_after or rounds + 1) + 1):
            reports.append(engine.run_round(rnd))
            if on_round is not None:
                on_round(reports[-1])
    finally:
        transport.close()
    return engine, reports


def test_issue_12_cases_over_mosquitto_then_a_restart_with_the_bad_retained_hellos(
        tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    t = FleetTopics(FLEET)
    go = {r: threading.Event() for r in range(1, 5)}
    attacker = new_paho_client("attacker", clean_session=True)
    attacker.connect("127.0.0.1", mosquitto.port)
    attacker.loop_start()

    def pub(topic: str, payload: bytes, retain: bool = False) -> None:
        attacker.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    # retained bad hellos, there before the coordinator starts: extra = [], a 20,000-deep hello, and a
    # hello with embedding size 32 in a fleet of 64
    pub(t.hello("d7"), hello(device(7, extra=[])), retain=True)
    pub(t.hello("d9"), raw_message("d9", 0, {}, kind="hello", info="[" * DEEP_HELLO + "]" * DEEP_HELLO),
        retain=True)
    pub(t.hello("d8"), hello(device(8, feature_dim=32)), retain=True)
    deep = "[" * DEEP + "]" * DEEP
    frame = bytearray(split(honest_update(device(0), 1) + b"\0" * 4096, 1024)[0])
    bad_header = b'{"v": 1, "id": "ab", "seq": 1e999, "count": 2, "total": 10, "sha256": "' + b"0" * 64 + b'"}'
    attacks = [
        int8_update("d0", 1, [3]), int8_update("d0", 1, [40000, 1, 1]),
        raw_message("d0", 1, {}, header_extra='"x": ' + deep), raw_message("d0", 1, {}, info='{"a": ' + deep + "}"),
        raw_message("d0", 1, {}, info='{"a": ' + "[" * 600 + "]" * 600 + "}"),
        update("d0", 1, info={"metrics": 5}), update("d0", 1, info={"bytes_down": "x"}),
        update("d0", 1, info={"metrics": {"acc_global": "x"}}),
        update("d0", 1, counts=np.full(CLASSES, 2**62, np.int64)),
        update("d0", 1, counts=np.full(CLASSES, 2**63 - 1, np.int64)),
        bytes(frame[:8]) + len(bad_header).to_bytes(4, "little") + bad_header + b"xx",   # seq = 1e999
    ]

    def attack(rep_round: int) -> None:
        for a in attacks:
            pub(t.update("d0"), a)
        pub(t.status("d0"), b"\xff junk status")
        go[rep_round].set()

    devices = Devices(mosquitto, go)
    state = tmp_path / "state"
    try:
        # round 1 runs while the attack goes on; the coordinator is then stopped (as by a crash) after it
        threading.Timer(1.0, attack, args=(1,)).start()
        _, first = run_coordinator(mosquitto, state, rounds=2, stop_after=1)
        # the restarted coordinator gets the same retained bad hellos again, and finishes the run
        go[2].set()
        go[3].set()
        engine, rest = run_coordinator(mosquitto, state, rounds=2)
    finally:
        devices.close()
        attacker.loop_stop()
        attacker.disconnect()
    r1 = first[0]
    assert sorted(r1.accepted) == ["d0", "d1", "d2"]
    assert r1.rejected_by_device["d0"] == {"dtype": 1, "oversize": 1, "malformed": 4, "info": 3, "counts": 2}
    assert r1.rejected_by_device["d7"] == {"hello-malformed": 1} and r1.rejected_by_device["d9"] == {
        "hello-malformed": 1}
    assert r1.rejected_by_device["d8"] == {"hello-feature_dim": 1}
    assert [r.round for r in rest] == [2, 3] and all(sorted(r.accepted) == ["d0", "d1", "d2"] for r in rest)
    # the retained ones, again: counted in the round during which the new session received them (the
    # restored devices make the quorum at once, so that may be round 2 or 3)
    again: Counter[str] = Counter()
    for r in rest:
        again.update({k: v for k, v in r.rejected.items() if k.startswith("hello-")})
    assert again == {"hello-malformed": 2, "hello-feature_dim": 1}
    protos, counts = expected_prototypes(devices.devs, 2)
    glob = engine.globals[PROTOTYPES_ARTIFACT]
    np.testing.assert_array_equal(glob["counts"], counts)
    np.testing.assert_allclose(glob["protos"], protos, rtol=1e-5, atol=1e-6)


def test_a_mutated_sample_over_mosquitto_never_stops_the_coordinator(tmp_path: Path,
                                                                    mosquitto: MosquittoProcess) -> None:
    t = FleetTopics(FLEET)
    mutate = Mutator(seed=7)
    go = {r: threading.Event() for r in range(1, 4)}
    attacker = new_paho_client("fuzzer", clean_session=True)
    attacker.connect("127.0.0.1", mosquitto.port)
    attacker.loop_start()
    sent = {"n": 0}

    def fuzz(rnd: int) -> None:
        base = [honest_update(device(i), rnd) for i in range(3)]
        infos = []
        for k in range(150):
            i = k % 3
            kind = k % 5
            if kind == 0:
                topic, data = t.status(f"d{i}"), mutate.rng.bytes(int(mutate.rng.integers(0, 12)))
            elif kind == 1:
                topic, data = t.hello(f"d{i}"), mutate(hello(device(i)))
            elif kind == 2:
                topic, data = t.update(f"d{i}"), mutate(split(base[i] + b"\0" * 3000, 1024)[k % 3])
            else:
                topic, data = t.update(f"d{i}"), mutate(base[i])
            infos.append(attacker.publish(topic, data, qos=1))
        for info in infos:
            info.wait_for_publish(10)
        sent["n"] += len(infos)
        # the devices' real hellos and statuses again (a mutated retained hello replaced theirs)
        for i in range(3):
            attacker.publish(t.hello(f"d{i}"), hello(device(i)), qos=1, retain=True).wait_for_publish(10)
            attacker.publish(t.status(f"d{i}"), b"online", qos=1, retain=True).wait_for_publish(10)
        go[rnd].set()

    devices = Devices(mosquitto, go)
    try:
        def on_round(rep: RoundReport) -> None:
            if rep.round < 2:
                threading.Thread(target=fuzz, args=(rep.round + 1,), daemon=True).start()
            else:
                go[3].set()  # the final round: the devices report their metrics at once

        threading.Timer(1.0, fuzz, args=(1,)).start()
        engine, reports = run_coordinator(mosquitto, tmp_path / "state", rounds=2, on_round=on_round)
    finally:
        devices.close()
        attacker.loop_stop()
        attacker.disconnect()
    assert sent["n"] == 300
    assert [r.round for r in reports] == [1, 2, 3]
    assert all(sorted(r.accepted) == ["d0", "d1", "d2"] for r in reports)
    assert sum(sum(r.rejected.values()) for r in reports) > 100  # most mutations are refused, and counted
    assert np.all(np.isfinite(engine.globals[PROTOTYPES_ARTIFACT]["protos"]))


SLOT_FLEET = """
[run]
method = "fedproto"
rounds = 1
dataset = "digits"
fleet = "slots"

[partition]
kind = "dirichlet"
alpha = 1.0

[[devices]]
profile = "rpi4-2gb"
count = 2
arch = "tier-xs"
"""


def test_fedge_coordinator_run_refuses_a_hello_that_contradicts_its_slot(tmp_path: Path,
                                                                         mosquitto: MosquittoProcess) -> None:
    """The issue's case, against the real command: device 1's credential announces a tier-l, fp32, 629-sample
    device in a tier-xs, fp16 slot; the coordinator refuses it (counted, and told on its refused topic)
    and keeps waiting for its quorum; device 2's true hello is accepted (its refused topic stays empty)."""
    import os
    import subprocess
    import sys

    from fedge.common.rounds import DeviceInfo
    from fedge.fleet.config import load_fleet
    from fedge.fleet.slots import checked_slots

    path = tmp_path / "slots.toml"
    path.write_text(SLOT_FLEET)
    slots = checked_slots(load_fleet(path))
    good, bad = slots[1].info(), slots[0].info()
    assert (bad.arch, bad.upload_precision, bad.feature_dim) == ("tier-xs", "fp16", 64)
    lie = DeviceInfo(bad.device_id, "tier-l", bad.profile, "fp32", 629, 64, {})
    t = FleetTopics("slots")
    refused: dict[str, bytes] = {}
    got = threading.Event()
    spy = new_paho_client("spy", clean_session=True)

    def on_message(_c: object, _u: object, m: Any, *_: object) -> None:
        refused[m.topic.rsplit("/", 1)[1]] = bytes(m.payload)
        if m.payload:
            got.set()

    spy.on_message = on_message
    spy.connect("127.0.0.1", mosquitto.port)
    spy.subscribe(f"{t.base}/refused/#", qos=1)
    spy.loop_start()
    for info in (lie, good):
        msg = Message("hello", info.device_id, 0, "slots", info={"device": info.to_dict()}).to_bytes()
        spy.publish(t.hello(info.device_id), msg, qos=1, retain=True).wait_for_publish(10)
    proc = subprocess.Popen([sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(path),
                             "--broker", mosquitto.url, "--state-dir", str(tmp_path / "state"), "--quorum", "1",
                             "--quorum-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert got.wait(60), "no refusal within 60 s"
        assert proc.poll() is None  # still waiting for its quorum: a refused hello stops nothing
    finally:
        proc.kill()
        out = proc.communicate(timeout=10)[0].decode()
        spy.loop_stop()
        spy.disconnect()
    refusal = Message.from_bytes(refused[bad.device_id])
    assert refusal.kind == "refused" and refusal.info["reason"] == "slot", refusal.info
    assert refusal.info["message"] == (
        f"slot: {bad.device_id}'s hello contradicts its slot in the fleet config: arch: expected 'tier-xs', got "
        f"'tier-l'; upload_precision: expected 'fp16', got 'fp32'; num_samples: expected {bad.num_samples}, "
        "got 629")
    assert refused.get(good.device_id, b"") == b""  # accepted: a refusal is cleared, never set
    assert f"refused a hello from {bad.device_id} (hello-slot)" in out


def test_accepting_a_device_clears_only_a_refusal_the_broker_holds(tmp_path: Path,
                                                                     mosquitto: MosquittoProcess) -> None:
    """A new device's acceptance sends nothing on its refused topic (at 20,000 devices that was 20,000 retained
    clears at the start, each forwarded by every relay); a refusal an earlier process left retained is cleared
    when that device is accepted, and one this process sends stays until the device is."""
    t = FleetTopics(FLEET)
    seen: list[tuple[str, bytes]] = []
    lock = threading.Lock()
    spy = new_paho_client("refusal-spy", clean_session=True)

    def on_message(_c: object, _u: object, m: Any, *_: object) -> None:
        with lock:
            seen.append((m.topic.rsplit("/", 1)[1], bytes(m.payload)))

    spy.on_message = on_message
    spy.connect("127.0.0.1", mosquitto.port)
    spy.loop_start()
    stale = Message("refused", "coordinator", 0, FLEET, info={"device": "d1", "reason": "slot"}).to_bytes()
    spy.publish(t.refused("d1"), stale, qos=1, retain=True).wait_for_publish(10)  # an earlier process's
    for dev in (device(0), device(1)):
        spy.publish(t.hello(dev.device_id), hello(dev), qos=1, retain=True).wait_for_publish(10)
    spy.publish(t.hello("d9"), hello(device(9)), qos=1, retain=True).wait_for_publish(10)  # not in the fleet
    spy.subscribe(f"{t.base}/refused/#", qos=1)
    transport = MqttCoordinatorTransport(mosquitto.settings(), FLEET).start()
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=2, round_timeout_s=20, quorum_timeout_s=20,
                       allowed_devices=frozenset({"d0", "d1", "d2"}))
    engine = RoundEngine(FedProtoStrategy(num_classes=CLASSES, rounds=1), transport, cfg)
    try:
        assert engine.await_fleet(["d0", "d1", "d9"], 20) == []
        assert set(engine.devices) == {"d0", "d1"} and engine.gate.refused == {"d9"}
        # a marker after the coordinator's messages: everything it sent has reached the spy once this has
        spy.publish(t.refused("zz"), b"end", qos=1).wait_for_publish(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ("zz", b"end") not in seen:
            time.sleep(0.05)
    finally:
        transport.close()
        spy.loop_stop()
        spy.disconnect()
    with lock:
        got = [(dev, data) for dev, data in seen if dev != "zz"]
    # the stale refusal retained before the spy subscribed came first; then d1's clear and d9's refusal only
    assert got[0] == ("d1", stale)
    assert sorted((dev, bool(data)) for dev, data in got[1:]) == [("d1", False), ("d9", True)]
    assert Message.from_bytes(dict(got)["d9"]).info["reason"] == "unauthorized"
    assert "d0" not in dict(got)  # a newcomer: no message on its topic
