"""``fedge broker config`` against a real Mosquitto: accounts, ACL, anonymous and unknown clients, TLS."""

from __future__ import annotations

import getpass
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.broker.config import BrokerOptions, write_broker_config
from fedge.broker.passwords import hash_password, verify_password
from fedge.cli import main
from fedge.edge.service import Bundle
from fedge.errors import TransportError
from fedge.mqtt.broker import MosquittoProcess, free_port
from fedge.mqtt.client import BrokerSettings, MqttClient, Received
from fedge.mqtt.topics import FleetTopics

FLEET = "acl"
DEVICES = ["cam-1", "cam-2"]
T = FleetTopics(FLEET)


def test_password_hashes_match_mosquitto_passwd(tmp_path: Path) -> None:
    line = hash_password("s3cret", salt=b"0123456789ab", iterations=101)
    assert line.startswith("$7$101$MDEyMzQ1Njc4OWFi$") and verify_password("s3cret", line)
    assert not verify_password("wrong", line)
    tool = shutil.which("mosquitto_passwd")
    assert tool is not None, "mosquitto_passwd comes with the mosquitto package: apt-get install mosquitto"
    pw = tmp_path / "pw"
    subprocess.run([tool, "-c", "-b", str(pw), "alice", "s3cret"], check=True, capture_output=True)
    assert verify_password("s3cret", pw.read_text().strip().split(":", 1)[1])


def _broker(tmp: Path, *, tls: bool) -> Iterator[tuple[MosquittoProcess, Path]]:
    port = free_port()
    out = tmp / "broker"
    # mosquitto drops to its own account when started as root; let it read the files it needs
    opts = BrokerOptions(port=port, bind="127.0.0.1", hostname="localhost", tls=tls, run_as=getpass.getuser())
    files = write_broker_config(FLEET, DEVICES, out, opts)
    broker = MosquittoProcess(files.config.read_text(), port=port, workdir=tmp)
    broker.start()
    try:
        yield broker, out
    finally:
        broker.close()


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[MosquittoProcess, Path]]:
    yield from _broker(tmp_path, tls=False)


def _client(broker: MosquittoProcess, out: Path, user: str, *, got: list[Received] | None = None,
            password: str | None = None, **kw: object) -> MqttClient:
    secret = out / ("coordinator" if user == "fedge-coordinator" else f"bundles/{user}") / "password"
    pw = password if password is not None else secret.read_text().strip()
    settings = BrokerSettings(host="localhost" if kw.get("tls") else "127.0.0.1", port=broker.port, username=user,
                              password=pw, **kw)  # type: ignore[arg-type]
    c = MqttClient(settings, f"test-{user}-{time.monotonic_ns()}", on_message=None if got is None else got.append)
    return c.start(5)


def _settle(got: list[Received], n: int, timeout: float = 2.0) -> None:
    end = time.time() + timeout
    while len(got) < n and time.time() < end:
        time.sleep(0.02)


@pytest.mark.mqtt
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
        time.sleep(0.2)
        a.wait_published([a.publish(T.update("cam-2"), b"forged"), a.publish(T.hello("cam-2"), b"forged"),
                          a.publish(T.round, b"forged round"), a.publish(T.update("cam-1"), b"mine")], 5)
        b.wait_published([b.publish(T.update("cam-2"), b"theirs")], 5)
        coord.wait_published([coord.publish(T.round, b"real round", retain=True)], 5)
        _settle(seen, 2)
        _settle(spy, 1)
        time.sleep(0.3)
        assert sorted((m.topic, m.payload) for m in seen) == [(T.update("cam-1"), b"mine"),
                                                              (T.update("cam-2"), b"theirs")]
        assert [(m.topic, m.payload) for m in spy] == [(T.round, b"real round")]
    finally:
        for c in (a, b, coord):
            c.stop()


@pytest.mark.mqtt
def test_unknown_clients_cannot_connect(secured: tuple[MosquittoProcess, Path]) -> None:
    broker, out = secured
    with pytest.raises(TransportError, match="refused"):
        _client(broker, out, "cam-1", password="not-the-password")
    with pytest.raises(TransportError, match="refused"):
        _client(broker, out, "intruder", password="guess")
    with pytest.raises(TransportError, match="refused"):
        MqttClient(BrokerSettings(port=broker.port), "anonymous").start(5)


@pytest.mark.mqtt
def test_tls_with_the_generated_ca(tmp_path: Path) -> None:
    for broker, out in _broker(tmp_path, tls=True):
        ok = _client(broker, out, "cam-1", tls=True, ca_file=str(out / "tls/ca.crt"))
        assert ok.connected
        ok.stop()
        with pytest.raises(TransportError):  # the system trust store does not know our CA
            _client(broker, out, "cam-1", tls=True)


def test_cli_keeps_passwords_unless_rotating(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[run]\nmethod = "fedproto"\nrounds = 1\nfleet = "lab"\n\n'
                     '[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\narch = "tier-xs"\n')
    out = tmp_path / "b"
    assert main(["broker", "config", "--fleet", str(fleet), "--out", str(out)]) == 0
    pw = (out / "bundles/rpi4-2gb-1/password").read_text()
    acl = (out / "acl").read_text()
    assert "user rpi4-2gb-1\ntopic write fedge/lab/devices/rpi4-2gb-1/#\ntopic read fedge/lab/rounds/#" in acl
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
