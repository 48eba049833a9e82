"""``fedge broker config --shards 2 --workers 1``: three real Mosquittos with the generated configs and ACLs.

A device's credential works on its own shard only (on another shard and on the root it has no
account), a relay can forward the hellos of its own shard's devices and its own partials but not
another shard's, a worker reads updates through its MQTT 5 shared subscription and may write only its
own partials, and each device's bundle names its shard's broker. Under ``--mtls`` every account connects with its
certificate of the tree's one CA: a device's on another shard or the root connects but is refused every publish
and reads nothing; ``fedge broker revoke`` on the tree cuts a device at its shard once that broker restarted.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from broker_helpers import wait_until
from observe_helpers import FLEET_TOML as SMALL_FLEET

from fedge.broker.config import BrokerOptions
from fedge.broker.shards import split_devices, write_sharded_config
from fedge.errors import ConfigError, TransportError
from fedge.fleet.config import device_ids, load_fleet
from fedge.mqtt.broker import MosquittoProcess, free_port
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.topics import FleetTopics, shared

FLEET_TOML = Path(__file__).resolve().parents[1] / "examples" / "demo.toml"
CFG = load_fleet(FLEET_TOML)
IDS = [i for i, _ in device_ids(CFG)]
T = FleetTopics(CFG.run.fleet)


def _ports(n: int) -> int:
    """A base port whose next ``n`` ports are free too. Tried below Linux's ephemeral range (32768-60999) first:
    there no outgoing connection takes a port, while a host running thousands of connections (a fleet benchmark)
    can leave no run of n free ports in that range at all."""
    rng = random.Random()
    for base in [rng.randrange(20000, 32000 - n) for _ in range(100)] + [free_port() for _ in range(50)]:
        if base + n < 65536 and all(_free(base + k) for k in range(n + 1)):
            return base
    raise RuntimeError(f"no run of {n + 1} free ports on 127.0.0.1")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextmanager
def _running_tree(opts: BrokerOptions, prefix: str) -> Iterator[tuple[list[MosquittoProcess], Path, int]]:
    """The root broker and two shard brokers (one worker account) written with ``opts`` on a free run of ports,
    started from the generated configs as `mosquitto -c` would be: (root, shard 1, shard 2), the tree, base port."""
    base = _ports(2)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(work, 0o755)
    out = work / "broker"
    files = write_sharded_config(CFG.run.fleet, IDS, out, dataclasses.replace(opts, port=base, bind="127.0.0.1"),
                                 shards=2, workers=1, fleet_config=FLEET_TOML)
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


@pytest.fixture
def sharded(mosquitto_bin: str) -> Iterator[tuple[list[MosquittoProcess], Path, int]]:
    """The root broker and two shard brokers with password accounts."""
    with _running_tree(BrokerOptions(), "fedge-shards-test-") as running:
        yield running


@pytest.fixture
def mtls_sharded(mosquitto_bin: str) -> Iterator[tuple[list[MosquittoProcess], Path, int]]:
    """The root broker and two shard brokers written with ``--mtls``: every account connects with its certificate."""
    with _running_tree(BrokerOptions(mtls=True), "fedge-shards-mtls-") as running:
        yield running


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


def test_secure_rounds_relays_carry_their_shards_stage_messages_and_devices_cannot_pose_as_relays(
        sharded: tuple[list[MosquittoProcess], Path, int]) -> None:
    """Secure aggregation behind relays (fedge.secagg.partial): on the root, relay-1 writes its own devices' stage
    messages and its own masked sums, reads its devices' ``secagg/{id}`` and nothing of another shard's; on the
    shard, a device cannot publish on a relay's ``relays/{account}/secagg`` (where child relays' sums arrive)."""
    (root, s1, _), out, _ = sharded
    mine, theirs = IDS[0], IDS[-1]
    seen: list[Received] = []
    coord = _client(root.port, "fedge-coordinator", out / "coordinator" / "password", got=seen)
    coord.subscribe(f"{T.base}/#")
    down: list[Received] = []
    relay = _client(root.port, "relay-1", out / "relays" / "relay-1" / "password", got=down)
    relay.subscribe(f"{T.base}/secagg/+")
    on_shard: list[Received] = []
    shard_relay = _client(s1.port, "relay-1", out / "relays" / "relay-1" / "password", got=on_shard)
    shard_relay.subscribe(T.relay_secagg_filter)
    shard_relay.subscribe(T.device_filter("secagg"))
    dev = _client(s1.port, mine, out / "bundles" / mine / "password")
    try:
        time.sleep(0.3)
        relay.wait_published([relay.publish(T.secagg(mine), b"forwarded keys"),
                              relay.publish(T.secagg(theirs), b"another shard's keys"),
                              relay.publish(T.relay_secagg("relay-1"), b"my masked sum"),
                              relay.publish(T.relay_secagg("relay-2"), b"posing as relay-2")], 5)
        coord.wait_published([coord.publish(T.secagg_to(mine), b"roster for mine"),
                              coord.publish(T.secagg_to(theirs), b"roster for theirs")], 5)
        dev.wait_published([dev.publish(T.relay_secagg("relay-1"), b"a device posing as a child relay"),
                            dev.publish(T.relay_secagg("relay-2"), b"and as another"),
                            dev.publish(T.secagg(mine), b"its own masked input")], 5)
        _settle(seen, 6)
        _settle(down, 1)
        _settle(on_shard, 1)
        assert sorted((m.topic, m.payload) for m in seen) == sorted([
            (T.secagg(mine), b"forwarded keys"), (T.relay_secagg("relay-1"), b"my masked sum"),
            (T.secagg_to(mine), b"roster for mine"), (T.secagg_to(theirs), b"roster for theirs")])
        assert [(m.topic, m.payload) for m in down] == [(T.secagg_to(mine), b"roster for mine")]
        assert [(m.topic, m.payload) for m in on_shard] == [(T.secagg(mine), b"its own masked input")]
    finally:
        for c in (coord, relay, shard_relay, dev):
            c.stop()


def test_a_signing_tls_sharded_fleet_shares_the_roots_key_and_ca(mosquitto_bin: str) -> None:
    base = _ports(2)
    work = Path(tempfile.mkdtemp(prefix="fedge-shards-sign-"))
    os.chmod(work, 0o755)
    out = work / "broker"
    try:
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
    from fedge.coordinator.config import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.scaleout.aggregator import PartialAggregator
    from fedge.scaleout.relay import Relay

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


def test_a_shards_tree_from_the_fleet_config_keeps_every_credential_in_its_shard(mosquitto_bin: str) -> None:
    """``[[shards]]`` with a parent (root <- a <- c, root <- b), written by ``fedge broker config`` and run as four
    Mosquittos: a device's password works on its own shard only, so it can publish into no other shard; the
    child relay may forward its own devices' hellos and its partial onto its parent shard, nothing of the parent's
    own devices; the parent relay forwards the whole subtree's hellos to the root."""
    from test_fleet_shards import HEAD, TREE

    base = _ports(3)
    tmp_path = Path(tempfile.mkdtemp(prefix="fedge-shards-tree-"))  # searchable by Mosquitto's account
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "fleet.toml"
    path.write_text(HEAD + TREE.format(pa=base + 1, pb=base + 2, pc=base + 3))
    cfg = load_fleet(path)
    t = FleetTopics(cfg.run.fleet)
    out = tmp_path / "broker"
    files = write_sharded_config(cfg.run.fleet, [i for i, _ in device_ids(cfg)], out,
                                 BrokerOptions(port=base, bind="127.0.0.1", hostname="127.0.0.1"),
                                 shards=cfg.shard_layout, fleet_config=path)
    brokers = [MosquittoProcess(f.config.read_text(), port=port, workdir=f.out)
               for f, port in zip([files.root, *files.shards], [base, base + 1, base + 2, base + 3], strict=True)]
    root, a, b, c = brokers
    clients: list[MqttClient] = []
    try:
        for br in brokers:
            br.start()
        zero, rpi4, x86 = "rpi-zero-2w-1", "rpi4-4gb-1", "x86-gateway-1"
        for dev, home in ((zero, c), (rpi4, a), (x86, b)):
            pw = out / "bundles" / dev / "password"
            _client(home.port, dev, pw).stop()
            for other in (br for br in brokers if br is not home):
                with pytest.raises(TransportError, match=r"(?i)not authorized|bad user name"):
                    _client(other.port, dev, pw)
        seen_a: list[Received] = []
        relay_a_on_a = _client(a.port, "relay-a", out / "relays" / "relay-a" / "password", got=seen_a)
        relay_a_on_a.subscribe(f"{t.base}/#")
        seen_root: list[Received] = []
        coord = _client(root.port, "fedge-coordinator", out / "coordinator" / "password", got=seen_root)
        coord.subscribe(f"{t.base}/#")
        relay_c = _client(a.port, "relay-c", out / "relays" / "relay-c" / "password")
        relay_a = _client(root.port, "relay-a", out / "relays" / "relay-a" / "password")
        clients += [relay_a_on_a, coord, relay_c, relay_a]
        time.sleep(0.3)
        relay_c.wait_published([relay_c.publish(t.hello(zero), b"c's hello"),
                                relay_c.publish(t.hello(rpi4), b"a's own device, posed by c"),
                                relay_c.publish(t.partial("relay-c"), b"c's partial"),
                                relay_c.publish(t.partial("relay-a"), b"posing as relay-a")], 5)
        relay_a.wait_published([relay_a.publish(t.hello(zero), b"subtree hello"),
                                relay_a.publish(t.hello(x86), b"b's device, posed by a"),
                                relay_a.publish(t.partial("relay-a"), b"a's partial")], 5)
        _settle(seen_a, 2)
        _settle(seen_root, 2)
        assert sorted((m.topic, m.payload) for m in seen_a) == sorted([
            (t.hello(zero), b"c's hello"), (t.partial("relay-c"), b"c's partial")])
        assert sorted((m.topic, m.payload) for m in seen_root) == sorted([
            (t.hello(zero), b"subtree hello"), (t.partial("relay-a"), b"a's partial")])
        # relay-c has no account on the root: a child relay speaks only to its parent shard
        with pytest.raises(TransportError, match=r"(?i)not authorized|bad user name"):
            _client(root.port, "relay-c", out / "relays" / "relay-c" / "password")
    finally:
        for cl in clients:
            cl.stop()
        for br in brokers:
            br.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


