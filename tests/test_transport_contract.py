"""One transport contract, two transports: the in-memory twin and MQTT over a real Mosquitto.

Every test here runs unchanged over both (``net`` is parametrised), with the real
round engine and FedProto's real coordinator half where a round is involved, and
scripted devices that send exact, hand-made updates, so each assertion names the
bytes, the order and the numbers a transport must produce:

* retained state: a device, even one that connects late, sees the latest round
  descriptor and global state, byte for byte (chunked over MQTT);
* updates: delivered whole, in the order one device sent them (chunked over MQTT);
* duplicates: delivered, and refused once by the engine;
* late updates: an update for the previous round is counted ``late`` in the next;
* resume: a coordinator that dies mid-round resumes from its checkpoint; the
  re-announced round is answered again and the final state equals an
  uninterrupted run's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport, InMemoryDeviceTransport
from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo
from fedge.common.transport import CoordinatorTransport, DeviceTransport, Inbound
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.fleet.registry import method_entry
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.settings import TransportSettings

FLEET = "contract"
CLASSES, DIM = 10, 8
SAMPLES = 1000  # every scripted device's sample count (hello and updates agree; class counts sum to less)
CHUNK = 16 * 1024
WIRE = TransportSettings(chunk_bytes=CHUNK, global_timeout_s=10)


class Net:
    """Makes the coordinator's and devices' transports of one kind, and steps scripted devices."""

    kind: str

    def coordinator(self) -> CoordinatorTransport:
        raise NotImplementedError

    def device(self, device_id: str) -> DeviceTransport:
        raise NotImplementedError

    def run_devices(self, devices: list[ScriptedDevice]) -> None:
        """Let ``devices`` answer every new round descriptor (in-memory: from the engine's collect)."""
        raise NotImplementedError

    def wait_hellos(self, coord: CoordinatorTransport, ids: list[str]) -> None:
        """Block until the coordinator has every hello (in-memory: they are there at once)."""

    def close(self) -> None:
        """Stop device threads and close connections."""


class InMemoryNet(Net):
    kind = "inmemory"

    def __init__(self) -> None:
        self.bus = InMemoryBus()

    def coordinator(self) -> CoordinatorTransport:
        return InMemoryCoordinatorTransport(self.bus)

    def device(self, device_id: str) -> DeviceTransport:
        return InMemoryDeviceTransport(self.bus)

    def run_devices(self, devices: list[ScriptedDevice]) -> None:
        def pump() -> None:
            for d in devices:
                d.step()

        self.bus.pump = pump


class MqttNet(Net):
    kind = "mqtt"

    def __init__(self, broker: MosquittoProcess) -> None:
        self.broker = broker
        self.opened: list[Any] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def coordinator(self) -> CoordinatorTransport:
        # the same client id every time: a "restarted" coordinator finds its persistent session
        t = MqttCoordinatorTransport(self.broker.settings(), FLEET, WIRE, client_id="contract-coordinator").start()
        self.opened.append(t)
        return t

    def device(self, device_id: str) -> DeviceTransport:
        t = MqttDeviceTransport(self.broker.settings(), FLEET, device_id, WIRE).start()
        self.opened.append(t)
        return t

    def run_devices(self, devices: list[ScriptedDevice]) -> None:
        def loop(d: ScriptedDevice) -> None:
            while not self.stop.is_set():
                d.step()
                d.transport.wait_for_round(0.2)

        for d in devices:
            th = threading.Thread(target=loop, args=(d,), daemon=True)
            th.start()
            self.threads.append(th)

    def wait_hellos(self, coord: CoordinatorTransport, ids: list[str]) -> None:
        assert isinstance(coord, MqttCoordinatorTransport)
        coord.wait_for_hellos(ids, 10)

    def close(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(10)
        for t in reversed(self.opened):
            t.close()


# The MQTT parameter is the name of the broker fixture, so the test's `mqtt` marker follows (conftest.py) and
# the quick loop runs the in-memory twin only; the ids stay "inmemory" and "mqtt".
@pytest.fixture(params=["inmemory", "mosquitto"], ids=["inmemory", "mqtt"])
def net(request: pytest.FixtureRequest) -> Iterator[Net]:
    n: Net = InMemoryNet() if request.param == "inmemory" else MqttNet(request.getfixturevalue(request.param))
    try:
        yield n
    finally:
        n.close()


def _protos(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(CLASSES, DIM)).astype(np.float32), rng.integers(1, 20, CLASSES).astype(np.int64)


def update(device_id: str, rnd: int, seed: int) -> bytes:
    protos, counts = _protos(seed)
    return Message("update", device_id, rnd, FLEET, tensors={"protos": protos, "counts": counts},
                   info={"num_samples": SAMPLES}).to_bytes()


@dataclass
class ScriptedDevice:
    """A device that answers each new round number with the updates ``script(round)`` returns (in the final
    round: a metrics-only update, as the protocol says)."""

    device_id: str
    transport: DeviceTransport
    script: Callable[[int], list[bytes]]
    answered: list[int] = field(default_factory=list)

    def hello(self) -> None:
        info = DeviceInfo(self.device_id, "tier-xs", "test", num_samples=SAMPLES, feature_dim=DIM)
        hello = Message("hello", self.device_id, 0, FLEET, info={"device": info.to_dict()})
        self.transport.send_hello(hello.to_bytes())

    def step(self) -> None:
        raw = self.transport.current_round()
        if raw is None:
            return
        msg = Message.from_bytes(raw)
        rnd = msg.round
        if self.answered and rnd <= self.answered[-1]:
            return
        self.answered.append(rnd)
        if msg.info["round"].get("phase") == "final":
            final = Message("update", self.device_id, rnd, FLEET, info={"metrics": {"acc_global": 0.5}})
            self.transport.send_update(final.to_bytes())
            return
        for data in self.script(rnd):
            self.transport.send_update(data)


def _collect(coord: CoordinatorTransport, rnd: int, expected: set[str], n: int, seconds: float = 60) -> list[Inbound]:
    """Up to ``n`` items, the way the engine drives collect (the live ``expected`` set shrinks)."""
    out: list[Inbound] = []
    pending = set(expected)
    for item in coord.collect(rnd, pending, time.time() + seconds):
        out.append(item)
        if len(out) >= n:
            pending.clear()
            break
    return out


def _engine(coord: CoordinatorTransport, rounds: int = 3, state_dir: Path | None = None,
            round_timeout_s: float = 0.0) -> RoundEngine:
    strat = method_entry("fedproto").build_strategy(None, num_classes=CLASSES, rounds=rounds)
    cfg = EngineConfig(fleet=FLEET, method="fedproto", round_timeout_s=round_timeout_s, min_devices=1)
    return RoundEngine(strat, coord, cfg, state_dir=state_dir)


def _fleet(net: Net, scripts: dict[str, Callable[[int], list[bytes]]]) -> list[ScriptedDevice]:
    devices = [ScriptedDevice(d, net.device(d), s) for d, s in scripts.items()]
    for d in devices:
        d.hello()
    return devices


def _expected_protos(seeds: list[int]) -> np.ndarray:
    sums = np.zeros((CLASSES, DIM))
    counts = np.zeros(CLASSES)
    for s in seeds:
        p, c = _protos(s)
        sums += p.astype(np.float64) * c[:, None]
        counts += c
    return (sums / counts[:, None]).astype(np.float32)


# -- retained state and whole, ordered updates ---------------------------------------------------------

def test_devices_see_the_latest_descriptor_and_globals_byte_for_byte(net: Net) -> None:
    coord = net.coordinator()
    old = Message("global", "coordinator", 1, FLEET, tensors={"w": np.zeros(10, np.float32)}).to_bytes()
    big = Message("global", "coordinator", 2, FLEET, tensors={"w": np.arange(30_000, dtype=np.float32)}).to_bytes()
    assert len(big) > 5 * CHUNK  # chunked over MQTT
    coord.publish_global("group-a", old)
    coord.publish_global("group-a", big)  # replaces the retained version
    descriptor = Message("round", "coordinator", 3, FLEET, info={"round": {"round": 3}, "run": "r1",
                                                                   "globals": {"group-a": 2}}).to_bytes()
    coord.announce_round(descriptor)
    late = net.device("late-joiner")  # connects after everything was published
    end = time.time() + 10
    while late.current_round() is None and time.time() < end:
        late.wait_for_round(0.2)
    assert late.current_round() == descriptor
    assert late.fetch_global("group-a") == big


def test_a_late_first_connect_handler_does_not_re_announce(mosquitto: Any) -> None:
    """The first connection's handler runs on the client's dispatcher thread and, on a loaded machine,
    after ``start()`` returned and the round was announced; it must not re-announce the round under a
    fresh id (as after a reconnect), which would make every device resend (seen once in a loaded run)."""
    net = MqttNet(mosquitto)
    try:
        coord = net.coordinator()
        assert isinstance(coord, MqttCoordinatorTransport)
        descriptor = Message("round", "coordinator", 1, FLEET, info={"round": {"round": 1}, "run": "r1"}).to_bytes()
        coord.announce_round(descriptor)
        end = time.time() + 5
        while coord.client.connects < 1 and time.time() < end:  # the dispatcher may not have run it yet
            time.sleep(0.01)
        assert coord.client.connects == 1
        coord._on_connect(False)  # the first connection's handler, run (again) after the announcement
        late = net.device("late-joiner")
        end = time.time() + 10
        while late.current_round() is None and time.time() < end:
            late.wait_for_round(0.2)
        late.wait_for_round(0.5)  # a re-announce would arrive within this
        assert late.current_round() == descriptor
    finally:
        net.close()


def test_updates_arrive_whole_and_in_the_order_sent(net: Net) -> None:
    coord = net.coordinator()
    dev = net.device("d1")
    sent = [update("d1", 1, 0),
            Message("update", "d1", 2, FLEET, tensors={"w": np.arange(40_000, dtype=np.float32)}).to_bytes(),
            update("d1", 3, 1)]
    assert len(sent[1]) > CHUNK > len(sent[0])
    for data in sent:
        dev.send_update(data)
    got = _collect(coord, 1, {"d1"}, n=3)
    assert [i.data for i in got] == sent
    assert all(i.reject is None and i.origin in (None, "d1") for i in got)


# -- through the real engine -----------------------------------------------------------------------------

def test_a_duplicate_is_delivered_and_refused_once(net: Net) -> None:
    coord = net.coordinator()
    scripts = {"d1": lambda r: [update("d1", r, 10 + r)] * 2,  # sent twice (a QoS 1 redelivery, a resend)
               "d2": lambda r: [update("d2", r, 20 + r)]}
    net.run_devices(_fleet(net, scripts))
    net.wait_hellos(coord, list(scripts))
    engine = _engine(coord, rounds=1)
    report = engine.run_round(1)
    assert sorted(report.accepted) == ["d1", "d2"]
    if net.kind == "mqtt":  # the round may close before the copy arrives; then it is stale in the next
        time.sleep(0.3)
    else:
        assert report.rejected == {"duplicate": 1}
    np.testing.assert_allclose(engine.globals[PROTOTYPES_ARTIFACT]["protos"], _expected_protos([11, 21]),
                               rtol=1e-6)
    np.testing.assert_array_equal(engine.globals[PROTOTYPES_ARTIFACT]["counts"], _protos(11)[1] + _protos(21)[1])
    final = engine.run_round(2)
    assert sum(report.rejected.values()) + sum(final.rejected.values()) == 1
    assert set(report.rejected) | set(final.rejected) <= {"duplicate", "stale"}


def test_a_late_update_is_counted_late_in_the_next_round(net: Net) -> None:
    coord = net.coordinator()
    scripts = {"d1": lambda r: [update("d1", r, 10 + r)],
               # d2 misses round 1, then sends it with its round-2 update
               "d2": lambda r: [] if r == 1 else [update("d2", 1, 99), update("d2", r, 20 + r)]}
    net.run_devices(_fleet(net, scripts))
    net.wait_hellos(coord, list(scripts))
    engine = _engine(coord, rounds=2, round_timeout_s=1.5)
    r1 = engine.run_round(1)
    assert r1.accepted == ["d1"] and r1.missing == ["d2"]
    r2 = engine.run_round(2)
    assert sorted(r2.accepted) == ["d1", "d2"] and r2.rejected == {"late": 1}
    np.testing.assert_allclose(engine.globals[PROTOTYPES_ARTIFACT]["protos"], _expected_protos([12, 22]),
                               rtol=1e-6)


class Crash(Exception):
    """The coordinator process dies."""


def test_a_resumed_coordinator_redoes_the_round_and_ends_in_the_same_state(net: Net, tmp_path: Path) -> None:
    def answer(device_id: str, k: int) -> Callable[[int], list[bytes]]:
        return lambda r: [update(device_id, r, 10 * k + r)]

    scripts = {d: answer(d, k) for k, d in enumerate(["d1", "d2", "d3"])}
    ref_net = InMemoryNet()
    ref_coord = ref_net.coordinator()
    ref_net.run_devices(_fleet(ref_net, scripts))
    reference = _engine(ref_coord)
    reference.run()

    coord = net.coordinator()
    net.run_devices(_fleet(net, scripts))
    net.wait_hellos(coord, list(scripts))
    first = _engine(coord, state_dir=tmp_path)
    first.run_round(1)
    real_collect = coord.collect

    def dies_in_round_2(rnd: int, expected: Any, deadline: float) -> Iterator[Inbound]:
        for _ in real_collect(rnd, expected, deadline):
            raise Crash  # with the first update of round 2 in hand, unprocessed
        raise Crash

    coord.collect = dies_in_round_2  # type: ignore[method-assign,assignment]
    with pytest.raises(Crash):
        first.run_round(2)
    coord.close()

    again = net.coordinator()  # MQTT: the same persistent session, holding what arrived meanwhile
    resumed = _engine(again, state_dir=tmp_path)
    assert resumed.completed == 1
    reports = resumed.run()
    assert [r.round for r in reports] == [1, 2, 3, 4]
    r2 = reports[1]
    assert sorted(r2.accepted) == ["d1", "d2", "d3"]  # every update of round 2, the lost one resent
    # Copies queued for the dead coordinator and resent ones are refused: in-memory, d2's and d3's in round 2;
    # over MQTT as many as had been sent before the re-announcement, as duplicate in round 2 or, arriving after
    # round 2 closed, as stale later.
    if net.kind == "inmemory":
        assert r2.rejected == {"duplicate": 2}
    refused = {reason for r in reports[1:] for reason in r.rejected}
    assert refused <= {"duplicate", "stale"}
    for name in ("protos", "counts"):
        np.testing.assert_allclose(resumed.globals[PROTOTYPES_ARTIFACT][name],
                                   reference.globals[PROTOTYPES_ARTIFACT][name], rtol=1e-6)
