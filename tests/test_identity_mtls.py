"""Mutual TLS over a real Mosquitto: `fedge broker config --mtls`, `fedge broker revoke` / `rotate`, the device
and coordinator connecting with their certificates, `fedge flash` carrying the key (0600) and refusing a revoked
or expired certificate, and Mosquitto's CRL reload (measured: SIGHUP re-reads crlfile for new connections)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import socket
import ssl
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_helpers import mtls_mosquitto, wait_until

from fedge.broker.config import BrokerOptions, write_broker_config
from fedge.broker.pki import CertificateAuthority, cert_pem, key_pem, utcnow
from fedge.cli import main
from fedge.edge.service import Bundle
from fedge.errors import ConfigError, TransportError
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient, Received, Will
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.topics import FleetTopics

FLEET = "idf"
DEVICES = ["cam-1", "cam-2"]
T = FleetTopics(FLEET)


@pytest.fixture
def mtls(mosquitto_bin: str) -> Iterator[tuple[MosquittoProcess, Path]]:
    """Mosquitto with the config `fedge broker config --mtls` writes, on a free loopback port."""
    with mtls_mosquitto(FLEET, DEVICES) as running:
        yield running


def _files(out: Path, user: str) -> tuple[Path, Path]:
    d = out / ("coordinator" if user == "fedge-coordinator" else f"bundles/{user}")
    stem = "client" if user == "fedge-coordinator" else "device"
    return d / f"{stem}.crt", d / f"{stem}.key"


def _client(broker: MosquittoProcess, out: Path, user: str | None, *, cert: tuple[Path, Path] | None = None,
            got: list[Received] | None = None, client_id: str | None = None, wait: float = 5, will: Will | None = None,
            **kw: object) -> MqttClient:
    crt, key = cert or (_files(out, user) if user else (None, None))
    settings = BrokerSettings(host="localhost", port=broker.port, tls=True, ca_file=str(out / "tls/ca.crt"),
                              cert_file=None if crt is None else str(crt), key_file=None if key is None else str(key),
                              **kw)  # type: ignore[arg-type]
    c = MqttClient(settings, client_id or f"test-{user}-{time.monotonic_ns()}", will=will,
                   on_message=None if got is None else got.append)
    return c.start(wait)


def test_config_writes_certificates_not_passwords(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        files = write_broker_config(FLEET, DEVICES, tmp_path / "b", BrokerOptions(mtls=True))
    finally:
        os.umask(old)
    out = files.out
    conf = files.config.read_text()
    assert "require_certificate true" in conf and "use_identity_as_username true" in conf
    assert f"crlfile {out / 'tls/crl.pem'}" in conf and "password_file" not in conf
    assert not (out / "passwd").exists() and not (out / "bundles/cam-1/password").exists()
    for secret in ("bundles/cam-1/device.key", "coordinator/client.key", "deploy/client.key", "coordinator/signing.key",
                   "ca/ca.key", "tls/server.key", "ca/index.json"):
        assert stat.S_IMODE((out / secret).stat().st_mode) == 0o600, secret
    bundle = Bundle.load(out / "bundles/cam-1") if (out / "bundles/cam-1/bundle.toml").exists() else None
    assert bundle is None  # no fleet config given: no bundle.toml
    # a second run keeps every certificate (devices keep working); --rotate replaces them
    before = (out / "bundles/cam-1/device.crt").read_bytes()
    write_broker_config(FLEET, DEVICES, out, BrokerOptions(mtls=True))
    assert (out / "bundles/cam-1/device.crt").read_bytes() == before
    write_broker_config(FLEET, DEVICES, out, BrokerOptions(mtls=True, rotate=True))
    assert (out / "bundles/cam-1/device.crt").read_bytes() != before
    assert "BEGIN X509 CRL" in (out / "tls/crl.pem").read_text()


def test_devices_connect_with_their_certificates_and_the_acl_keys_on_the_cn(
        mtls: tuple[MosquittoProcess, Path]) -> None:
    """A certificate of one device cannot speak for another: the broker takes the CN as the user name, the ACL
    grants cam-1 only its own topics, and cam-1's certificate with cam-2's client id does not kick cam-2 off."""
    broker, out = mtls
    seen: list[Received] = []
    coord = _client(broker, out, "fedge-coordinator", got=seen)
    coord.subscribe(f"{T.base}/devices/#")
    victim = _client(broker, out, "cam-2", client_id="cam-2", will=Will(T.status("cam-2"), b"offline"))
    a = _client(broker, out, "cam-1", client_id="cam-2")  # cam-1's certificate, cam-2's client id
    try:
        time.sleep(0.3)
        a.wait_published([a.publish(T.update("cam-2"), b"forged"), a.publish(T.hello("cam-2"), b"forged"),
                          a.publish(T.round, b"forged round"), a.publish(T.update("cam-1"), b"mine")], 5)
        victim.wait_published([victim.publish(T.update("cam-2"), b"theirs")], 5)
        assert wait_until(lambda: len(seen) >= 2)
        time.sleep(0.3)
        assert sorted((m.topic, m.payload) for m in seen) == [(T.update("cam-1"), b"mine"),
                                                              (T.update("cam-2"), b"theirs")]
        assert victim.connected and victim.connects == 1  # never kicked off: a's client id became "cam-1"
    finally:
        for c in (a, victim, coord):
            c.stop()


def test_a_password_alone_does_not_connect_under_mtls(mtls: tuple[MosquittoProcess, Path]) -> None:
    broker, out = mtls
    with pytest.raises(TransportError, match="certificate required") as exc:
        _client(broker, out, None, wait=4, username="cam-1", password="anything")
    assert "TLS handshake failed" in str(exc.value.hint)
    with pytest.raises(TransportError):  # nor without TLS at all
        MqttClient(BrokerSettings(host="127.0.0.1", port=broker.port, username="cam-1", password="x"), "p").start(3)


def test_a_revoked_device_cannot_connect(mtls: tuple[MosquittoProcess, Path], tmp_path: Path) -> None:
    broker, out = mtls
    kept = tmp_path / "stolen"  # what a thief copied off the card before the revocation
    shutil.copytree(out / "bundles/cam-2", kept)
    stolen = (kept / "device.crt", kept / "device.key")
    assert main(["broker", "revoke", "cam-2", "--out", str(out)]) == 0
    assert not (out / "bundles/cam-2/device.key").exists()  # a revoked identity cannot be flashed again
    # Before the broker reloads, its CRL is the old one: the certificate still connects. (One connection at a
    # time: a second one with the same CN, hence client id, would take the first one's place.)
    online = _client(broker, out, "cam-2", cert=stolen, client_id="cam-2")
    assert broker.proc is not None
    os.kill(broker.proc.pid, signal.SIGHUP)  # Mosquitto 2.0.11 re-reads crlfile on SIGHUP ...
    time.sleep(1.0)
    with pytest.raises(TransportError, match="certificate revoked"):
        _client(broker, out, "cam-2", cert=stolen, wait=4)
    assert online.connected  # ... but a connection it already had stays up until it drops,
    broker.restart()  # so a restart cuts it, and it cannot come back
    time.sleep(0.5)
    assert wait_until(lambda: not online.connected or online.connects == 1)
    time.sleep(3.5)  # its back-off (1-2 s, then 2-4 s) had time to try again
    assert online.connects == 1 and "revoked" in str(online.last_error)
    online.stop()
    ok = _client(broker, out, "cam-1")  # the other device is unaffected
    ok.stop()
    # revoking again is an error that changes nothing
    crl = (out / "tls/crl.pem").read_bytes()
    assert main(["broker", "revoke", "cam-2", "--out", str(out)]) == 2
    assert (out / "tls/crl.pem").read_bytes() == crl


def test_rotate_issues_a_new_certificate_and_revokes_the_old(mtls: tuple[MosquittoProcess, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    broker, out = mtls
    shutil.copytree(out / "bundles/cam-1", tmp_path / "old")
    assert main(["broker", "rotate", "cam-1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "revoked certificate" in printed and "issued certificate" in printed and "kill -HUP" in printed
    assert broker.proc is not None
    os.kill(broker.proc.pid, signal.SIGHUP)
    time.sleep(1.0)
    with pytest.raises(TransportError, match="certificate revoked"):
        _client(broker, out, "cam-1", cert=(tmp_path / "old/device.crt", tmp_path / "old/device.key"), wait=4)
    fresh = _client(broker, out, "cam-1")
    assert fresh.connected
    fresh.stop()


def test_an_expired_certificate_gets_a_clear_error_and_the_broker_refuses_it(
        mtls: tuple[MosquittoProcess, Path], tmp_path: Path) -> None:
    broker, out = mtls
    ca = CertificateAuthority.load_or_create(out / "ca/ca.key", out / "tls/ca.crt", FLEET)
    key, cert = ca.issue_client("cam-1", days=1, now=utcnow() - dt.timedelta(days=3))
    crt_path, key_path = tmp_path / "old.crt", tmp_path / "old.key"
    crt_path.write_bytes(cert_pem(cert))
    key_path.write_bytes(key_pem(key))
    key_path.chmod(0o600)
    with pytest.raises(ConfigError, match=r"old.crt \(cam-1\) expired on .* UTC: the broker refuses it") as exc:
        _client(broker, out, None, cert=(crt_path, key_path))
    assert "fedge broker rotate" in str(exc.value.hint)
    # Mosquitto itself refuses it too (a client that does not check first): the TLS alert says why.
    ctx = ssl.create_default_context(cafile=str(out / "tls/ca.crt"))
    ctx.load_cert_chain(str(crt_path), str(key_path))
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls, \
            pytest.raises(ssl.SSLError, match="certificate expired"):
        tls.recv(1)  # TLS 1.3: the server's verdict (an alert) arrives after the client's side of the handshake
    # a key that is not the certificate's
    other = tmp_path / "other.key"
    other.write_bytes(key_pem(ca.issue_client("cam-1")[0]))
    with pytest.raises(ConfigError, match="is not the key of certificate"):
        _client(broker, out, None, cert=(out / "bundles/cam-1/device.crt", other))


def test_bad_revoke_and_rotate_input_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b"
    write_broker_config(FLEET, DEVICES, out, BrokerOptions(mtls=True))
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["broker", "revoke", "cam-9", "--out", str(out)]) == 2
    assert "has no device 'cam-9'" in capsys.readouterr().err
    assert main(["broker", "rotate", "cam-1", "--out", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot


def test_password_fleets_revoke_and_rotate_their_passwd_lines(tmp_path: Path) -> None:
    out = tmp_path / "b"
    write_broker_config(FLEET, DEVICES, out, BrokerOptions(iterations=10))
    old = (out / "bundles/cam-1/password").read_text()
    assert main(["broker", "rotate", "cam-1", "--out", str(out)]) == 0
    assert (out / "bundles/cam-1/password").read_text() != old
    assert main(["broker", "revoke", "cam-2", "--out", str(out)]) == 0
    users = [line.split(":")[0] for line in (out / "passwd").read_text().splitlines()]
    assert sorted(users) == ["cam-1", "fedge-coordinator", "fedge-deploy"]
    assert stat.S_IMODE((out / "passwd").stat().st_mode) == 0o600


def _mtls_fleet(tmp: Path) -> tuple[Path, Path]:
    from own_data_helpers import own_data_fleet

    from fedge.fleet.config import device_ids, load_fleet

    fleet = own_data_fleet(tmp / "fleet.toml")
    cfg = load_fleet(fleet)
    broker = tmp / "broker"
    write_broker_config(cfg.run.fleet, [i for i, _ in device_ids(cfg)], broker,
                        BrokerOptions(bind="127.0.0.1", hostname="127.0.0.1", mtls=True), fleet_config=fleet)
    return fleet, broker


def test_flash_carries_the_device_key_0600_and_refuses_revoked_or_expired_certificates(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fedge.flash.flash import flash_dir
    from fedge.flash.payload import prepare

    fleet, broker = _mtls_fleet(tmp_path)
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "config.txt").write_text("arm_64bit=1\n")
    flash_dir(boot, prepare("rpi4-2gb-1", fleet, broker))
    meta = json.loads((boot / "fedge/payload.json").read_text())
    modes = {rel: e["mode"] for rel, e in meta["files"].items()}
    assert modes["bundle/device.key"] == "0600" and modes["bundle/device.crt"] == "0644"
    assert stat.S_IMODE((boot / "fedge/bundle/device.key").stat().st_mode) == 0o600
    assert "bundle/password" not in modes and modes["bundle/fleet.pub"] == "0644"
    bundle = Bundle.load(boot / "fedge/bundle")
    assert bundle.cert_file and bundle.key_file and bundle.fleet_key and bundle.password_file is None
    # revoked: its key is gone from the broker directory, and flashing says what to do
    flashed = {p: p.read_bytes() for p in boot.rglob("*") if p.is_file()}
    assert main(["broker", "revoke", "rpi4-2gb-1", "--out", str(broker)]) == 0
    capsys.readouterr()
    args = ["flash", "rpi4-2gb-1", "--fleet", str(fleet), "--broker-dir", str(broker), "--to", str(boot)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "has no certificate and key for rpi4-2gb-1" in err and "fedge broker rotate rpi4-2gb-1" in err
    assert {p: p.read_bytes() for p in boot.rglob("*") if p.is_file()} == flashed  # nothing changed
    # a certificate that expired (copied back by hand) is refused as well
    ca = CertificateAuthority.load_or_create(broker / "ca/ca.key", broker / "tls/ca.crt", "own")
    key, cert = ca.issue_client("rpi4-2gb-1", days=1, now=utcnow() - dt.timedelta(days=5))
    (broker / "bundles/rpi4-2gb-1/device.crt").write_bytes(cert_pem(cert))
    (broker / "bundles/rpi4-2gb-1/device.key").write_bytes(key_pem(key))
    assert main(args) == 2
    assert "cannot connect: it expired on" in capsys.readouterr().err
    # rotated, it flashes again
    assert main(["broker", "rotate", "rpi4-2gb-1", "--out", str(broker)]) == 0
    assert main([*args, "--dry-run"]) == 0