# observe_helpers' small FedProto fleet with four rpi4-2gb instead of two, over two shards (b under a)
E2E_SHARDS = """
[[shards]]
name = "a"
broker = "127.0.0.1:{pa}"
devices = ["rpi4-2gb-1", "rpi4-2gb-2"]

[[shards]]
name = "b"
broker = "127.0.0.1:{pb}"
devices = ["rpi4-2gb-3", "rpi4-2gb-4", "x86-gateway-*"]
parent = "a"
"""


@pytest.mark.slow
def test_a_fleet_sharded_by_its_config_runs_through_the_commands_and_equals_the_flat_run(mosquitto_bin: str) -> None:
    """The whole path of ``[[shards]]``: ``fedge broker config`` writes the tree (root <- a <- b), three
    Mosquittos run the written configs, ``fedge relay --name relay-a`` / ``relay-b`` find their shard in the
    fleet config, five FedProto devices connect with their bundles' shard address and password, and ``fedge
    coordinator run`` on the root (which lets relay-a report a's and b's devices only) counts every device in
    every round through relay-a's compact partials: the uninterrupted in-process run's global state."""
    import json
    import subprocess
    import sys

    from fedge.common.rounds import PROTOTYPES_ARTIFACT
    from fedge.common.tensorcodec import decode
    from fedge.coordinator.engine import EngineConfig, RoundEngine
    from fedge.mqtt.connection import parse_broker_url
    from fedge.sim.inprocess import run_inprocess
    from fedge.sim.over_mqtt import start_fleet
    from fedge.sim.simulate import build_fleet

    base = _ports(2)
    work = Path(tempfile.mkdtemp(prefix="fedge-shards-e2e-"))
    os.chmod(work, 0o755)
    path = work / "fleet.toml"
    path.write_text(SMALL_FLEET.format(rounds=2, fleet="e2e").replace("count = 2", "count = 4")
                    + E2E_SHARDS.format(pa=base + 1, pb=base + 2))
    cfg = load_fleet(path)
    devices, strat = build_fleet(cfg)
    coord, _, _ = run_inprocess(cfg, devices)
    reference = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method))
    reference.run()
    out = work / "broker"
    files = write_sharded_config(cfg.run.fleet, [i for i, _ in device_ids(cfg)], out,
                                 BrokerOptions(port=base, bind="127.0.0.1", hostname="127.0.0.1"),
                                 shards=cfg.shard_layout, fleet_config=path)
    brokers = [MosquittoProcess(f.config.read_text(), port=port, workdir=f.out)
               for f, port in zip([files.root, *files.shards], [base, base + 1, base + 2], strict=True)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    stop = None
    try:
        for br in brokers:
            br.start()
        for name, parent in (("relay-a", base), ("relay-b", base + 1)):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fedge", "relay", "--config", str(path), "--name", name, "--username", name,
                 "--password-file", str(out / "relays" / name / "password"), "--broker",
                 f"mqtt://127.0.0.1:{parent}", "--state-dir", str(work / name)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))

        def bundle(dev: str) -> BrokerSettings:
            b = tomllib.loads((out / "bundles" / dev / "bundle.toml").read_text())
            return parse_broker_url(b["broker"], username=b["username"],
                                    password=(out / "bundles" / dev / "password").read_text().strip())

        devices, _ = build_fleet(cfg)
        _, _, stop = start_fleet(cfg, devices, bundle, coordinator=False)
        state = work / "state"
        run = subprocess.run(
            [sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(path), "--broker",
             f"mqtt://127.0.0.1:{base}", "--username", "fedge-coordinator", "--password-file",
             str(out / "coordinator" / "password"), "--state-dir", str(state), "--wait-for-fleet", "60",
             "--round-timeout", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=300)
        assert run.returncode == 0, run.stdout.decode()[-3000:]
    finally:
        if stop is not None:
            stop()
        for p in procs:
            p.terminate()
        logs = [p.communicate(timeout=30)[0].decode() for p in procs]
        for br in brokers:
            br.stop()
    try:
        assert all("relay-" in log and "shard mqtt://127.0.0.1:" in log for log in logs), logs
        reports = [json.loads(line) for line in (state / "reports.jsonl").read_text().splitlines()]
        ids = sorted(i for i, _ in device_ids(cfg))
        assert [r["round"] for r in reports] == [1, 2, 3]
        for r in reports:  # every device once per round, through relay-a (relay-b's inside its partials)
            assert sorted(r["accepted"]) == ids and r["missing"] == [] and r["partials"] == {"relay-a": 5}, r
            assert r["aggregated"]["relay-a"]["devices"] == 5 and r["bytes_up"] == {}
        # relay-a kept each device's entry locally (compact partials leave it there)
        kept = [json.loads(line) for line in (work / "relay-a" / "rounds.jsonl").read_text().splitlines()]
        assert kept and {"rpi4-2gb-1", "rpi4-2gb-2"} <= set(kept[0]["devices"])
        flat = decode((state / "globals.safetensors").read_bytes()).tensors
        got = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(PROTOTYPES_ARTIFACT + "/")}
        want = reference.globals[PROTOTYPES_ARTIFACT]
        np.testing.assert_array_equal(got["counts"], want["counts"])
        np.testing.assert_allclose(got["protos"], want["protos"], rtol=1e-5, atol=1e-6)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cert(out: Path, who: str) -> BrokerSettings:
    """``who``'s certificate of an ``--mtls`` tree (a device: its bundle; a relay or worker: its directory; the
    coordinator), for any broker of the tree (the port is set by :func:`_mtls_client`)."""
    d = (out / "bundles" / who if who in IDS else out / "relays" / who if who.startswith("relay-")
         else out / "workers" / who if who.startswith("worker-") else out / "coordinator")
    stem = "device" if who in IDS else "client"
    return BrokerSettings(host="localhost", tls=True, ca_file=str(out / "tls" / "ca.crt"),
                          cert_file=str(d / f"{stem}.crt"), key_file=str(d / f"{stem}.key"))


