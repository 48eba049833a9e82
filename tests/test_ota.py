"""Over-the-air model updates: the device's model store (whole versions, an atomic switch, kill -9 at any moment
of it, repeated crashes rolled back), the updater's checks (a model that loses local accuracy is rolled back, an
older version refused), and `fedge deploy`'s staged rollout over a real Mosquitto with mutual TLS: canary first,
stopped at the canary when it fails, resumable downloads, bad input refused with nothing changed."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from broker_helpers import mtls_mosquitto, wait_until
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from export_helpers import digits, trained

from fedge.cli import main
from fedge.common.signing import Signer, Verifier
from fedge.errors import PayloadError
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.chunking import parse_frame
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.ota import Order, OtaDevice, parse_status, release
from fedge.mqtt.topics import FleetTopics
from fedge.runtime.manifest import read_manifest, verify_files
from fedge.runtime.ota import ModelUpdater
from fedge.runtime.package import ModelPackage, pack_dir, unpack
from fedge.runtime.store import ModelStore, StoreError

REPO = Path(__file__).resolve().parents[1]
FLEET = "ota"
DEVICES = ["cam-1", "cam-2", "cam-3"]


@dataclass(frozen=True)
class Models:
    good: Path  # tier-xs trained 3 epochs on digits (~94 %)
    bad: Path  # the same architecture untrained (~10 %)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    from fedge.edge.models.zoo import build_model
    from fedge.export.exporter import ExportOptions, export_model

    root = tmp_path_factory.mktemp("ota-models")
    test = digits()[1]
    opts = ExportOptions(latency_runs=3)
    export_model(trained(), root / "good", quant="fp32", test=test, options=opts)
    export_model(build_model("tier-xs", seed=1).eval(), root / "bad", quant="fp32", test=test, options=opts)
    return Models(root / "good", root / "bad")


def validation() -> tuple[np.ndarray, np.ndarray]:
    test = digits()[1]
    return test.x[:300], test.y[:300]


def package(model: Path, version: int) -> ModelPackage:
    return pack_dir(model, FLEET, version)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else os.readlink(p).encode())
            for p in sorted(root.rglob("*")) if p.is_file() or p.is_symlink()}


# -- the store and the updater, on one device ------------------------------------------------------------------

def test_the_store_switches_whole_versions_and_refuses_older_or_damaged_ones(models: Models, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "store")
    store.seed(models.good)
    assert (store.current, store.previous) == (0, None)
    store.install(package(models.good, 2))
    store.activate(2)
    assert (store.current, store.previous) == (2, 0) and store.state.trial is not None
    assert os.readlink(tmp_path / "store/current") == "versions/2"
    before = snapshot(tmp_path / "store")
    for old in (1, 2):
        with pytest.raises(StoreError, match=rf"model version {old} is .*\(2\): nothing changed"):
            store.install(package(models.good, old))
    # a package whose file does not match its sha256, one without manifest, one that lies about sizes
    data = bytearray(package(models.good, 3).to_bytes())
    data[-5] ^= 1
    with pytest.raises(PayloadError, match="does not match its sha256"):
        unpack(bytes(data), max_bytes=10**8)
    with pytest.raises(PayloadError, match=r"has no manifest\.json"):
        unpack(ModelPackage(FLEET, 3, {"model.onnx": b"x"}).to_bytes(), max_bytes=10**8)
    with pytest.raises(PayloadError, match="not a plain, unique file name"):
        unpack(ModelPackage(FLEET, 3, {"../evil": b"x", "manifest.json": b"{}"}).to_bytes(), max_bytes=10**8)
    with pytest.raises(PayloadError, match="exceeds the limit"):
        unpack(package(models.good, 3).to_bytes(), max_bytes=1000)
    # an export whose manifest does not match its files is not installed
    broken = dict(package(models.good, 3).files)
    broken["model.onnx"] = broken["model.onnx"][:-1]
    with pytest.raises(StoreError, match="is not a whole export"):
        store.install(ModelPackage(FLEET, 3, broken))
    assert snapshot(tmp_path / "store") == before  # nothing changed
    # opening the store (fedge infer --store) never removes the staging directory of a live installer
    live, dead = tmp_path / f"store/.staging-3-{os.getpid()}", tmp_path / "store/.staging-3-999999999"
    live.mkdir()
    dead.mkdir()
    ModelStore(tmp_path / "store")
    assert live.is_dir() and not dead.exists()


def test_a_model_that_lowers_local_accuracy_is_rolled_back(models: Models, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "store")
    store.seed(models.good)
    updater = ModelUpdater(store, validation())
    bad = updater.apply(package(models.bad, 1).to_bytes(), version=1, fleet=FLEET, threshold=0.02)
    assert bad["state"] == "rolled-back" and bad["smoke"]["ok"]
    acc = bad["accuracy"]
    assert acc["current"] > 0.85 and acc["new"] < 0.3 and acc["samples"] == 300
    assert bad["reason"].startswith(f"local accuracy {acc['new']:.1%} is more than 2.0% below the current model's")
    assert store.current == 0 and not store.path(1).exists()
    with pytest.raises(StoreError, match="version 1 was rolled back on this device"):
        updater.apply(package(models.bad, 1).to_bytes(), version=1, fleet=FLEET, threshold=0.02)
    good = updater.apply(package(models.good, 2).to_bytes(), version=2, fleet=FLEET, threshold=0.02)
    assert good["state"] == "installed" and store.current == 2 and store.previous == 0
    # a model that cannot run fails the smoke test (in its own process) and is never switched in
    crash = dict(package(models.good, 3).files)
    crash["model.onnx"] = b"\x08\x07" + b"\x00" * 64  # an ONNX protobuf with no graph
    manifest = json.loads(crash["manifest.json"])
    manifest["files"]["model.onnx"] = {"sha256": hashlib.sha256(crash["model.onnx"]).hexdigest(),
                                       "bytes": len(crash["model.onnx"])}
    crash["manifest.json"] = json.dumps(manifest).encode()
    out = updater.apply(ModelPackage(FLEET, 3, crash).to_bytes(), version=3, fleet=FLEET, threshold=0.02)
    assert out["state"] == "rolled-back" and "smoke test failed" in out["reason"] and store.current == 2


def test_the_checks_run_in_a_child_the_kernel_kills_first(models: Models) -> None:
    """Smoke test and both accuracies in one child process whose oom_score_adj is 1000: out of memory, the kernel
    kills the check, not the agent (which never loads a model: on an emulated Pi Zero 2 W the third update's
    in-process accuracy checks got the agent itself killed)."""
    from fedge.runtime.checks import accuracy, smoke_test

    x, y = validation()
    r = smoke_test(models.good, validation=(x, y), current=models.bad)
    assert r.ok and r.oom_score_adj == 1000, r
    assert r.accuracy == {"new": accuracy(models.good, x, y), "current": accuracy(models.bad, x, y)}
    assert r.accuracy["new"] > 0.85 and r.accuracy["current"] < 0.3
    assert smoke_test(models.good).accuracy is None  # no validation split: the smoke test only


def test_repeated_crashes_of_a_new_model_roll_it_back(models: Models, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    store = ModelStore(root)
    store.seed(models.good)
    store.install(package(models.good, 5))
    store.activate(5)
    crash = ("import os, signal, sys; from fedge.runtime.store import ModelStore; "
             "ModelStore(sys.argv[1]).open_current(); os.kill(os.getpid(), signal.SIGKILL)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):  # a model that kills its user before it classified anything
        proc = subprocess.run([sys.executable, "-c", crash, str(root)], env=env, capture_output=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL
    assert ModelStore(root).state.trial.starts == 3  # type: ignore[union-attr]
    assert main(["infer", "--store", str(root), "--check"]) == 0  # the 4th start rolls back first
    reopened = ModelStore(root)
    assert reopened.current == 0 and reopened.previous is None
    assert reopened.state.rolled_back["5"] == "crashed 3 times in a row before running inference"
    # a version that works: its first inference confirms it
    reopened.install(package(models.good, 6))
    reopened.activate(6)
    assert main(["infer", "--store", str(root), "--check"]) == 0
    assert ModelStore(root).state.trial is None and ModelStore(root).current == 6
    capsys.readouterr()


KILLER = """
import sys
from fedge.runtime.package import unpack
from fedge.runtime.store import ModelStore
data = open(sys.argv[2], "rb").read()
store = ModelStore(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
store.install(unpack(data, max_bytes=1 << 30))
store.activate(2)
print("done", flush=True)
"""


def test_kill_9_during_the_swap_leaves_the_old_or_the_new_model_whole(models: Models, tmp_path: Path) -> None:
    template = tmp_path / "template"
    ModelStore(template).seed(models.good)
    base = ModelStore(template)
    base.install(package(models.good, 1))
    base.activate(1)
    pkg = tmp_path / "v2.pkg"
    pkg.write_bytes(package(models.good, 2).to_bytes())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def attempt(delay: float | None) -> tuple[int, float]:
        root = tmp_path / f"s{time.monotonic_ns()}"
        shutil.copytree(template, root, symlinks=True)
        proc = subprocess.Popen([sys.executable, "-c", KILLER, str(root), str(pkg)], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if delay is None:
            assert proc.stdout.readline().strip() == "done"
            spent = time.monotonic() - t0
            proc.wait(10)
        else:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            spent = delay
        store = ModelStore(root)  # what a restarted device sees
        cur = store.current
        assert cur in (1, 2), cur
        verify_files(store.path(cur), read_manifest(store.path(cur)))  # whole: every file as its manifest says
        assert not list(root.glob(".staging-*"))
        shutil.rmtree(root)
        return cur, spent

    _, full = attempt(None)
    rng = random.Random(31)
    outcomes = [attempt(rng.uniform(0, full * 1.3))[0] for _ in range(16)]
    outcomes += [attempt(d)[0] for d in (0.0, full * 2)]
    assert set(outcomes) == {1, 2}, outcomes  # the kills landed before and after the switch


# -- fedge deploy over Mosquitto with mutual TLS --------------------------------------------------------------

@pytest.fixture
def fleet(mosquitto_bin: str, tmp_path: Path) -> Iterator[tuple[MosquittoProcess, Path, Path]]:
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'[run]\nmethod = "fedproto"\nrounds = 1\ndataset = "digits"\nfleet = "{FLEET}"\n\n'
                   '[[devices]]\nprofile = "rpi4-2gb"\ncount = 3\nid_prefix = "cam"\narch = "tier-xs"\n')
    with mtls_mosquitto(FLEET, DEVICES, fleet_config=cfg) as (broker, out):
        yield broker, out, cfg


def _settings(broker: MosquittoProcess, out: Path, d: Path, stem: str) -> BrokerSettings:
    return BrokerSettings(host="localhost", port=broker.port, tls=True, ca_file=str(out / "tls/ca.crt"),
                          cert_file=str(d / f"{stem}.crt"), key_file=str(d / f"{stem}.key"))


@dataclass
class Device:
    client: MqttClient
    store: ModelStore
    ota: OtaDevice


def start_device(broker: MosquittoProcess, out: Path, did: str, root: Path, seed: Path) -> Device:
    bundle = out / "bundles" / did
    client = MqttClient(_settings(broker, out, bundle, "device"), did)
    store = ModelStore(root / did)
    store.seed(seed)
    updater = ModelUpdater(store, validation())
    ota = OtaDevice(client, FLEET, did, Verifier.from_file(bundle / "fleet.pub"), store.incoming,
                    apply=lambda data, o: updater.apply(data, version=o.version, fleet=o.fleet, threshold=o.threshold),
                    status=store.status, precheck=store.check_new)
    client.start(10)
    ota.start()
    return Device(client, store, ota)


def deploy(broker: MosquittoProcess, out: Path, cfg: Path, model: Path, version: int, *extra: str) -> list[str]:
    d = out / "deploy"
    return ["deploy", "--config", str(cfg), "--model", str(model), "--version", str(version),
            "--signing-key", str(out / "coordinator/signing.key"), "--broker", f"mqtts://localhost:{broker.port}",
            "--ca", str(d / "ca.crt"), "--cert", str(d / "client.crt"), "--key", str(d / "client.key"),
            "--timeout", "90", "--chunk-bytes", "16384", *extra]


def test_a_staged_rollout_installs_everywhere_and_stops_at_a_failing_canary(
        fleet: tuple[MosquittoProcess, Path, Path], models: Models, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    broker, out, cfg = fleet
    devices = [start_device(broker, out, did, tmp_path / "stores", models.good) for did in DEVICES]
    try:
        # version 2, canary cam-1 first (1 of 3), then cam-2 and cam-3
        status = tmp_path / "v2.json"
        assert main(deploy(broker, out, cfg, models.good, 2, "--canary", "0.3", "--status-file", str(status))) == 0
        printed = capsys.readouterr()
        assert "to 3 devices of fleet ota: 1 (cam-1) then 2 (cam-2, cam-3)" in printed.err
        assert "model version 2 installed on all 3 devices" in printed.out
        report = json.loads(status.read_text())
        assert report["ok"] and report["stages"] == [["cam-1"], ["cam-2", "cam-3"]]
        assert all(report["statuses"][d]["state"] == "installed" and report["statuses"][d]["version"] == 2
                   for d in DEVICES)
        assert all(d.store.current == 2 and d.store.previous == 0 for d in devices)
        assert devices[0].ota.parts_received >= 3  # chunked: 16 KiB parts of a ~60 kB package
        # the installed model carries the fleet's signature
        assert main(["infer", "--model", str(devices[1].store.path(2)), "--check", "--fleet-key",
                     str(out / "bundles/cam-2/fleet.pub")]) == 0
        capsys.readouterr()
        # version 3 loses local accuracy: the canary rolls it back, the others never get an order
        assert main(deploy(broker, out, cfg, models.bad, 3, "--canary", "0.3")) == 10
        printed = capsys.readouterr()
        assert "the canary stage failed: version 3 went to no other device" in printed.err
        assert "cam-1                    rolled-back: running version 2, local accuracy" in printed.out
        assert "cam-2                    not ordered (the canary stage failed)" in printed.out
        assert [d.store.current for d in devices] == [2, 2, 2]
        assert "3" in devices[0].store.state.rolled_back and not devices[1].store.state.rolled_back
        # bad input changes nothing: an older version (the deploy tool sees the devices' versions), a device
        # the fleet does not have, a model directory that is not a whole export
        assert main(deploy(broker, out, cfg, models.good, 1)) == 2
        assert "--version 1 is not newer than what cam-1 runs version 2" in capsys.readouterr().err
        assert main(deploy(broker, out, cfg, models.good, 4, "--devices", "cam-9")) == 2
        assert "cam-9 not in" in capsys.readouterr().err
        broken = tmp_path / "broken"
        shutil.copytree(models.good, broken)
        (broken / "model.onnx").write_bytes(b"junk")
        assert main(deploy(broker, out, cfg, broken, 4)) == 7
        assert "model.onnx: size 4 bytes does not match" in capsys.readouterr().err
        assert [d.store.current for d in devices] == [2, 2, 2]
    finally:
        for d in devices:
            d.ota.stop()
            d.client.stop()


def test_devices_refuse_unsigned_or_older_orders_and_resume_a_download(
        fleet: tuple[MosquittoProcess, Path, Path], models: Models, tmp_path: Path) -> None:
    broker, out, _ = fleet
    topics = FleetTopics(FLEET)
    signer = Signer.from_file(out / "coordinator/signing.key")
    statuses: dict[str, dict] = {}

    def on_status(m: Received) -> None:
        s = parse_status(m.payload)
        if s is not None:
            statuses[s["device"]] = s

    op = MqttClient(_settings(broker, out, out / "deploy", "client"), "operator", on_message=on_status)
    op.start(10)
    op.subscribe(topics.ota_status_filter())
    dev = start_device(broker, out, "cam-1", tmp_path / "stores", models.good)
    try:
        pkg = package(models.good, 7).to_bytes()
        rel = release(topics, signer, pkg, 7, 16384)
        # a download interrupted earlier: 4 of its parts are on disk already
        manifest, _ = parse_frame(rel.publications[-1][1])
        have = dev.store.incoming / manifest.transfer_id
        have.mkdir(parents=True)
        for i in range(4):
            _, part = parse_frame(rel.publications[i][1])
            (have / str(i)).write_bytes(part)
        op.wait_published([op.publish(t, p, retain=True) for t, p in rel.publications], 10)

        def order(version: int, key: Signer | None = signer, device: str = "cam-1") -> None:
            o = Order(FLEET, device, version, f"{version:032x}", rel.sha256, rel.size, 0.02)
            topic = topics.ota_order("cam-1")
            body = o.to_json()
            op.wait_published([op.publish(topic, key.seal(topic, body) if key else body, retain=True)], 10)

        order(7, key=None)  # unsigned: refused, counted, nothing downloaded
        assert wait_until(lambda: dev.ota.rejected == {"unsigned": 1}, 30), dev.ota.rejected
        assert dev.ota.parts_received == 0  # (and at the end: only the resumed download's parts)
        order(7, key=Signer(Ed25519PrivateKey.generate()))  # another fleet's key
        assert wait_until(lambda: dev.ota.rejected == {"unsigned": 1, "key": 1}), dev.ota.rejected
        order(7, device="cam-2")  # signed, but for another device
        assert wait_until(lambda: statuses.get("cam-1", {}).get("state") == "refused")
        assert "the order is for cam-2" in statuses["cam-1"]["reason"]
        order(7)
        assert wait_until(lambda: statuses.get("cam-1", {}).get("state") == "installed", 60), statuses.get("cam-1")
        assert dev.ota.parts_received == rel.parts - 4  # resumed: only the missing parts travelled
        dl = statuses["cam-1"]["download"]  # the status says what the download took
        assert dl["bytes"] == rel.size and 0 < dl["seconds"] < 60
        parts = [len(p) for _, p in rel.publications]  # the resumed download received the manifest and 4 parts less
        assert dl["bytes_received"] == sum(parts) - sum(parts[:4])
        assert dev.store.current == 7 and statuses["cam-1"]["version"] == 7
        order(6)  # older than the installed one: refused before downloading, nothing changes
        assert wait_until(lambda: statuses["cam-1"]["state"] == "refused" and statuses["cam-1"]["target"] == 6)
        assert statuses["cam-1"]["reason"] == "model version 6 is older than the installed one (7): nothing changed"
        assert dev.store.current == 7
    finally:
        dev.ota.stop()
        dev.client.stop()
        op.stop()


@pytest.mark.slow  # 19-40 s here: the agent's process imports torch and builds its device
def test_fedge_edge_run_with_a_model_store_takes_an_update_from_fedge_deploy(
        fleet: tuple[MosquittoProcess, Path, Path], models: Models, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The command a flashed device runs (install.sh's launcher): its bundle's certificate and fleet key, a model
    store seeded from the flashed model; `fedge deploy` installs version 2 on it; after `fedge broker
    rotate-fleet-key`, `fedge deploy` with the new key installs version 3 (the agent followed the key chain)."""
    broker, out, cfg = fleet
    bundle = out / "bundles/cam-2"
    text = (bundle / "bundle.toml").read_text()
    (bundle / "bundle.toml").write_text(text.replace('broker = "mqtts://localhost:8883"',
                                                     f'broker = "mqtts://localhost:{broker.port}"'))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    store = tmp_path / "state/models"
    proc = subprocess.Popen([sys.executable, "-m", "fedge", "edge", "run", "--bundle", str(bundle), "--keep-running",
                             "--state-dir", str(tmp_path / "state"), "--model-store", str(store),
                             "--model", str(models.good)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    logs = ""
    try:
        # read the link, not ModelStore(store): opening a store clears staging directories it finds
        assert wait_until(lambda: (store / "current").is_symlink(), 120), "the agent did not seed its store"
        time.sleep(1.0)  # its first status is retained
        assert main(deploy(broker, out, cfg, models.good, 2, "--devices", "cam-2", "--canary", "0")) == 0
        assert "cam-2                    installed: running version 2" in capsys.readouterr().out
        assert ModelStore(store).current == 2
        # the fleet key is rotated; fedge deploy with the new key publishes the key chain before its order: the
        # agent follows it (kept in its state directory) and installs version 3, which only the new key signed
        from fedge.broker.fleetkey import rotate_fleet_key
        from fedge.fleet.config import load_fleet

        rotation = rotate_fleet_key(out, load_fleet(cfg).run.fleet)
        assert main(deploy(broker, out, cfg, models.good, 3, "--devices", "cam-2", "--canary", "0")) == 0
        assert "cam-2                    installed: running version 3" in capsys.readouterr().out
        assert json.loads((tmp_path / "state/fleet-key.json").read_text())["key"] == rotation.new
    finally:
        proc.send_signal(signal.SIGTERM)
        logs, _ = proc.communicate(timeout=60)
        print(logs[-3000:])
    assert "model store" in logs and "accepting updates signed by the fleet key" in logs, logs[-2000:]
    assert f"fleet key rotated: now trusting key {rotation.new} only" in logs, logs[-2000:]
