"""Wire protocol: topics, envelope + chunking round-trips, reassembly limits, and the MQTT transports
over a real Mosquitto (chunked updates and globals, last-will, recovery after a broker restart)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from fedge.common.messages import Message
from fedge.common.transport import Inbound
from fedge.errors import ConfigError, TransportError
from fedge.mqtt.broker import MosquittoProcess, free_port
from fedge.mqtt.chunking import (
    ChunkError,
    Reassembler,
    RetainedAssembler,
    chunk_frames,
    frame_kind,
    parse_frame,
    split,
)
from fedge.mqtt.client import MqttClient
from fedge.mqtt.connection import BrokerSettings, parse_broker_url
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.settings import TransportSettings
from fedge.mqtt.topics import FleetTopics


def _update(sender: str = "d1", rnd: int = 1, n: int = 40_000, precision: str = "fp32") -> tuple[Message, bytes]:
    rng = np.random.default_rng(0)
    msg = Message("update", sender, rnd, "f1", tensors={"w": rng.normal(size=n).astype(np.float32),
                                                         "counts": np.arange(10, dtype=np.int64)},
                  info={"num_samples": 12})
    return msg, msg.to_bytes(precision)


# -- topics ---------------------------------------------------------------------------------------

def test_topics_build_and_parse() -> None:
    t = FleetTopics("lab")
    assert t.update("rpi4-2gb-1") == "fedge/lab/devices/rpi4-2gb-1/update"
    assert t.round == "fedge/lab/rounds/current"
    assert t.global_part("prototypes", 3) == "fedge/lab/global/prototypes/part/3"
    d = t.parse_device("fedge/lab/devices/rpi4-2gb-1/status")
    assert d is not None and (d.device_id, d.kind) == ("rpi4-2gb-1", "status")
    assert t.parse_device("fedge/other/devices/x/status") is None
    assert t.parse_device("fedge/lab/devices/x/secret") is None
    g = t.parse_global("fedge/lab/global/group-tier-xs/part/2")
    assert g is not None and (g.artifact, g.part) == ("group-tier-xs", 2)
    assert t.parse_global("fedge/lab/global/prototypes").part is None  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", ["a/b", "+", "#", "", "dev ice", "$SYS"])
def test_topic_levels_are_validated(bad: str) -> None:
    with pytest.raises(ConfigError, match="MQTT topic"):
        FleetTopics("lab").update(bad)


def test_broker_urls() -> None:
    s = parse_broker_url("mqtts://alice:s%40cret@broker.lan", ca_file="ca.crt")
    assert (s.host, s.port, s.tls, s.username, s.password) == ("broker.lan", 8883, True, "alice", "s@cret")
    assert parse_broker_url("127.0.0.1:1884").port == 1884
    assert parse_broker_url("mqtt://h:1", username="bob").username == "bob"
    with pytest.raises(ConfigError, match="scheme"):
        parse_broker_url("http://h")


# -- envelope + chunking --------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_envelope_and_chunking_round_trip(precision: str) -> None:
    msg, data = _update(precision=precision)
    frames = split(data, 16 * 1024)
    assert len(frames) > 1 and all(frame_kind(f) == "chunk" for f in frames)
    r = Reassembler(max_bytes=1 << 22)
    out = [r.add("d1", f) for f in reversed(frames)]  # out of order on purpose
    assert out[:-1] == [None] * (len(frames) - 1) and out[-1] == data
    back = Message.from_bytes(out[-1])
    assert (back.sender, back.round, back.fleet, back.kind, back.msg_id, back.info) == \
        (msg.sender, msg.round, msg.fleet, msg.kind, msg.msg_id, msg.info)
    tol = {"fp32": 0, "fp16": 2e-3, "int8": 0.05}[precision]
    np.testing.assert_allclose(back.tensors["w"], msg.tensors["w"], atol=tol * 4 + 1e-7, rtol=tol)
    np.testing.assert_array_equal(back.tensors["counts"], msg.tensors["counts"])
    assert r.pending_bytes() == 0


def test_small_messages_are_not_chunked() -> None:
    _, data = _update(n=100)
    assert split(data, 16 * 1024) == [data]
    assert frame_kind(data) == "message"


def test_chunk_checksums_duplicates_and_limits() -> None:
    _, data = _update()
    frames = split(data, 16 * 1024)
    r = Reassembler(max_bytes=1 << 22)
    assert r.add("d1", frames[0]) is None
    assert r.add("d1", frames[0]) is None  # QoS 1 redelivery: ignored
    corrupt = bytearray(frames[1])
    corrupt[-1] ^= 0xFF
    with pytest.raises(ChunkError) as exc:
        r.add("d1", bytes(corrupt))
    assert exc.value.reason == "checksum"
    assert r.pending_bytes() == 0  # the poisoned transfer was dropped
    with pytest.raises(ChunkError) as exc:
        Reassembler(max_bytes=10_000).add("d1", frames[0])
    assert exc.value.reason == "oversize"
    with pytest.raises(ChunkError) as exc:
        parse_frame(b"FDGCHUNK" + b"\xff\xff\x00\x00" + b"{}")
    assert exc.value.reason == "malformed"


def test_transfers_from_two_sources_interleave_and_stale_ones_expire() -> None:
    _, a = _update("d1")
    _, b = _update("d2", n=30_000)
    fa, fb = split(a, 16 * 1024), split(b, 16 * 1024)
    r = Reassembler(max_bytes=1 << 22, timeout_s=10)
    done = {}
    for i in range(max(len(fa), len(fb))):
        for src, frames in (("d1", fa), ("d2", fb)):
            if i < len(frames):
                out = r.add(src, frames[i], now=0.0)
                if out is not None:
                    done[src] = out
    assert done == {"d1": a, "d2": b}
    r.add("d3", fa[0], now=0.0)
    assert r.expire(now=5.0) == []
    assert [s for s, _ in r.expire(now=11.0)] == ["d3"]
    assert r.pending_bytes() == 0


@pytest.mark.parametrize("order", ["manifest-last", "manifest-first", "stale-parts"])
def test_retained_global_reassembles_in_any_order(order: str) -> None:
    _, data = _update()
    manifest, parts = chunk_frames(data, 16 * 1024)
    asm = RetainedAssembler(max_bytes=1 << 22)
    if order == "stale-parts":
        _, old_data = _update(n=50_000)
        _, old_parts = chunk_frames(old_data, 16 * 1024)
        for p in old_parts[:2]:
            assert asm.on_part(p) is None
    if order == "manifest-first":
        assert asm.on_root(manifest) is None
        results = [asm.on_part(p) for p in parts]
    else:
        results = [asm.on_part(p) for p in parts] + [asm.on_root(manifest)]
    assert results[-1] == data and hashlib.sha256(results[-1]).hexdigest() == parse_frame(manifest)[0].sha256
    assert asm.on_root(data) == data  # a whole message on the root replaces a chunked one


# -- the transports over Mosquitto ----------------------------------------------------------------

def _pair(broker: MosquittoProcess, chunk: int = 16 * 1024,
          ) -> tuple[MqttCoordinatorTransport, MqttDeviceTransport]:
    wire = TransportSettings(chunk_bytes=chunk, global_timeout_s=10)
    co = MqttCoordinatorTransport(broker.settings(), "f1", wire).start()
    dev = MqttDeviceTransport(broker.settings(), "f1", "d1", wire).start()
    return co, dev


def _collect(co: MqttCoordinatorTransport, rnd: int, expected: set[str], seconds: float = 10) -> list[Inbound]:
    pending, out = set(expected), []
    for item in co.collect(rnd, pending, time.time() + seconds):
        out.append(item)
        if item.reject is None and item.origin:
            pending.discard(item.origin)
    return out


def _round(rnd: int, globals_: dict[str, int], run: str = "run-a") -> bytes:
    return Message("round", "coordinator", rnd, "f1", info={"round": {"round": rnd}, "run": run,
                                                             "globals": globals_}).to_bytes()


def test_chunked_update_and_global_over_mosquitto(mosquitto: MosquittoProcess) -> None:
    co, dev = _pair(mosquitto)
    try:
        dev.send_hello(Message("hello", "d1", 0, "f1").to_bytes())
        co.wait_for_hellos(["d1"], 10)
        assert [h.origin for h in co.hellos()] == ["d1"]
        end = time.time() + 10
        while not co.online() and time.time() < end:  # the status may follow the hello
            co.wait_for_devices(0.1)
        assert co.online() == {"d1"}
        # (encode once: safetensors writes metadata in hash-map order, so two encodings may differ in bytes)
        glob = Message("global", "coordinator", 1, "f1", tensors={"w": np.ones(50_000, np.float32)}).to_bytes()
        co.publish_global("group-a", glob)
        co.announce_round(_round(2, {"group-a": 1}))
        assert dev.wait_for_round(10)
        assert dev.fetch_global("group-a") == glob
        assert dev.fetch_global("not-yet-published") is None  # the descriptor does not name it
        _, data = _update(rnd=2)
        dev.send_update(data)
        items = _collect(co, 2, {"d1"})
        assert [(i.origin, i.data == data, i.reject) for i in items] == [("d1", True, None)]
    finally:
        dev.close()
        co.close()


def test_a_late_device_gets_the_retained_state(mosquitto: MosquittoProcess) -> None:
    wire = TransportSettings(chunk_bytes=16 * 1024, global_timeout_s=10)
    co = MqttCoordinatorTransport(mosquitto.settings(), "f1", wire).start()
    glob = Message("global", "coordinator", 3, "f1", tensors={"w": np.arange(40_000, dtype=np.float32)}).to_bytes()
    co.publish_global("prototypes", glob)
    co.announce_round(_round(4, {"prototypes": 3}))
    dev = MqttDeviceTransport(mosquitto.settings(), "f1", "late", wire).start()
    try:
        deadline = time.time() + 10
        while dev.current_round() is None and time.time() < deadline:
            dev.wait_for_round(0.5)
        assert Message.from_bytes(dev.current_round() or b"").round == 4
        assert dev.fetch_global("prototypes") == glob
    finally:
        dev.close()
        co.close()


def test_last_will_marks_a_vanished_device_offline(mosquitto: MosquittoProcess) -> None:
    co, dev = _pair(mosquitto)
    try:
        dev.send_hello(Message("hello", "d1", 0, "f1").to_bytes())
        co.wait_for_hellos(["d1"], 10)
        dev.abort()  # no DISCONNECT: the broker publishes the will
        end = time.time() + 10
        while "d1" not in co.offline() and time.time() < end:
            co.wait_for_devices(0.2)
        assert co.offline() == {"d1"}
        # collect returns at once when every expected device is offline, deadline or not
        t0 = time.time()
        assert _collect(co, 1, {"d1"}, seconds=30) == []
        assert time.time() - t0 < 2
    finally:
        co.close()


def test_devices_and_coordinator_survive_a_broker_restart(mosquitto: MosquittoProcess) -> None:
    """The broker dies with everything it held; both sides reconnect, the coordinator republishes its retained
    state and re-announces the round, and the device resends the update the coordinator may have missed."""
    co, dev = _pair(mosquitto)
    try:
        dev.send_hello(Message("hello", "d1", 0, "f1").to_bytes())
        co.wait_for_hellos(["d1"], 10)
        co.hellos()
        glob = Message("global", "coordinator", 1, "f1", tensors={"w": np.ones(30_000, np.float32)}).to_bytes()
        co.publish_global("group-a", glob)
        co.announce_round(_round(2, {"group-a": 1}))
        assert dev.wait_for_round(10)
        assert dev.fetch_global("group-a") == glob
        _, data = _update(rnd=2)
        dev.send_update(data)
        assert [i.data == data for i in _collect(co, 2, {"d1"})] == [True]

        mosquitto.kill()
        assert _wait_until(lambda: not dev.client.connected and not co.client.connected, 10)
        mosquitto.start()  # same port, empty: no retained messages, no sessions
        end = time.time() + 20
        while not (dev.client.connected and co.client.connected) and time.time() < end:
            time.sleep(0.1)
        assert dev.client.connected and co.client.connected
        # the device said hello again, and resent its cached round-2 update after the re-announcement
        co.wait_for_hellos(["d1"], 10)
        again = _collect(co, 2, {"d1"})
        assert [(i.origin, i.data == data) for i in again] == [("d1", True)]
        # a device connecting now still finds the globals (republished, retained)
        late = MqttDeviceTransport(mosquitto.settings(), "f1", "d2",
                                   TransportSettings(chunk_bytes=16 * 1024, global_timeout_s=10)).start()
        try:
            end = time.time() + 10
            while late.current_round() is None and time.time() < end:
                late.wait_for_round(0.5)
            assert late.fetch_global("group-a") == glob
        finally:
            late.close()
    finally:
        dev.close()
        co.close()


def test_refused_connection_is_a_clear_error(mosquitto: MosquittoProcess) -> None:
    with pytest.raises(TransportError, match="no connection"):
        MqttDeviceTransport(BrokerSettings(port=free_port()), "f1", "d1",
                            TransportSettings(connect_timeout_s=1)).start()


# -- broker outages: publishing waits, a graceful shutdown's last-wills are no mass dropout -----------

def test_publishing_while_the_broker_is_down_waits_for_it(mosquitto_bin: str) -> None:
    """paho 2.2 raises RuntimeError from is_published() for a message queued while disconnected; the
    transport instead waits for the reconnection and the broker's acknowledgement."""
    with MosquittoProcess(persistence=True) as broker:
        wire = TransportSettings(chunk_bytes=16 * 1024, global_timeout_s=10)
        co = MqttCoordinatorTransport(broker.settings(reconnect_min_s=0.2, reconnect_max_s=1), "f1", wire).start()
        glob = Message("global", "coordinator", 1, "f1", tensors={"w": np.ones(20_000, np.float32)}).to_bytes()
        restart = threading.Timer(1.5, broker.start)  # joined below: it must not outlive the test
        try:
            broker.kill()
            assert _wait_until(lambda: not co.client.connected, 10)  # the restart timer starts after this
            restart.start()
            t0 = time.time()
            co.publish_global("group-a", glob)  # chunked: 5 parts + manifest, all queued while down
            co.announce_round(_round(2, {"group-a": 1}))
            assert 1.0 < time.time() - t0 < 15 and co.client.connected
            dev = MqttDeviceTransport(broker.settings(), "f1", "d1", wire).start()
            try:
                assert dev.wait_for_round(10)
                assert Message.from_bytes(dev.current_round() or b"").round == 2
                assert dev.fetch_global("group-a") == glob
            finally:
                dev.close()
            # bounded: with the broker gone for good, a clear TransportError, not a RuntimeError
            broker.kill()
            short = MqttCoordinatorTransport(broker.settings(), "f1", TransportSettings(publish_timeout_s=1.0))
            short.client = co.client
            with pytest.raises(TransportError, match=r"announcing the round: the broker .* did not acknowledge 1 of 1"):
                short.announce_round(_round(3, {}))
        finally:
            if restart.ident is not None:
                restart.join()
            co.close()


