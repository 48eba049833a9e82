"""Signed state: the signed frame (fedge.common.signing), devices refusing unsigned, tampered, replayed and
misplaced round descriptors and global state over a real Mosquitto with mutual TLS, a whole fleet over mTLS
with signing reaching the in-process aggregates, and signed model manifests verified by `fedge infer`."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from broker_helpers import mtls_mosquitto, mtls_settings, wait_until
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.cli import main
from fedge.common.messages import Message
from fedge.common.signing import (
    ReplayGuard,
    SignatureError,
    Signer,
    Verifier,
    generate_key,
    load_private_key,
    parse_signed,
)
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.settings import TransportSettings
from fedge.mqtt.topics import FleetTopics

FLEET = "sig"


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Signer, Verifier]:
    generate_key(tmp_path / "signing.key", tmp_path / "fleet.pub")
    return Signer.from_file(tmp_path / "signing.key"), Verifier.from_file(tmp_path / "fleet.pub")


def _round(rnd: int, run: str = "r1", globals_: dict[str, int] | None = None) -> bytes:
    return Message("round", "coordinator", rnd, FLEET, info={"round": {"round": rnd, "phase": "train"}, "run": run,
                                                              "globals": globals_ or {}}).to_bytes()


# -- the signed frame, without a broker ------------------------------------------------------------------------

def test_signed_frames_open_only_untampered_fresh_and_in_place(keys: tuple[Signer, Verifier]) -> None:
    signer, verifier = keys
    topic = FleetTopics(FLEET).round
    body = _round(1)
    sealed = signer.seal(topic, body)
    assert sealed[:8] == b"FDGSIGN1" and sealed.endswith(body)
    header, raw, sig, _ = parse_signed(sealed)
    assert len(sig) == 64
    assert json.loads(raw) == {"alg": "ed25519", "key": signer.key_id, "seq": header.seq,
                               "sha256": header.sha256, "topic": topic, "v": 1}
    assert verifier.open(topic, sealed) == body
    assert verifier.open(topic, sealed) == body  # the same message again (a retained redelivery) is fine

    def refused(data: bytes, reason: str, where: str = topic) -> str:
        with pytest.raises(SignatureError) as exc:
            verifier.open(where, data)
        assert exc.value.reason == reason, exc.value.message
        return exc.value.message

    assert "not signed" in refused(body, "unsigned")
    tampered = bytearray(sealed)
    tampered[-20] ^= 1  # one bit of the body
    assert "tampered" in refused(bytes(tampered), "signature")
    at = sealed.index(b'"seq":') + 6
    forged = sealed[:at] + (b"2" if sealed[at:at + 1] != b"2" else b"3") + sealed[at + 1:]  # a newer seq, say
    refused(forged, "signature")
    assert "not valid JSON" in refused(sealed[:13] + b"#" + sealed[14:], "malformed")
    other = Signer(Ed25519PrivateKey.generate())
    assert "not the fleet key" in refused(other.seal(topic, body), "key")
    assert "arrived on" in refused(signer.seal(FleetTopics(FLEET).global_("a"), body), "topic")
    r2 = _round(2)
    newer = signer.seal(topic, r2)
    assert verifier.open(topic, newer) == r2
    assert "older than the newest accepted" in refused(sealed, "replay")  # round 1 replayed after round 2
    # malformed frames: always a SignatureError naming the problem, never another exception
    head = b"FDGSIGN1"
    for bad in (head, head + struct.pack("<I", 10 ** 6), head + struct.pack("<I", 3) + b"{x}" + b"s" * 64,
                head + struct.pack("<I", 2) + b"[]" + b"s" * 64):
        refused(bad, "malformed")


def test_the_replay_guard_survives_a_restart(tmp_path: Path, keys: tuple[Signer, Verifier]) -> None:
    signer, _ = keys
    topic = FleetTopics(FLEET).round
    old, new = signer.seal(topic, _round(1)), signer.seal(topic, _round(2))
    state = tmp_path / "seen.json"
    first = Verifier(load_private_key(tmp_path / "signing.key").public_key(), guard=ReplayGuard(state))
    first.open(topic, new)
    assert os.stat(state).st_mode & 0o077 == 0
    again = Verifier.from_file(tmp_path / "fleet.pub", state=state)  # the device restarted
    with pytest.raises(SignatureError, match="replay"):
        again.open(topic, old)
    assert again.open(topic, new)  # the current retained message is still fine


def test_bad_key_files_get_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.errors import ConfigError

    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ConfigError, match="is not a PEM private key"):
        Signer.from_file(tmp_path / "junk.pem")
    with pytest.raises(ConfigError, match="does not exist"):
        Verifier.from_file(tmp_path / "missing.pub")
    from fedge.broker.pki import key_pem, new_key

    (tmp_path / "ec.key").write_bytes(key_pem(new_key()))
    with pytest.raises(ConfigError, match="not an Ed25519 key"):
        Signer.from_file(tmp_path / "ec.key")


# -- devices refuse what the fleet key did not sign, over Mosquitto with mutual TLS -------------------------------

@pytest.fixture
def mtls_broker(mosquitto_bin: str) -> Iterator[tuple[MosquittoProcess, Path]]:
    with mtls_mosquitto(FLEET, ["cam-1", "cam-2", "rpi4-2gb-1", "rpi4-2gb-2", "x86-gateway-1",
                                "x86-gateway-2"]) as running:
        yield running


def test_a_device_refuses_unsigned_tampered_replayed_and_misplaced_state(
        mtls_broker: tuple[MosquittoProcess, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The attacker holds the coordinator's broker credentials (its certificate) but not the fleet's signing key:
    whatever it publishes on the round and global topics is refused by the device, counted and logged, and the
    device keeps the coordinator's genuine state."""
    broker, out = mtls_broker
    t = FleetTopics(FLEET)
    signer = Signer.from_file(out / "coordinator/signing.key")
    wire = TransportSettings(chunk_bytes=4096, global_timeout_s=5)
    coord = MqttCoordinatorTransport(mtls_settings(broker, out, "coordinator"), FLEET, wire, signer=signer).start()
    dev = MqttDeviceTransport(mtls_settings(broker, out, "cam-1"), FLEET, "cam-1", wire,
                              verifier=Verifier.from_file(out / "bundles/cam-1/fleet.pub")).start()
    try:
        big = Message("global", "coordinator", 1, FLEET, tensors={"w": np.arange(5000, dtype=np.float32)},
                      info={"artifact": "protos"}).to_bytes()
        coord.publish_global("protos", big)  # chunked: 20 kB over 4 KiB chunks, signed whole
        r1, r2, r3 = (_round(r, globals_={"protos": 1}) for r in (1, 2, 3))
        seen: list[bytes] = []  # a spy with another device's certificate: the signed descriptors as published
        spy = MqttClient(mtls_settings(broker, out, "cam-2"), "spy",
                         on_message=lambda m: seen.append(m.payload)).start(5)
        spy.subscribe(t.round)
        coord.announce_round(r1)
        assert wait_until(lambda: dev.current_round() == r1)
        assert dev.fetch_global("protos") == big
        coord.announce_round(r2)
        assert wait_until(lambda: dev.current_round() == r2 and len(seen) == 2)
        old_round_1, signed_round_2 = seen
        spy.stop()
        coord.announce_round(r3)
        assert wait_until(lambda: dev.current_round() == r3)
        coord.close()
        time.sleep(0.2)
        attacker = MqttCoordinatorTransport(mtls_settings(broker, out, "coordinator"), FLEET, wire).start()  # no key
        caplog.clear()
        forged = _round(4, run="evil")
        tampered = bytearray(signer.seal(t.round, _round(4)))
        tampered[-10] ^= 1
        attacker.client.wait_published([
            attacker.client.publish(t.round, forged, retain=True),                      # unsigned
            attacker.client.publish(t.round, bytes(tampered), retain=True),             # tampered
            attacker.client.publish(t.round, old_round_1, retain=True),                 # replayed (older)
            attacker.client.publish(t.round, signed_round_2, retain=True),              # replayed (older)
            attacker.client.publish(t.global_("protos"), signer.seal(t.round, _round(5)), retain=True),  # misplaced
        ], 5)
        assert wait_until(lambda: sum(dev.stats.rejected.values()) == 5), dev.stats.rejected
        assert dev.stats.rejected == {"unsigned": 1, "signature": 1, "replay": 2, "topic": 1}
        assert dev.current_round() == r3  # unchanged
        assert dev.fetch_global("protos") == big
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "refused a message on fedge/sig/rounds/current: unsigned: the message is not signed" in logged
        assert "does not match its signed sha256 (tampered)" in logged and "older than the newest accepted" in logged
        attacker.close()
    finally:
        dev.close()
        coord.close()


