"""The coordinator says what it waits for: while the quorum, the fleet's hellos or a round are incomplete, one
log line every few seconds names the missing devices and why — a refused device with its reason, an offline
one, one that said nothing yet. The scenario of issue 28: quorum 1.0 and a device whose hello contradicts its
slot, which used to leave the coordinator silent for the whole quorum timeout. Over a real Mosquitto."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.config import DeviceSlotCheck, EngineConfig
from fedge.coordinator.engine import RoundEngine
from fedge.errors import TransportError
from fedge.fleet.registry import method_entry
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.observe.monitor import FleetMonitor, fleet_infos

FLEET = "waits"


def info(dev: str, arch: str = "tier-xs") -> DeviceInfo:
    return DeviceInfo(dev, arch, "rpi4-4gb", "fp32", 100, 64)


def engine_and_monitor(transport: MqttCoordinatorTransport, **cfg: float) -> tuple[RoundEngine, FleetMonitor]:
    slots = {d: DeviceSlotCheck(info(d)) for d in ("d1", "d2", "d3")}
    config = EngineConfig(fleet=FLEET, method="fedproto", expected_devices=3, slots=slots,
                          allowed_devices=frozenset(slots), **cfg)  # type: ignore[arg-type]
    entry = method_entry("fedproto")
    strategy = entry.build_strategy(entry.parse({}), num_classes=10, rounds=1)
    mon = FleetMonitor(fleet=FLEET, method="fedproto", total_rounds=1, transport=transport,
                       fleet_devices=fleet_infos(slots), wait_log_s=0.5, poll_s=0.1)
    return RoundEngine(strategy, transport, config, observers=[mon]), mon


def device(broker: MosquittoProcess, dev: str, arch: str = "tier-xs") -> MqttDeviceTransport:
    t = MqttDeviceTransport(broker.settings(), FLEET, dev).start()
    t.send_hello(Message("hello", dev, 0, FLEET, info={"device": info(dev, arch).to_dict()}).to_bytes())
    return t


def lines(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "fedge.observe.monitor" and r.getMessage().startswith(start)]


def test_quorum_wait_names_the_refused_device_and_its_reason(mosquitto: MosquittoProcess,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    coord = MqttCoordinatorTransport(mosquitto.settings(), FLEET).start()
    engine, mon = engine_and_monitor(coord, quorum_fraction=1.0, quorum_timeout_s=4.0)
    good = device(mosquitto, "d1")
    bad = device(mosquitto, "d2", arch="tier-xl")  # contradicts its slot: refused (hello-slot)
    mon.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="quorum not reached"):
            engine.await_quorum()
        assert time.monotonic() - t0 < 8
        time.sleep(0.3)
        mon.tick()
    finally:
        mon.stop()
        good.close()
        bad.close()
        coord.close()
    waits = lines(caplog, "waiting for a quorum of 3 devices")
    assert len(waits) >= 3, [r.getMessage() for r in caplog.records]  # every ~0.5 s over ~4 s
    last = waits[-1]
    assert last.levelno == logging.WARNING
    text = last.getMessage()
    assert "(1 online;" in text
    assert ("d2 (refused: hello-slot: d2's hello contradicts its slot in the fleet config: arch: expected "
            "'tier-xs', got 'tier-xl')") in text
    assert "d3 (no hello yet)" in text
    assert "d1" not in text.split(":", 1)[1]  # the online device is not among the missing
    # the device learns it too: its transport received the retained refusal
    assert bad.refusal_text is not None and bad.refusal_text.startswith("refused by the coordinator: slot:")


def test_fleet_wait_ends_once_every_device_answered_or_was_refused(mosquitto: MosquittoProcess,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    coord = MqttCoordinatorTransport(mosquitto.settings(), FLEET).start()
    engine, mon = engine_and_monitor(coord)
    devs = [device(mosquitto, "d1"), device(mosquitto, "d2", arch="tier-xl")]
    mon.start()
    try:
        t0 = time.monotonic()
        missing = engine.await_fleet(["d1", "d2", "d3"], 2.0)
        assert missing == ["d3"] and time.monotonic() - t0 < 5
        devs.append(device(mosquitto, "d3"))
        assert engine.await_fleet(["d1", "d2", "d3"], 10.0) == []  # d2 refused counts as answered
    finally:
        mon.stop()
        for d in devs:
            d.close()
        coord.close()
    waits = [r.getMessage() for r in lines(caplog, "waiting for hellos from")]
    # d3 is named as without a hello wherever it is waited for: "no hello yet" before it connects, "online, no valid
    # hello yet" in the moment between its online status and its hello's registration (a clean-clone run caught
    # one); a line written between its hello and the end of the second wait names only d2
    assert any("d3 (no hello yet)" in w for w in waits)
    assert all(re.search(r"d3 \((online, no valid|no) hello yet\)", w) for w in waits if "d3" in w), waits
    assert any("d2 (refused: hello-slot:" in w for w in waits)


def test_round_wait_names_the_silent_and_the_offline_device(mosquitto: MosquittoProcess,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Two registered devices never answer round 1; one of them dies mid-round (its last-will)."""
    caplog.set_level(logging.INFO)
    coord = MqttCoordinatorTransport(mosquitto.settings(), FLEET).start()
    # The round ends at its timeout, wall time over a real broker: d2 dies 1.5 s into it, its offline status counts
    # after offline_confirm_s (1 s), and the next wait line (every 0.5 s) must name it before the round ends. With
    # 4 s that left ~1 s for the broker and the monitor's thread on a loaded machine; 8 s leaves ~5 s.
    engine, mon = engine_and_monitor(coord, min_devices=2, round_timeout_s=8.0, quorum_timeout_s=10.0)
    d1, d2 = device(mosquitto, "d1"), device(mosquitto, "d2")
    mon.start()
    done = threading.Event()
    try:
        def later() -> None:
            # 1.5 s into the round (not into the test): the first wait lines still find d2 online
            deadline = time.monotonic() + 30
            while mon.state != "round" and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.5)
            d2.abort()  # vanishes: the broker publishes its last-will "offline"

        threading.Thread(target=later, daemon=True).start()
        report = engine.run_round(1)
        done.set()
    finally:
        mon.stop()
        d1.close()
        coord.close()
    assert report.missing == ["d1", "d2"]
    waits = [r for r in lines(caplog, "round 1 (train): waiting for 2 of 2 devices")]
    assert waits, [r.getMessage() for r in caplog.records]
    assert waits[0].levelno == logging.INFO and "d1 (no update yet); d2 (no update yet)" in waits[0].getMessage()
    late = waits[-1].getMessage()
    assert "d1 (no update yet)" in late and "d2 (offline for" in late and "deadline in" in late
    assert waits[-1].levelno == logging.WARNING  # an offline device awaited: something is wrong
    view = mon.view()
    assert view["rounds"][0]["missing"] == ["d1", "d2"] and view["state"] == "between"
