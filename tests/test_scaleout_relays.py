"""Hierarchical aggregation over several real Mosquitto brokers: relays, shards, faults.

* A fleet split over two shard brokers, each with a relay to the root broker — and the same fleet
  as a chain (a relay of a relay: root ← shard 1 ← shard 2) — gives the same global state as the
  flat fleet on one broker, every device counted once per round through its relay's partial.
* A relay process killed with SIGKILL mid-round (after forwarding part of its shard) and restarted
  loses no accepted update and counts none twice: it asks its devices to resend (a retained resend
  request; the descriptor stays the coordinator's), the ones it had forwarded are refused as
  duplicates, and the round completes with every device.
* Signed state (docs/protocol.md §11) through relays: the coordinator signs, the relays forward the
  descriptor, global state and refusals byte for byte, and every device of the 2-shard tree verifies
  them with the fleet key and refuses nothing; a descriptor re-encoded under a fresh id (what relays
  did before) is refused. A relay that lost the sums it had received and starts again gets the updates
  again through its resend request, the signed descriptor untouched.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gate_helpers import FLEET, device, hello, honest_update
from scaleout_helpers import FAST, StatsDevice, engine_config, root_engine, start_devices, stop_devices, strategy

from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.signing import Signer
from fedge.common.transport import Inbound
from fedge.coordinator.engine import RoundEngine
from fedge.coordinator.report import RoundReport
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.topics import FleetTopics
from fedge.scaleout.aggregator import PartialAggregator
from fedge.scaleout.relay import Relay

N = 12
ALL = sorted(f"d{i}" for i in range(N))


def shard_of(d: DeviceInfo) -> int:
    return 0 if int(d.device_id[1:]) < N // 2 else 1


@pytest.fixture
def brokers(mosquitto_bin: str) -> Iterator[list[MosquittoProcess]]:
    """Three Mosquittos on loopback: the root and two shards (distinct ports), persistence on."""
    out = [MosquittoProcess(persistence=True).start() for _ in range(3)]
    yield out
    for b in out:
        b.close()


def flat_reference() -> dict[str, np.ndarray]:
    """The same fleet on one broker of its own (a broker the sharded run shares would keep its retained
    hellos and last statuses)."""
    with MosquittoProcess() as flat:
        engine, transport = root_engine(flat.settings(), N, client_id="flat")
        devs = start_devices(lambda d: flat.settings(), range(N))
        try:
            engine.run()
        finally:
            stop_devices(devs)
            transport.close()
    return engine.globals["prototypes"]


@pytest.mark.parametrize("topology", ["two-shards", "chain"])
def test_a_sharded_fleet_with_relays_equals_the_flat_fleet(brokers: list[MosquittoProcess], topology: str) -> None:
    root, s1, s2 = brokers
    want = flat_reference()
    # two-shards: root <- relay r1 <- s1, root <- relay r2 <- s2; chain: root <- r1 <- s1 <- r2 <- s2
    parent2 = root if topology == "two-shards" else s1
    relays = [Relay(s1.settings(), root.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "r1"),
                    settings=FAST, hold_s=5.0).start(),
              Relay(s2.settings(), parent2.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "r2"),
                    settings=FAST, hold_s=5.0).start()]
    engine, transport = root_engine(root.settings(), N, client_id=f"root-{topology}")
    shards = [s1, s2]
    devs = start_devices(lambda d: shards[shard_of(d)].settings(), range(N))
    try:
        reports = engine.run()
    finally:
        stop_devices(devs)
        for r in relays:
            r.stop()
        transport.close()
    got = engine.globals["prototypes"]
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_max_ulp(got["protos"], want["protos"], maxulp=1)
    for rep in reports:
        assert sorted(rep.accepted) == ALL and rep.missing == [] and rep.rejected == {}, rep
        # the root hears only relay r1 in the chain; both relays in two shards
        assert rep.partials == ({"r1": 6, "r2": 6} if topology == "two-shards" else {"r1": N}), rep.partials
        # compact partials: the devices as ids, their reports summarised per relay (in the chain r2's devices
        # reach the root inside r1's summary), no per-device entry at the root
        assert {r: a["devices"] for r, a in rep.aggregated.items()} == rep.partials and rep.bytes_up == {}
        if rep.phase != "final":
            assert rep.total_bytes()[0] == N * len(honest_update(device(0), rep.round)), rep.aggregated
    # the root broker carried partials, not updates: one partial per relay per round (and per child relay's)
    assert relays[0].partials_sent == len(reports)


def test_a_relay_killed_mid_round_loses_no_accepted_update(brokers: list[MosquittoProcess], tmp_path: Path) -> None:
    root, s1, s2 = brokers
    want = flat_reference()
    state = tmp_path / "r1"

    def relay_process() -> subprocess.Popen[bytes]:
        log = open(tmp_path / "r1.log", "ab")  # noqa: SIM115 - the child writes it until it dies
        script = str(Path(__file__).with_name("scaleout_helpers.py"))
        return subprocess.Popen([sys.executable, script, "r1", str(s1.port), str(root.port), str(state), "0.5"],
                                stdout=log, stderr=log)

    proc = relay_process()
    other = Relay(s2.settings(), root.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "r2"),
                  settings=FAST, hold_s=5.0).start()
    engine, transport = root_engine(root.settings(), N, client_id="root-kill")
    shards = [s1, s2]
    # d5 answers round 1 after 4 s: by then r1 has forwarded d0-d4 (after 0.5 s without news) and is killed
    devs = start_devices(lambda d: shards[shard_of(d)].settings(), range(N), delay={"d5": {1: 4.0}})
    killed_after: list[str] = []

    def kill_once(_: BrokerSettings | None = None) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (state / "relay-state.json").is_file():
            time.sleep(0.05)
        killed_after.append((state / "relay-state.json").read_text())
        proc.kill()  # SIGKILL: no clean disconnect, its last-will fires
        proc.wait(5)

    killer = threading.Thread(target=kill_once, daemon=True)
    killer.start()
    restarted: list[subprocess.Popen[bytes]] = []
    try:
        import contextlib

        def restart_later() -> None:
            killer.join(30)
            time.sleep(0.5)
            restarted.append(relay_process())

        t = threading.Thread(target=restart_later, daemon=True)
        t.start()
        reports = engine.run()
        t.join(5)
    finally:
        stop_devices(devs)
        other.stop()
        transport.close()
        for p in [proc, *restarted]:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(5)
    assert killed_after and '"round": 1' in killed_after[0] and '"d0"' in killed_after[0], killed_after
    assert '"d5"' not in killed_after[0]  # killed mid-round: d5 had not answered yet
    first = reports[0]
    assert sorted(first.accepted) == ALL and first.missing == [], first
    # d0-d4 resent their cached update to the restarted relay, which had forwarded them: refused there
    assert first.rejected_by_device.keys() <= {f"d{i}" for i in range(5)}
    assert all(c == {"duplicate": 1} for c in first.rejected_by_device.values()), first.rejected_by_device
    assert all(sorted(r.accepted) == ALL for r in reports)
    got = engine.globals["prototypes"]
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_max_ulp(got["protos"], want["protos"], maxulp=1)


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not condition():
        time.sleep(0.05)


def run_during(fault: Callable[[], None], engine: RoundEngine, transport: MqttCoordinatorTransport,
               devs: list[StatsDevice], relays: Callable[[], list[Relay]]) -> list[RoundReport]:
    """The engine's run while ``fault`` runs in a thread (a restart mid-round); then the devices, the relays
    (``relays()``, asked afterwards: a restarted one included) and the transport are stopped."""
    t = threading.Thread(target=fault, daemon=True)
    t.start()
    try:
        reports = engine.run()
        t.join(5)
    finally:
        stop_devices(devs)
        for r in relays():
            r.stop()
        transport.close()
    return reports


def relay(shard: MosquittoProcess, parent: MosquittoProcess, name: str, hold_s: float = 5.0, **kw: object) -> Relay:
    return Relay(shard.settings(), parent.settings(), FLEET, PartialAggregator(strategy(), engine_config(), name),
                 settings=FAST, hold_s=hold_s, **kw).start()  # type: ignore[arg-type]


def test_signed_state_crosses_relays_unchanged_and_every_device_verifies_it(brokers: list[MosquittoProcess]) -> None:
    root, s1, s2 = brokers
    want = flat_reference()
    key = Ed25519PrivateKey.generate()
    relays = [relay(s1, root, "r1"), relay(s2, root, "r2")]
    engine, transport = root_engine(root.settings(), N, client_id="root-signed", signer=Signer(key))
    shards = [s1, s2]
    devs = start_devices(lambda d: shards[shard_of(d)].settings(), range(N), fleet_key=key.public_key())
    forged = MqttClient(s1.settings(), "forger")
    try:
        reports = engine.run()
        # What a relay did before: the descriptor re-encoded under a fresh message id, the signature dropped.
        forged.start(10)
        fresh = Message("round", "coordinator", 9, FLEET, info={"round": {"round": 9, "phase": "train"}, "run": "x"})
        forged.publish(FleetTopics(FLEET).round, fresh.to_bytes(), retain=True)
        deadline = time.monotonic() + 10
        shard1 = [d for d in devs if shard_of(d.info) == 0]
        while time.monotonic() < deadline and not all(d.transport.stats.rejected for d in shard1):
            time.sleep(0.05)
    finally:
        forged.stop()
        stop_devices(devs)
        for r in relays:
            r.stop()
        transport.close()
    # every device verified every descriptor, global state and refusal it used: it answered every round
    assert all(d.answered == [1, 2, 3] for d in devs), [(d.info.device_id, d.answered) for d in devs]
    assert all(d.transport.stats.rejected == {"unsigned": 1} for d in shard1), [d.transport.stats.rejected
                                                                                 for d in shard1]
    assert all(d.transport.stats.rejected == {} for d in devs if d not in shard1)
    for rep in reports:
        assert sorted(rep.accepted) == ALL and rep.missing == [] and rep.rejected == {}, rep
        assert rep.partials == {"r1": 6, "r2": 6}, rep.partials
    got = engine.globals["prototypes"]
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_max_ulp(got["protos"], want["protos"], maxulp=1)


def test_a_restarted_relay_gets_the_updates_again_and_the_signed_descriptor_stays(
        brokers: list[MosquittoProcess], tmp_path: Path) -> None:
    root, s1, s2 = brokers
    key = Ed25519PrivateKey.generate()
    # r1 sends nothing before all of its shard answered (d5 answers round 1 after 6 s): stopped once it holds
    # d0-d4's updates, their sums are gone with it
    first = relay(s1, root, "r1", hold_s=60.0, state_dir=tmp_path / "r1")
    other = relay(s2, root, "r2")
    engine, transport = root_engine(root.settings(), N, client_id="root-resend", signer=Signer(key))
    shards = [s1, s2]
    devs = start_devices(lambda d: shards[shard_of(d)].settings(), range(N), delay={"d5": {1: 6.0}},
                         fleet_key=key.public_key())
    held = {f"d{i}" for i in range(5)}
    restarted: list[Relay] = []

    def restart() -> None:
        wait_for(lambda: held <= first.aggregator.answered)
        first.stop()
        restarted.append(relay(s1, root, "r1", hold_s=60.0, state_dir=tmp_path / "r1"))

    reports = run_during(restart, engine, transport, devs, lambda: [first, other, *restarted])
    assert restarted and first.partials_sent == 0 and held <= first.aggregator.answered
    # d0-d4 sent their round-1 update twice (asked by the restarted relay), d5 once (after the request)
    sent = {d.info.device_id: d.transport.stats.messages_out for d in devs}
    assert all(sent[d] == sent["d5"] + 1 for d in held), sent
    assert all(d.transport.stats.rejected == {} for d in devs), [d.transport.stats.rejected for d in devs]
    for rep in reports:
        assert sorted(rep.accepted) == ALL and rep.missing == [] and rep.rejected == {}, rep
        assert rep.partials == {"r1": 6, "r2": 6}, rep.partials


RECONNECT = {"reconnect_min_s": 0.2, "reconnect_max_s": 1.0}  # as tests/test_mqtt_restarts.py's broker restarts


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_shard_broker_restarted_mid_round_loses_no_accepted_update(brokers: list[MosquittoProcess],
                                                                     how: str) -> None:
    """Shard 1's Mosquitto is restarted (SIGTERM, or SIGKILL: it loses what it held in memory) in round 1 while
    its relay holds d0-d4's updates and d5 has not answered yet: the relay reconnects, publishes the state and a
    resend request again, the devices resend (refused at the relay as duplicates), d5's update arrives after
    the restart, and every round counts all 12 devices once: the flat fleet's aggregate."""
    root, s1, s2 = brokers
    want = flat_reference()
    relays = [Relay(s1.settings(**RECONNECT), root.settings(), FLEET,
                    PartialAggregator(strategy(), engine_config(), "r1"), settings=FAST, hold_s=30.0).start(),
              relay(s2, root, "r2")]
    engine, transport = root_engine(root.settings(), N, client_id=f"root-shard-{how}")
    shards = [s1, s2]
    devs = start_devices(lambda d: shards[shard_of(d)].settings(**RECONNECT), range(N), delay={"d5": {1: 4.0}})
    held = {f"d{i}" for i in range(5)}
    sent_before: list[int] = []

    def restart() -> None:
        wait_for(lambda: held <= relays[0].aggregator.answered)
        sent_before.append(relays[0].partials_sent)
        s1.terminate() if how == "SIGTERM" else s1.kill()
        s1.start()

    reports = run_during(restart, engine, transport, devs, lambda: relays)
    assert sent_before == [0]  # restarted mid-round: nothing of shard 1 had left the relay yet
    assert relays[0].down.connects >= 2  # the relay really lost its shard's broker
    for rep in reports:  # no lost update, none counted twice; refused copies are only resent duplicates
        assert sorted(rep.accepted) == ALL and rep.missing == [], rep
        assert set(rep.rejected) <= {"duplicate"}, rep.rejected
    first = reports[0]
    assert first.rejected_by_device.keys() <= held, first.rejected_by_device
    got = engine.globals["prototypes"]
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_max_ulp(got["protos"], want["protos"], maxulp=1)