@pytest.mark.slow  # 23 s on the shared 2-core machine (an in-process reference run and the MQTT run)
def test_a_fleet_over_mutual_tls_with_signed_state_equals_the_in_process_run(
        mtls_broker: tuple[MosquittoProcess, Path], tmp_path: Path) -> None:
    """Coordinator and devices connect with their certificates; every descriptor and global state is signed and
    verified; the aggregates are the in-process run's and no device refused anything."""
    from fedge.common.transport import CoordinatorTransport
    from fedge.coordinator.engine import EngineConfig, RoundEngine
    from fedge.edge.agent import DeviceAgent
    from fedge.edge.service import EdgeService
    from fedge.fleet.config import load_fleet
    from fedge.sim.inprocess import run_inprocess
    from fedge.sim.simulate import build_fleet

    broker, out = mtls_broker
    path = tmp_path / "fleet.toml"
    path.write_text(f'[run]\nmethod = "fedproto"\nrounds = 2\ndataset = "digits"\nfleet = "{FLEET}"\nseed = 3\n\n'
                    '[partition]\nkind = "dirichlet"\nalpha = 0.5\nfraction = 0.25\n\n[train]\nlr = 0.05\n'
                    'local_epochs = 1\n\n[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\narch = "tier-xs"\n\n'
                    '[[devices]]\nprofile = "x86-gateway"\ncount = 2\narch = "tier-xs"\n')
    cfg = load_fleet(path)
    ref_devices, ref_strat = build_fleet(cfg)
    ref_coord, _, _ = run_inprocess(cfg, ref_devices)
    ref = RoundEngine(ref_strat, ref_coord, EngineConfig(fleet=FLEET, method="fedproto"))
    ref.run()

    devices, strat = build_fleet(cfg)
    signer = Signer.from_file(out / "coordinator/signing.key")
    coord = MqttCoordinatorTransport(mtls_settings(broker, out, "coordinator"), FLEET, signer=signer).start()
    transports, services, threads = [], [], []
    try:
        for d in devices:
            did = d.info.device_id
            t = MqttDeviceTransport(mtls_settings(broker, out, did), FLEET, did,
                                    verifier=Verifier.from_file(out / f"bundles/{did}/fleet.pub")).start()
            transports.append(t)
            svc = EdgeService(DeviceAgent(d.method, t, d.info, fleet=FLEET), t)
            services.append(svc)
            threads.append(threading.Thread(target=svc.run, daemon=True))
        for th in threads:
            th.start()
        coord.wait_for_hellos([d.info.device_id for d in devices], 60)
        transport: CoordinatorTransport = coord
        engine = RoundEngine(strat, transport, EngineConfig(fleet=FLEET, method="fedproto"))
        reports = engine.run()
        for th in threads:
            th.join(30)
    finally:
        for s in services:
            s.stop()
        for t in transports:
            t.close()
        coord.close()
    assert all(sorted(r.accepted) == sorted(d.info.device_id for d in devices) for r in reports)
    for name, arrays in ref.globals.items():
        for k, v in arrays.items():
            np.testing.assert_allclose(engine.globals[name][k], v, rtol=1e-5, atol=1e-6)
    assert all(t.stats.rejected == {} for t in transports)
    assert all(s.finished for s in services)


