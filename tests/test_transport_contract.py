"""One transport contract, every coordinator transport: the in-memory twin, MQTT over a real Mosquitto, and
``fedge simulate``'s clocked transports (the devices stepped in virtual time: :mod:`fedge.sim.clocked`, and
:mod:`fedge.sim.clocked_async` for asynchronous versions).

Every test here runs unchanged over each (``net`` is parametrised; the asynchronous clocked transport, which
delivers only the updates of the tasks it hands out, runs the asynchronous tests), with the real
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
  uninterrupted run's;
* the early return (``CoordinatorTransport.collect``): a collect the engine stops reading loses nothing, the next
  one yields the rest; asynchronous versions, which stop reading once their buffer is full, count every update
  once and none is left behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from fedge.common.asyncmode import AsyncSettings
from fedge.common.families import spec_by_name
from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport, InMemoryDeviceTransport
from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo, RoundInfo
from fedge.common.transport import CoordinatorTransport, DeviceTransport, Inbound
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.agent import DeviceAgent, Traffic
from fedge.fleet.availability import Availability
from fedge.fleet.clock import DeviceClock, FleetClock, TrainWork
from fedge.fleet.registry import method_entry
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.settings import TransportSettings
from fedge.profiles.loader import load_profile
from fedge.profiles.speed import speed_model
from fedge.sim.clocked import ClockedCoordinatorTransport
from fedge.sim.clocked_async import AsyncClockedTransport

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


class ClockedNet(InMemoryNet):
    """``fedge simulate``'s in-process transport on the virtual clock: the transport steps the devices itself
    (each always online, a Raspberry Pi 4's speed and link), and times their work."""

    kind = "clocked"

    def __init__(self) -> None:
        super().__init__()
        self.agents: list[ScriptedDevice] = []
        self.clock = FleetClock([])

    def coordinator(self) -> CoordinatorTransport:
        # the scripted devices stand in for DeviceAgents: they have what the clocked transport reads of one
        t = ClockedCoordinatorTransport(self.bus, [], self.clock, final_round=1_000)
        t.agents = cast(list[DeviceAgent], self.agents)  # the devices run_devices adds, made after the transport
        return t

    def run_devices(self, devices: list[ScriptedDevice]) -> None:
        profile = load_profile("rpi4-2gb")
        for d in devices:
            self.agents.append(d)
            self.clock.devices[d.device_id] = DeviceClock(
                d.device_id, len(self.clock.devices), speed_model(profile), profile.network, Availability(),
                TrainWork(spec_by_name("cnn1"), 32, SAMPLES, 1))


class AsyncClockedNet(ClockedNet):
    """Asynchronous mode's clocked transport: a device starts each task it is handed, its update arrives when the
    clock says (the only updates it delivers)."""

    kind = "clocked-async"

    def coordinator(self) -> CoordinatorTransport:
        assert self.agents, "run_devices first: this transport takes its fleet when it is made"
        return AsyncClockedTransport(self.bus, cast(list[DeviceAgent], self.agents), self.clock, eval_every=1_000)


def _make_net(request: pytest.FixtureRequest) -> Net:
    kinds: dict[str, Callable[[], Net]] = {"inmemory": InMemoryNet, "clocked": ClockedNet,
                                           "clocked-async": AsyncClockedNet}
    if request.param in kinds:
        return kinds[request.param]()
    return MqttNet(request.getfixturevalue(request.param))


# The MQTT parameter is the name of the broker fixture, so the test's `mqtt` marker follows (conftest.py) and
# the quick loop runs the in-process transports only; the ids stay "inmemory", "clocked" and "mqtt".
@pytest.fixture(params=["inmemory", "clocked", "mosquitto"], ids=["inmemory", "clocked", "mqtt"])
def net(request: pytest.FixtureRequest) -> Iterator[Net]:
    n = _make_net(request)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(params=["inmemory", "clocked-async", "mosquitto"], ids=["inmemory", "clocked-async", "mqtt"])
def async_net(request: pytest.FixtureRequest) -> Iterator[Net]:
    """The transports an asynchronous fleet runs over (the synchronous clocked one is not among them)."""
    n = _make_net(request)
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
    sent: list[bytes] = field(default_factory=list)  # every training update, in the order sent
    # what the clocked transports read or set on a DeviceAgent: its info, its traffic per round, its timer, the task
    # it last did (asynchronous mode)
    traffic: list[Traffic] = field(default_factory=list)
    timer: Callable[[], float] = time.perf_counter
    task_done: tuple[str, int] | None = None

    @property
    def device(self) -> DeviceInfo:
        return DeviceInfo(self.device_id, "tier-xs", "test", num_samples=SAMPLES, feature_dim=DIM)

    def measure(self, info: RoundInfo) -> dict[str, float]:
        return {}

    def hello(self) -> None:
        hello = Message("hello", self.device_id, 0, FLEET, info={"device": self.device.to_dict()})
        self.transport.send_hello(hello.to_bytes())

    def step(self) -> None:
        raw = self.transport.current_round()
        if raw is None:
            return
        msg = Message.from_bytes(raw)
        rnd = msg.round
        assigned = msg.info["round"].get("assigned")
        if assigned is not None:  # asynchronous mode: each task once, as a DeviceAgent does (its version's number)
            if self.device_id not in assigned:
                return
            rnd = assigned[self.device_id]
        if self.answered and rnd <= self.answered[-1]:
            return
        self.answered.append(rnd)
        if msg.info["round"].get("phase") == "final":
            final = Message("update", self.device_id, rnd, FLEET, info={"metrics": {"acc_global": 0.5}}).to_bytes()
            self.transport.send_update(final)
            self.traffic.append(Traffic(rnd, 0, len(final)))
            return
        updates = self.script(rnd)
        for data in updates:
            self.transport.send_update(data)
        self.sent += updates
        if updates:
            self.traffic.append(Traffic(rnd, 0, sum(len(u) for u in updates)))


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
    # Round 1 ends at its timeout (d2 is silent). In-process the timeout is virtual or unused; over a real broker it
    # is wall time, in which d1's update must arrive: 8 s, not 1.5, so a loaded machine cannot make d1 "missing".
    engine = _engine(coord, rounds=2, round_timeout_s=8.0 if net.kind == "mqtt" else 1.5)
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


# -- the early return -------------------------------------------------------------------------------------------

def test_a_collect_stopped_early_loses_nothing(net: Net) -> None:
    """The engine may stop reading a collect (asynchronous mode does, once its buffer is full): the next collect
    yields what was not read yet, every message once, in the order sent."""
    coord = net.coordinator()
    dev = net.device("d1")
    sent = [update("d1", r, r) for r in (1, 2, 3)]
    for data in sent:
        dev.send_update(data)
    pending = {"d1"}
    reading = coord.collect(1, pending, time.time() + 60)
    first = next(reading)
    del reading  # what `break` does to the engine's loop over it: the iterator is dropped unfinished
    rest = _collect(coord, 1, {"d1"}, n=2)
    assert [first.data] + [i.data for i in rest] == sent


def test_async_versions_stop_collect_early_and_count_every_update_once(async_net: Net) -> None:
    """Three devices, versions of K = 2: each version stops reading once its two updates are in, and the update
    left unread (the third device's, trained from version 1) is counted in the next version with staleness 1 —
    never lost, never counted twice."""
    net = async_net
    def answer(device_id: str, k: int) -> Callable[[int], list[bytes]]:
        return lambda r: [update(device_id, r, 10 * k + r)]

    scripts = {d: answer(d, k) for k, d in enumerate(["d1", "d2", "d3"])}
    net.run_devices(_fleet(net, scripts))  # before the coordinator: the clocked one takes its fleet when made
    coord = net.coordinator()
    net.wait_hellos(coord, list(scripts))
    strat = method_entry("fedproto").build_strategy(None, num_classes=CLASSES, rounds=3)
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=3, round_timeout_s=0.0,
                       asynchronous=AsyncSettings(buffer_size=2, fleet_size=3))
    reports = RoundEngine(strat, coord, cfg).run()
    versions = reports[:-1]
    assert [r.round for r in reports] == [1, 2, 3, 4]
    assert [len(r.accepted) for r in versions] == [2, 2, 2]
    assert all(r.missing == [] for r in reports)
    # (device, version trained from) of every accepted update: each once, and every device's first task counted
    counted = [(d, r.round - r.staleness[d]) for r in versions for d in r.accepted]
    assert len(counted) == len(set(counted)) == 6
    assert {("d1", 1), ("d2", 1), ("d3", 1)} <= set(counted)
    if net.kind != "mqtt":  # in-process the order is fixed: the update version 1 left unread comes first in 2
        (left,) = set(scripts) - set(versions[0].accepted)
        assert versions[1].accepted[0] == left and versions[1].staleness[left] == 1
    assert all(r.rejected == {} for r in versions), [r.rejected for r in versions]  # nothing delivered twice