def _mtls_client(broker: MosquittoProcess, out: Path, who: str, *, got: list[Received] | None = None,
                 wait: float = 5) -> MqttClient:
    settings = dataclasses.replace(_cert(out, who), port=broker.port)
    return MqttClient(settings, f"t-{who}-{time.monotonic_ns()}", on_message=None if got is None else got.append
                      ).start(wait)


def _mqtt5_publish(broker: MosquittoProcess, settings: BrokerSettings, topic: str) -> tuple[str, int]:
    """Connect with ``settings``' certificate over MQTT 5 and publish ``topic`` at QoS 1: (the CONNACK's reason,
    the PUBACK's reason code). MQTT 5 is what makes Mosquitto say why it drops a publish (0x87 not authorized);
    an MQTT 3.1.1 client — a fedge device — gets a plain PUBACK for a publish the ACL dropped."""
    import threading

    import paho.mqtt.client as paho

    seen: dict[str, str | int] = {}
    done = threading.Event()
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"probe-{time.monotonic_ns()}",
                    protocol=paho.MQTTv5)
    c.tls_set(ca_certs=settings.ca_file, certfile=settings.cert_file, keyfile=settings.key_file)

    def connack(client: paho.Client, userdata: object, flags: object, rc: paho.ReasonCode, props: object) -> None:
        seen["connack"] = str(rc)
        done.set()

    def puback(client: paho.Client, userdata: object, mid: int, rc: paho.ReasonCode, props: object) -> None:
        seen["puback"] = rc.value
        done.set()

    c.on_connect = connack
    c.on_publish = puback
    c.connect("localhost", broker.port)
    c.loop_start()
    try:
        assert done.wait(5), "no CONNACK"
        done.clear()
        c.publish(topic, b"a hello on a foreign broker", qos=1, retain=True)
        assert done.wait(5), "no PUBACK"
    finally:
        c.disconnect()
        c.loop_stop()
    return str(seen["connack"]), int(seen["puback"])