def test_a_relay_keeps_what_a_round_still_owes_in_step_with_every_message(brokers: list[MosquittoProcess]) -> None:
    """``Relay.owed()`` (what its completeness check reads after every message) is ``expected()`` less the answered
    devices at each step — kept up to date per accepted update, hello and status instead of walking the shard
    (quadratic in its size), and an ``offline`` counts once believable with time alone."""
    root, shard = brokers[0], brokers[1]
    t = FleetTopics(FLEET)
    relay = Relay(shard.settings(), root.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "relay-1"),
                  settings=FAST)
    # its connections without its own thread: this test plays that thread (the only caller of owed())
    relay.down.start(FAST.connect_timeout_s)
    relay.up.start(FAST.connect_timeout_s)
    try:
        devs = [device(i) for i in range(4)]

        def status(d: DeviceInfo, word: bytes) -> None:
            relay._on_child(Received(t.status(d.device_id), word, True, time.time()))

        def check(want: set[str]) -> None:
            assert relay.owed() == want == relay.expected() - relay.aggregator.answered

        for d in devs:
            relay._handle("hello", Inbound(hello(d), d.device_id))
            status(d, b"online")
        relay.aggregator.begin(1, final=False, descriptor="x" * 32)
        relay._owed_stale = True  # as _on_round marks it
        check({d.device_id for d in devs})
        relay._handle("update", Inbound(honest_update(devs[0], 1), "d0"))
        check({"d1", "d2", "d3"})
        relay._handle("update", Inbound(honest_update(devs[1], 1), "d2"))  # spoofed: refused, nothing answered
        check({"d1", "d2", "d3"})
        status(devs[3], b"offline")  # believable only once FAST.offline_confirm_s old
        check({"d1", "d2", "d3"})
        time.sleep(FAST.offline_confirm_s + 0.1)
        check({"d1", "d2"})
        late = device(4)  # connects during the round: its hello and status recheck it alone
        relay._handle("hello", Inbound(hello(late), "d4"))
        status(late, b"online")
        check({"d1", "d2", "d4"})
        status(devs[3], b"online")  # back
        check({"d1", "d2", "d3", "d4"})
        for d in [*devs[1:], late]:
            relay._handle("update", Inbound(honest_update(d, 1), d.device_id))
        check(set())
    finally:
        relay.down.stop()
        relay.up.stop()
