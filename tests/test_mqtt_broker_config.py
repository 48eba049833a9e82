"""``fedge broker config`` against a real Mosquitto: accounts, ACL, anonymous and unknown clients, TLS,
identity bound to the user name, file ownership when started as root, packet and queue limits."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_helpers import configured_mosquitto

from fedge.broker.config import BrokerOptions, write_broker_config
from fedge.broker.passwords import hash_password, verify_password
from fedge.cli import main
from fedge.edge.service import Bundle
from fedge.errors import TransportError
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient, Received, Will
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.topics import FleetTopics

FLEET = "acl"
DEVICES = ["cam-1", "cam-2"]
T = FleetTopics(FLEET)


def test_password_hashes_match_mosquitto_passwd(tmp_path: Path, mosquitto_passwd: str) -> None:
    line = hash_password("s3cret", salt=b"0123456789ab", iterations=101)
    assert line.startswith("$7$101$MDEyMzQ1Njc4OWFi$") and verify_password("s3cret", line)
    assert not verify_password("wrong", line)
    pw = tmp_path / "pw"
    subprocess.run([mosquitto_passwd, "-c", "-b", str(pw), "alice", "s3cret"], check=True, capture_output=True)
    assert verify_password("s3cret", pw.read_text().strip().split(":", 1)[1])


def _broker(*, tls: bool, **opts: Any) -> Iterator[tuple[MosquittoProcess, Path]]:
    """Mosquitto started exactly as `mosquitto -c` would be by this user (root in CI): with the generated
    config and no --run-as, so as root it drops to its `mosquitto` account."""
    with configured_mosquitto(FLEET, DEVICES, tls=tls, **opts) as running:
        yield running


@pytest.fixture
def secured(mosquitto_bin: str) -> Iterator[tuple[MosquittoProcess, Path]]:
    yield from _broker(tls=False)


def _client(broker: MosquittoProcess, out: Path, user: str, *, got: list[Received] | None = None,
            password: str | None = None, client_id: str | None = None, clean_session: bool = True,
            will: Will | None = None, **kw: object) -> MqttClient:
    secret = out / ("coordinator" if user == "fedge-coordinator" else f"bundles/{user}") / "password"
    pw = password if password is not None else secret.read_text().strip()
    settings = BrokerSettings(host="localhost" if kw.get("tls") else "127.0.0.1", port=broker.port, username=user,
                              password=pw, **kw)  # type: ignore[arg-type]
    c = MqttClient(settings, client_id or f"test-{user}-{time.monotonic_ns()}", clean_session=clean_session,
                   will=will, on_message=None if got is None else got.append)
    return c.start(5)


def _settle(got: list[Received], n: int, timeout: float = 2.0) -> None:
    end = time.time() + timeout
    while len(got) < n and time.time() < end:
        time.sleep(0.02)


def test_a_device_writes_only_its_own_topics(secured: tuple[MosquittoProcess, Path]) -> None:
    broker, out = secured
    seen: list[Received] = []
    coord = _client(broker, out, "fedge-coordinator", got=seen)
    coord.subscribe(f"{T.base}/devices/#")
    spy: list[Received] = []
    a = _client(broker, out, "cam-1", got=spy)
    b = _client(broker, out, "cam-2")
    try:
        a.subscribe(T.update("cam-2"))  # reading another device's updates is not granted either
        a.subscribe(T.round)
        a.subscribe(f"{T.base}/refused/+")  # only its own refusal topic is readable
        time.sleep(0.2)
        a.wait_published([a.publish(T.update("cam-2"), b"forged"), a.publish(T.hello("cam-2"), b"forged"),
                          a.publish(T.round, b"forged round"), a.publish(T.update("cam-1"), b"mine"),
                          a.publish(f"{T.base}/devices/cam-1/extra", b"not a protocol topic")], 5)
        b.wait_published([b.publish(T.update("cam-2"), b"theirs")], 5)
        coord.wait_published([coord.publish(T.round, b"real round", retain=True),
                              coord.publish(T.refused("cam-2"), b"not you", retain=True),
                              coord.publish(T.refused("cam-1"), b"you", retain=True)], 5)
        _settle(seen, 2)
        _settle(spy, 2)
        time.sleep(0.3)
        assert sorted((m.topic, m.payload) for m in seen) == [(T.update("cam-1"), b"mine"),
                                                              (T.update("cam-2"), b"theirs")]
        assert [(m.topic, m.payload) for m in spy] == [(T.round, b"real round"), (T.refused("cam-1"), b"you")]
    finally:
        for c in (a, b, coord):
            c.stop()


def test_unknown_clients_cannot_connect(secured: tuple[MosquittoProcess, Path]) -> None:
    broker, out = secured
    with pytest.raises(TransportError, match="refused"):
        _client(broker, out, "cam-1", password="not-the-password")
    with pytest.raises(TransportError, match="refused"):
        _client(broker, out, "intruder", password="guess")
    with pytest.raises(TransportError, match="refused"):
        MqttClient(BrokerSettings(port=broker.port), "anonymous").start(5)


def test_tls_with_the_generated_ca(mosquitto_bin: str) -> None:
    for broker, out in _broker(tls=True):
        ok = _client(broker, out, "cam-1", tls=True, ca_file=str(out / "tls/ca.crt"))
        assert ok.connected
        ok.stop()
        with pytest.raises(TransportError):  # the system trust store does not know our CA
            _client(broker, out, "cam-1", tls=True)
        # the CA key is not among what the broker reads, and only its owner may read it
        assert not (out / "tls/ca.key").exists() and "ca.key" not in (out / "mosquitto.conf").read_text()
        assert stat.S_IMODE((out / "ca/ca.key").stat().st_mode) == 0o600
        assert stat.S_IMODE((out / "ca").stat().st_mode) == 0o700
        assert stat.S_IMODE((out / "tls/server.key").stat().st_mode) == 0o600


def _wait(cond: object, timeout: float = 5.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_device_password_cannot_take_over_another_client_id(secured: tuple[MosquittoProcess, Path]) -> None:
    """use_username_as_clientid: cam-1's credentials with cam-2's or the coordinator's client id connect as
    cam-1: cam-2 is not kicked (its last-will does not fire) and the coordinator's session keeps its queue."""
    broker, out = secured
    seen: list[Received] = []
    coord = _client(broker, out, "fedge-coordinator", got=seen, client_id="fedge-coordinator", clean_session=False)
    coord.subscribe(T.device_filter("status"))
    coord.subscribe(T.device_filter("update"))
    victim = _client(broker, out, "cam-2", client_id="cam-2", will=Will(T.status("cam-2"), b"offline"))
    victim.wait_published([victim.publish(T.status("cam-2"), b"online", retain=True)], 5)
    assert _wait(lambda: [(m.topic, m.payload) for m in seen] == [(T.status("cam-2"), b"online")])
    coord.stop()  # clean DISCONNECT: the persistent session stays, queueing what arrives for it
    victim.wait_published([victim.publish(T.update("cam-2"), b"queued while the coordinator is away")], 5)
    intruders = []
    try:
        for cid in ("cam-2", "fedge-coordinator"):
            intruders.append(_client(broker, out, "cam-1", client_id=cid))  # connects, as cam-1
            time.sleep(0.5)
            assert victim.connected and victim.connects == 1, cid  # never kicked off
            assert intruders[-1].connected
            intruders[-1].stop()
        back: list[Received] = []
        coord = _client(broker, out, "fedge-coordinator", got=back, client_id="fedge-coordinator",
                        clean_session=False)
        assert _wait(lambda: len(back) >= 1)
        time.sleep(0.3)
        # the queued update survived (a clean-session takeover would have wiped it) and no will fired
        assert [(m.topic, m.payload) for m in back] == [(T.update("cam-2"), b"queued while the coordinator is away")]
    finally:
        for c in (*intruders, victim, coord):
            c.stop()