def test_under_mtls_a_device_certificate_publishes_on_its_shard_only(
        mtls_sharded: tuple[list[MosquittoProcess], Path, int]) -> None:
    """A device of shard 1 connects to shard 1 with its certificate (the fedge device transport) and its hello
    reaches the root through relay-1, which connects to both brokers with its one certificate. The same certificate
    on shard 2 or on the root connects — Mosquitto checks the certificate against the tree's CA, not a list of
    accounts — but the ACL grants it nothing there: its publish is refused (MQTT 5: 0x87 not authorized) and
    reaches no subscriber, and it reads nothing (a retained round another device of shard 2 receives)."""
    from gate_helpers import device
    from scaleout_helpers import FAST

    from fedge.common.messages import Message
    from fedge.coordinator.config import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.device_transport import MqttDeviceTransport
    from fedge.scaleout.aggregator import PartialAggregator
    from fedge.scaleout.relay import Relay

    (root, s1, s2), out, _ = mtls_sharded
    mine, neighbour_2 = IDS[0], IDS[-1]  # shard 1's first device, a device of shard 2
    relay = Relay(dataclasses.replace(_cert(out, "relay-1"), port=s1.port),
                  dataclasses.replace(_cert(out, "relay-1"), port=root.port), CFG.run.fleet,
                  PartialAggregator(FedProtoStrategy(num_classes=10, rounds=1),
                                    EngineConfig(fleet=CFG.run.fleet, method="fedproto"), "relay-1")).start()
    at_root: list[Received] = []
    on_s2: list[Received] = []
    coord = _mtls_client(root, out, "fedge-coordinator", got=at_root)
    coord.subscribe(T.device_filter("hello"))
    relay2 = _mtls_client(s2, out, "relay-2", got=on_s2)  # shard 2's coordinator: reads every device topic there
    relay2.subscribe(f"{T.base}/devices/#")
    dev = MqttDeviceTransport(dataclasses.replace(_cert(out, mine), port=s1.port), CFG.run.fleet, mine, FAST).start()
    try:
        hello = Message("hello", mine, 0, CFG.run.fleet, info={"device": device(0, device_id=mine).to_dict()}
                        ).to_bytes()
        dev.send_hello(hello)
        assert wait_until(lambda: any(m.topic == T.hello(mine) for m in at_root), 10), at_root
        assert next(m for m in at_root if m.topic == T.hello(mine)).payload == hello  # relayed unchanged
        # the same certificate on shard 2 and on the root: connected, every publish refused by the ACL
        for other in (s2, root):
            connack, puback = _mqtt5_publish(other, _cert(out, mine), T.hello(mine))
            assert (connack, puback) == ("Success", 0x87), other.port
        # shard 2 reads it nowhere: its coordinator (relay-2) saw no hello, and nothing was retained
        relay2.wait_published([relay2.publish(T.round, b"shard 2's round", retain=True)], 5)
        got_foreign: list[Received] = []
        got_local: list[Received] = []
        foreign = _mtls_client(s2, out, mine, got=got_foreign)
        local = _mtls_client(s2, out, neighbour_2, got=got_local)
        try:
            for c in (foreign, local):
                c.subscribe(f"{T.base}/#")
            assert wait_until(lambda: got_local, 5)
            time.sleep(0.5)  # what else would arrive
            assert [(m.topic, m.payload) for m in got_local] == [(T.round, b"shard 2's round")]
            assert got_foreign == [] and foreign.connected
        finally:
            foreign.stop()
            local.stop()
        assert not any(m.topic == T.hello(mine) for m in on_s2), on_s2
        assert not any(m.topic == T.hello(mine) and m.payload != hello for m in at_root)
    finally:
        dev.close()
        relay.stop()
        for c in (coord, relay2):
            c.stop()