# -- signed model manifests --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export_helpers import digits, trained

    from fedge.export.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("signed") / "model"
    export_model(trained(), out, quant="fp32", test=digits()[1], options=ExportOptions(latency_runs=3))
    return out


def test_fedge_infer_verifies_the_manifest_signature_when_a_key_is_configured(
        exported: Path, tmp_path: Path, keys: tuple[Signer, Verifier], capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.runtime import EdgeModel
    from fedge.runtime.signature import sign_manifest

    model = tmp_path / "model"
    shutil.copytree(exported, model)
    pub = str(tmp_path / "fleet.pub")
    check = ["infer", "--model", str(model), "--check", "--fleet-key", pub]
    assert main(check) == 7
    assert "carries no signature" in capsys.readouterr().err
    signer, verifier = keys
    record = sign_manifest(model, signer)
    assert record["key"] == signer.key_id and main(check) == 0
    assert main(["infer", "--model", str(model), "--check"]) == 0  # no key configured: not checked
    EdgeModel.load(model, verifier=verifier)
    # an edited manifest (a class renamed) no longer matches its signature, and nothing is loaded
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["classes"][0] = "evil"
    (model / "manifest.json").write_text(json.dumps(manifest, indent=2))
    assert main(check) == 7
    err = capsys.readouterr().err
    assert "manifest.json does not verify" in err and "modified after it was signed" in err
    # signed by another key
    other = Signer(Ed25519PrivateKey.generate())
    sign_manifest(model, other)
    assert main(check) == 7
    assert "not the fleet key" in capsys.readouterr().err
    # fedge export --signing-key signs what it writes
    (tmp_path / "junk.key").write_text("junk")
    assert main(["export", "--checkpoint", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "x"),
                 "--signing-key", str(tmp_path / "junk.key")]) == 2
    assert "is not a PEM private key" in capsys.readouterr().err