def test_started_as_root_it_drops_privileges_and_reads_its_files(secured: tuple[MosquittoProcess, Path]) -> None:
    broker, out = secured
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root): checks the files handed to the broker's account")
    account = pwd.getpwnam("mosquitto")
    assert broker.proc is not None
    uids = next(line for line in Path(f"/proc/{broker.proc.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")).split()[1:]
    assert {int(u) for u in uids} == {account.pw_uid}  # it runs as mosquitto, not root
    for name in ("passwd", "acl"):
        st = (out / name).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (account.pw_uid, 0o600), name
    assert (out / "data").stat().st_uid == account.pw_uid
    # one listener, with the listener option after it (before it, Mosquitto would open a default 1883 listener)
    conf = (out / "mosquitto.conf").read_text().splitlines()
    assert [line.split()[0] for line in conf if line.startswith(("listener", "use_username_as_clientid"))] == [
        "listener", "use_username_as_clientid"]
    c = _client(broker, out, "cam-1")  # it read the password file: a device logs in
    assert c.connected
    c.stop()
    broker.stop()  # SIGTERM: it saves its database into data/ as the mosquitto account
    assert (out / "data/mosquitto.db").is_file()


@pytest.fixture
def limited(mosquitto_bin: str) -> Iterator[tuple[MosquittoProcess, Path]]:
    yield from _broker(tls=False, max_message_bytes=4096, chunk_bytes=4096)


