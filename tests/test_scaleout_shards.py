"""``fedge broker config --shards 2 --workers 1``: three real Mosquittos with the generated configs and ACLs.

A device's credential works on its own shard only (on another shard and on the root it has no
account), a relay can forward the hellos of its own shard's devices and its own partials but not
another shard's, a worker reads updates through its MQTT 5 shared subscription and may write only its
own partials, and each device's bundle names its shard's broker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.broker.config import BrokerOptions
from fedge.broker.shards import split_devices, write_sharded_config
from fedge.errors import ConfigError, TransportError
from fedge.fleet.config import device_ids, load_fleet
from fedge.mqtt.broker import MosquittoProcess, free_port
from fedge.mqtt.client import BrokerSettings, MqttClient, Received
from fedge.mqtt.topics import FleetTopics, shared

FLEET_TOML = Path(__file__).resolve().parents[1] / "examples" / "demo.toml"
CFG = load_fleet(FLEET_TOML)
IDS = [i for i, _ in device_ids(CFG)]
T = FleetTopics(CFG.run.fleet)


def _ports(n: int) -> int:
    for _ in range(50):
        base = free_port()
        if base + n < 65536 and all(_free(base + k) for k in range(1, n + 1)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def sharded(mosquitto_bin: str) -> Iterator[tuple[list[MosquittoProcess], Path, int]]:
    """The root broker and two shard brokers, started from the generated configs (as `mosquitto -c` would be)."""
    base = _ports(2)
    work = Path(tempfile.mkdtemp(prefix="fedge-shards-test-"))
    os.chmod(work, 0o755)
    out = work / "broker"
    files = write_sharded_config(CFG.run.fleet, IDS, out, BrokerOptions(port=base, bind="127.0.0.1"), shards=2,
                                 workers=1, fleet_config=FLEET_TOML)
    brokers = [MosquittoProcess(f.config.read_text(), port=base + k, workdir=f.out)
               for k, f in enumerate([files.root, *files.shards])]
    try:
        for b in brokers:
            b.start()
        yield brokers, out, base
    finally:
        for b in brokers:
            b.stop()
        shutil.rmtree(work, ignore_errors=True)


def _client(port: int, user: str, secret: Path, *, got: list[Received] | None = None,
            mqtt5: bool = False) -> MqttClient:
    settings = BrokerSettings(port=port, username=user, password=secret.read_text().strip())
    return MqttClient(settings, f"t-{user}-{time.monotonic_ns()}", mqtt5=mqtt5,
                      on_message=None if got is None else got.append).start(5)


def _settle(got: list[Received], n: int, timeout: float = 2.0) -> None:
    end = time.time() + timeout
    while len(got) < n and time.time() < end:
        time.sleep(0.02)
    time.sleep(0.3)  # and nothing more arrives


def test_devices_are_split_in_fleet_order_and_bad_counts_are_refused() -> None:
    assert split_devices(["a", "b", "c", "d", "e"], 2) == [["a", "b", "c"], ["d", "e"]]
    with pytest.raises(ConfigError, match="more than the fleet's 2 devices"):
        split_devices(["a", "b"], 3)


def test_a_credential_works_on_its_own_shard_only(sharded: tuple[list[MosquittoProcess], Path, int]) -> None:
    (root, s1, s2), out, base = sharded
    first, last = IDS[0], IDS[-1]  # shard 1 and shard 2
    pw = out / "bundles" / first / "password"
    _client(s1.port, first, pw).stop()  # its own shard: fine
    for other in (s2, root):
        with pytest.raises(TransportError, match=r"(?i)not authorized|bad user name"):
            _client(other.port, first, pw)
    # every bundle names its shard's broker
    assert tomllib.loads((out / "bundles" / first / "bundle.toml").read_text())["broker"].endswith(f":{base + 1}")
    assert tomllib.loads((out / "bundles" / last / "bundle.toml").read_text())["broker"].endswith(f":{base + 2}")


def test_relays_forward_only_their_shard_and_workers_write_only_their_partials(
        sharded: tuple[list[MosquittoProcess], Path, int]) -> None:
    (root, _, _), out, _ = sharded
    seen: list[Received] = []
    coord = _client(root.port, "fedge-coordinator", out / "coordinator" / "password", got=seen)
    coord.subscribe(f"{T.base}/#")
    shares: list[Received] = []
    worker = _client(root.port, "worker-1", out / "workers" / "worker-1" / "password", got=shares, mqtt5=True)
    worker.subscribe(shared("fedge-workers", T.device_filter("update")))
    relay = _client(root.port, "relay-1", out / "relays" / "relay-1" / "password")
    mine, theirs = IDS[0], IDS[-1]
    try:
        time.sleep(0.3)
        relay.wait_published([relay.publish(T.hello(mine), b"forwarded hello"),
                              relay.publish(T.hello(theirs), b"another shard's hello"),
                              relay.publish(T.update(mine), b"an update on the root"),
                              relay.publish(T.partial("relay-1"), b"my partial"),
                              relay.publish(T.partial("relay-2"), b"posing as relay-2"),
                              relay.publish(T.round, b"forged round")], 5)
        worker.wait_published([worker.publish(T.partial("worker-1"), b"worker partial"),
                               worker.publish(T.partial("relay-1"), b"posing as a relay")], 5)
        coord.wait_published([coord.publish(T.update(mine), b"an update the worker shares")], 5)
        _settle(seen, 4)
        _settle(shares, 1)
        assert sorted((m.topic, m.payload) for m in seen) == sorted([
            (T.hello(mine), b"forwarded hello"), (T.partial("relay-1"), b"my partial"),
            (T.partial("worker-1"), b"worker partial"), (T.update(mine), b"an update the worker shares")])
        assert [(m.topic, m.payload) for m in shares] == [(T.update(mine), b"an update the worker shares")]
    finally:
        for c in (coord, worker, relay):
            c.stop()


def test_a_signing_tls_sharded_fleet_shares_the_roots_key_and_ca_and_mtls_is_refused(mosquitto_bin: str) -> None:
    base = _ports(2)
    work = Path(tempfile.mkdtemp(prefix="fedge-shards-sign-"))
    os.chmod(work, 0o755)
    out = work / "broker"
    try:
        with pytest.raises(ConfigError, match="--mtls cannot be combined with --shards or --workers"):
            write_sharded_config(CFG.run.fleet, IDS, out, BrokerOptions(mtls=True), shards=2, fleet_config=FLEET_TOML)
        files = write_sharded_config(CFG.run.fleet, IDS, out, BrokerOptions(port=base, bind="127.0.0.1", sign=True,
                                                                            tls=True), shards=2, workers=1,
                                     fleet_config=FLEET_TOML)
        # one signing key, the root coordinator's: every bundle verifies with its public half, no shard has a key
        assert files.root.signing_key == out / "coordinator" / "signing.key"
        assert all(s.signing_key is None for s in files.shards) and not list((out / "shards").rglob("signing.key"))
        pub = (out / "coordinator" / "fleet.pub").read_bytes()
        for dev in IDS:
            assert (out / "bundles" / dev / "fleet.pub").read_bytes() == pub
            assert tomllib.loads((out / "bundles" / dev / "bundle.toml").read_text())["fleet_key"] == "fleet.pub"
        # one CA for the tree: a relay verifies the root and its shard with its one ca.crt
        ca = out / "relays" / "relay-1" / "ca.crt"
        assert all((s.out / "tls" / "ca.crt").read_bytes() == ca.read_bytes() for s in files.shards)
        brokers = [MosquittoProcess(f.config.read_text(), port=base + k, workdir=f.out)
                   for k, f in enumerate([files.root, files.shards[0]])]
        try:
            for b in brokers:
                b.start()
            secret = (out / "relays" / "relay-1" / "password").read_text().strip()
            for b in brokers:
                MqttClient(BrokerSettings(port=b.port, username="relay-1", password=secret, tls=True, ca_file=str(ca)),
                           f"t-relay-{b.port}").start(5).stop()
        finally:
            for b in brokers:
                b.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_fedge_deploys_updates_cross_a_relay_under_the_generated_acls(
        sharded: tuple[list[MosquittoProcess], Path, int]) -> None:
    """The root's deploy account publishes the key chain, a model package and an order (retained, as ``fedge
    deploy`` does); relay-1 forwards them byte for byte to shard 1, where the device reads them, and the
    device's OTA status back to the root, where the deploy account reads it; another shard's order does not
    cross relay-1."""
    from fedge.coordinator.aggregator import PartialAggregator
    from fedge.coordinator.config import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.relay import Relay

    (root, s1, _), out, _ = sharded
    mine, theirs = IDS[0], IDS[-1]
    secret = (out / "relays" / "relay-1" / "password").read_text().strip()
    relay = Relay(BrokerSettings(port=s1.port, username="relay-1", password=secret),
                  BrokerSettings(port=root.port, username="relay-1", password=secret), CFG.run.fleet,
                  PartialAggregator(FedProtoStrategy(num_classes=10, rounds=1),
                                    EngineConfig(fleet=CFG.run.fleet, method="fedproto"), "relay-1")).start()
    at_root: list[Received] = []
    on_shard: list[Received] = []
    deploy = _client(root.port, "fedge-deploy", out / "deploy" / "password", got=at_root)
    deploy.subscribe(T.ota_status_filter())
    dev = _client(s1.port, mine, out / "bundles" / mine / "password", got=on_shard)
    try:
        dev.subscribe(f"{T.base}/ota/#")
        dev.subscribe(T.fleet_keys)  # the fleet key's rotations, which fedge deploy publishes before its orders
        deploy.wait_published([deploy.publish(T.fleet_keys, b"key chain", retain=True),
                               deploy.publish(T.ota_model(7), b"signed package", retain=True),
                               deploy.publish(T.ota_order(mine), b"signed order", retain=True),
                               deploy.publish(T.ota_order(theirs), b"another shard's order", retain=True)], 5)
        _settle(on_shard, 3)
        assert sorted((m.topic, m.payload) for m in on_shard) == sorted([
            (T.fleet_keys, b"key chain"), (T.ota_model(7), b"signed package"), (T.ota_order(mine), b"signed order")])
        dev.wait_published([dev.publish(T.ota_status(mine), b'{"device": "x"}', retain=True)], 5)
        _settle(at_root, 1)
        assert [(m.topic, m.payload) for m in at_root] == [(T.ota_status(mine), b'{"device": "x"}')]
    finally:
        for c in (deploy, dev):
            c.stop()
        relay.stop()