def _wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_graceful_broker_restart_is_not_a_mass_dropout(mosquitto_bin: str) -> None:
    """SIGTERM: Mosquitto publishes every device's last-will just before it drops the coordinator, and keeps
    those `offline` statuses across the restart. The coordinator must not take them for a mass dropout: the
    round goes on and takes the updates sent after the reconnection; a device that really stays away counts
    as offline once the grace period after the reconnection is over."""
    with MosquittoProcess(persistence=True) as broker:
        fast = broker.settings(reconnect_min_s=0.2, reconnect_max_s=1)
        wire = TransportSettings(chunk_bytes=16 * 1024, global_timeout_s=10, status_grace_s=4.0)
        co = MqttCoordinatorTransport(fast, "f1", wire).start()
        devs = {d: MqttDeviceTransport(fast, "f1", d, wire).start() for d in ("d1", "d2", "d3")}
        try:
            for d, t in devs.items():
                t.send_hello(Message("hello", d, 0, "f1").to_bytes())
            co.wait_for_hellos(list(devs), 10)
            assert _wait_until(lambda: co.online() == set(devs), 10)
            co.announce_round(_round(1, {}))
            gone = devs.pop("d3")
            broker.terminate()
            gone.abort()  # d3 does not come back: its last-will from the shutdown is its true status
            time.sleep(0.3)
            broker.start()
            t0 = time.time()
            assert _wait_until(lambda: co.client.connected and all(t.client.connected for t in devs.values()), 15)
            # the last-wills arrived (before and after the reconnection), yet nobody is offline yet
            assert co._book._status["d1"][0] or co._book._status["d2"][0] or "d3" in co._book._status
            assert co.offline() == set()
            updates = {d: Message("update", d, 1, "f1", info={"num_samples": 3}).to_bytes() for d in devs}
            for d, t in devs.items():
                t.send_update(updates[d])
            got = _collect(co, 1, {"d1", "d2", "d3"}, seconds=20)
            accepted = {i.origin: i.data for i in got if i.reject is None}
            assert {d: accepted.get(d) for d in updates} == updates
            # d3's status stays "offline" (its last-will) and counts once the grace period is over
            assert co.offline() == {"d3"} and time.time() - t0 >= wire.status_grace_s - 1
        finally:
            for t in devs.values():
                t.close()
            co.close()


def test_a_stray_retained_update_is_refused_and_deleted(mosquitto: MosquittoProcess) -> None:
    rogue = MqttDeviceTransport(mosquitto.settings(), "f1", "d1").start()
    t = FleetTopics("f1")
    _, data = _update(n=100)
    rogue.client.wait_published([rogue.client.publish(t.update("d1"), data, retain=True)], 5)
    co = MqttCoordinatorTransport(mosquitto.settings(), "f1").start()
    try:
        got = _collect(co, 1, {"d1"}, seconds=1.5)
        assert [(i.origin, i.reject[0] if i.reject else None) for i in got] == [("d1", "retained")]
        # deleted: a new subscriber finds nothing retained there
        seen: list[bytes] = []
        spy = MqttClient(mosquitto.settings(), "spy", on_message=lambda m: seen.append(m.payload)).start(5)
        spy.subscribe(t.update("d1"))
        time.sleep(0.5)
        spy.stop()
        assert seen == []
    finally:
        rogue.close()
        co.close()