def test_under_mtls_revoking_a_device_of_a_tree_cuts_it_at_its_shard_once_restarted(
        mtls_sharded: tuple[list[MosquittoProcess], Path, int], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``fedge broker revoke`` on the tree's root: the CLI names the device's shard broker to restart and every
    broker to reload; once shard 1 restarted, the revoked certificate (a copy a thief kept) is refused in the TLS
    handshake while another device of shard 1 still connects; the root, only reloaded (SIGHUP), refuses it too."""
    import signal

    from fedge.cli import main

    (root, s1, _), out, _ = mtls_sharded
    victim, neighbour = IDS[0], IDS[1]  # both on shard 1
    stolen = tmp_path / "stolen"
    shutil.copytree(out / "bundles" / victim, stolen)
    online = _mtls_client(s1, out, victim)  # connected before the revocation
    assert main(["broker", "revoke", victim, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    shard1 = out / "shards" / "shard-1" / "mosquitto.conf"
    assert f"restart `mosquitto -c {shard1}` to cut it now" in said
    assert f"kill -HUP the pid of each: `mosquitto -c {out / 'mosquitto.conf'}`, `mosquitto -c {shard1}`, " in said
    stolen_settings = BrokerSettings(host="localhost", tls=True, ca_file=str(stolen / "ca.crt"),
                                     cert_file=str(stolen / "device.crt"), key_file=str(stolen / "device.key"))
    s1.restart()  # as the command says: it reads the new CRL and drops the connection the device had
    with pytest.raises(TransportError, match="certificate revoked"):
        MqttClient(dataclasses.replace(stolen_settings, port=s1.port), "t-stolen").start(4)
    assert wait_until(lambda: not online.connected or online.connects > 1, 5)
    time.sleep(3.5)  # its reconnection back-off had time to try
    assert online.connects == 1 and "revoked" in str(online.last_error)
    online.stop()
    _mtls_client(s1, out, neighbour).stop()  # the other device of the shard is unaffected
    assert root.proc is not None
    os.kill(root.proc.pid, signal.SIGHUP)  # the root reloads its copy of the CRL
    time.sleep(1.0)
    with pytest.raises(TransportError, match="certificate revoked"):
        MqttClient(dataclasses.replace(stolen_settings, port=root.port), "t-stolen-root").start(4)