def test_packet_and_queue_limits_are_enforced(limited: tuple[MosquittoProcess, Path]) -> None:
    broker, out = limited
    conf = (out / "mosquitto.conf").read_text()
    assert "message_size_limit" not in conf  # deprecated in Mosquitto 2
    packet = int(conf.split("max_packet_size ")[1].split()[0])
    queued = int(conf.split("max_queued_messages ")[1].split()[0])
    assert int(conf.split("max_queued_bytes ")[1].split()[0]) > 0
    assert packet < 200 * 1024 and queued >= 1000
    got: list[Received] = []
    coord = _client(broker, out, "fedge-coordinator", got=got, client_id="fedge-coordinator",
                    clean_session=False)
    coord.subscribe(T.device_filter("update"))
    time.sleep(0.2)
    dev = _client(broker, out, "cam-1")
    dev.publish(T.update("cam-1"), b"x" * (packet + 1))  # one packet over the limit
    assert _wait(lambda: not dev.connected)  # Mosquitto disconnects the sender
    dev.stop()
    time.sleep(0.2)
    assert got == []
    # the coordinator's session, offline, queues at most max_queued_messages (+ in flight)
    coord.stop()
    dev = _client(broker, out, "cam-1")
    sent = queued + 300
    dev.wait_published([dev.publish(T.update("cam-1"), str(i).encode()) for i in range(sent)], 30)
    dev.stop()
    coord = _client(broker, out, "fedge-coordinator", got=got, client_id="fedge-coordinator",
                    clean_session=False)
    _wait(lambda: len(got) >= queued, 10)
    time.sleep(0.5)
    coord.stop()
    assert queued <= len(got) <= queued + 100 < sent
    assert [m.payload for m in got[:10]] == [str(i).encode() for i in range(10)]  # oldest kept, in order


def test_secrets_are_created_with_their_mode_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        files = write_broker_config(FLEET, DEVICES, tmp_path / "b", BrokerOptions(tls=True))
    finally:
        os.umask(old)
    out = files.out
    for secret in ("passwd", "acl", "coordinator/password", "bundles/cam-1/password", "tls/server.key",
                   "ca/ca.key"):
        assert stat.S_IMODE((out / secret).stat().st_mode) == 0o600, secret
    assert stat.S_IMODE(files.config.stat().st_mode) == 0o644
    assert not list(out.rglob("*.tmp"))


def test_cli_keeps_passwords_unless_rotating(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[run]\nmethod = "fedproto"\nrounds = 1\nfleet = "lab"\n\n'
                     '[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\narch = "tier-xs"\n')
    out = tmp_path / "b"
    assert main(["broker", "config", "--fleet", str(fleet), "--out", str(out)]) == 0
    pw = (out / "bundles/rpi4-2gb-1/password").read_text()
    acl = (out / "acl").read_text()
    assert ("user rpi4-2gb-1\ntopic write fedge/lab/devices/rpi4-2gb-1/status\n"
            "topic write fedge/lab/devices/rpi4-2gb-1/hello\ntopic write fedge/lab/devices/rpi4-2gb-1/update\n"
            "topic write fedge/lab/devices/rpi4-2gb-1/health\ntopic read fedge/lab/rounds/#") in acl
    assert (out / "bundles/rpi4-2gb-1/password").stat().st_mode & 0o077 == 0
    assert "allow_anonymous false" in (out / "mosquitto.conf").read_text()
    assert main(["broker", "config", "--fleet", str(fleet), "--out", str(out)]) == 0
    assert (out / "bundles/rpi4-2gb-1/password").read_text() == pw
    assert main(["broker", "config", "--fleet", str(fleet), "--out", str(out), "--rotate"]) == 0
    pw_rotated = (out / "bundles/rpi4-2gb-1/password").read_text().strip()
    assert pw_rotated != pw.strip()
    bundle = Bundle.load(out / "bundles/rpi4-2gb-1")
    assert bundle.device_id == "rpi4-2gb-1" and Path(bundle.fleet_config).is_file()
    assert bundle.broker == "mqtt://localhost:1883" and bundle.password() == pw_rotated


def test_a_ca_key_of_the_old_layout_moves_out_of_what_the_broker_reads(tmp_path: Path) -> None:
    """Broker directories written before the CA key had its own directory kept it in tls/: the next
    `fedge broker config` moves it (one durable rename, fedge.common.atomicfile.rename_atomic), same key."""
    from fedge.broker.config import open_ca
    from fedge.broker.pki import CertificateAuthority, key_pem

    tls = tmp_path / "tls"
    tls.mkdir()
    old = CertificateAuthority.load_or_create(tls / "ca.key", tls / "ca.crt", "acl")
    before = key_pem(old.key)
    ca = open_ca(tls, "acl")
    assert not (tls / "ca.key").exists() and (tmp_path / "ca" / "ca.key").is_file()
    assert key_pem(ca.key) == before and stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
