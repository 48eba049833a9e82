"""A device's own data (`fedge edge run --data DIR`): the folder scan, its errors, new images between rounds,
and what a --data device sends over a real Mosquitto (only the method's artifacts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest
from own_data_helpers import DIGIT_CLASSES, own_data_fleet, write_digit_pngs
from PIL import Image

from fedge.common.health import FIELDS as HEALTH_FIELDS
from fedge.common.messages import Message
from fedge.common.preprocess import NORMALIZATION
from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.edge.data.local import LocalData
from fedge.edge.own_data import OwnDataAgent, build_own_device, local_data
from fedge.errors import ConfigError, DataError
from fedge.fleet.config import load_fleet
from fedge.fleet.registry import method_entry
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.chunking import frame_kind
from fedge.mqtt.client import new_paho_client
from fedge.mqtt.topics import FleetTopics
from fedge.runtime.inputs import load_inputs

NORM = NORMALIZATION["digits"]


def folder(tmp_path: Path, per_class: int = 10) -> tuple[Path, dict[int, list[Path]]]:
    root = tmp_path / "data"
    return root, write_digit_pngs(root, per_class)


def test_scan_maps_folders_to_fleet_labels_with_the_inference_preprocessing(tmp_path: Path) -> None:
    root, files = folder(tmp_path, 10)
    # Label ids come from the fleet's class list, not from folder order: reverse it.
    classes = tuple(reversed(DIGIT_CLASSES))
    scan = LocalData(root, classes, NORM, test_fraction=0.2, seed=0).scan()
    assert (len(scan.train), len(scan.test), scan.skipped) == (80, 20, {})
    ys = np.concatenate([scan.train.y, scan.test.y])
    assert np.bincount(ys, minlength=10).tolist() == [10] * 10
    # Stratified: 2 of every class's 10 images are local test images.
    assert np.bincount(scan.test.y, minlength=10).tolist() == [2] * 10
    # Exactly the arrays `fedge infer` makes of the same file (one preprocessing path).
    ref = load_inputs([files[3][0]], NORM).x[0]
    label = classes.index("3")
    pool = np.concatenate([scan.train.x, scan.test.x])[ys == label]
    assert any(np.array_equal(ref, x) for x in pool)
    assert scan.train.x.shape[1:] == (1, 32, 32) and scan.train.x.dtype == np.float32


def test_split_is_seeded_and_independent_of_when_files_are_found(tmp_path: Path) -> None:
    root, _ = folder(tmp_path, 10)
    a = LocalData(root, DIGIT_CLASSES, NORM, seed=4).scan()
    b = LocalData(root, DIGIT_CLASSES, NORM, seed=4).scan()
    c = LocalData(root, DIGIT_CLASSES, NORM, seed=5).scan()
    assert np.array_equal(a.test.x, b.test.x)
    assert not np.array_equal(a.test.x, c.test.x)


def test_new_images_are_picked_up_and_corrupt_files_skipped_and_counted(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    root, _ = folder(tmp_path, 5)
    data = LocalData(root, DIGIT_CLASSES, NORM, test_fraction=0.2)
    first = data.scan()
    assert (first.num_images, first.new) == (50, 50)
    write_digit_pngs(root, 3, offset=5)  # a camera keeps writing
    broken = root / "7" / "half-written.png"
    broken.write_bytes((root / "7" / "img_0000.png").read_bytes()[:40])
    second = data.scan()
    assert (second.num_images, second.new) == (80, 30)  # only the new files were converted
    assert list(second.skipped) == [str(broken)] and second.summary()["skipped"] == 1
    assert str(broken) in caplog.text
    Image.fromarray(np.full((8, 8), 200, np.uint8)).save(broken)  # the write finished: used next scan
    third = data.scan()
    assert (third.num_images, third.skipped, third.new) == (81, {}, 1)


@pytest.mark.parametrize("case", ["unknown-class", "empty", "stray-file", "not-an-image", "too-small", "float-pixels",
                                  "npz-label"])
def test_bad_data_is_a_clear_error_naming_the_path_and_the_fix(tmp_path: Path, case: str) -> None:
    root = tmp_path / "data"
    write_digit_pngs(root, 2, classes=(0, 1))
    bad = {
        "unknown-class": root / "cats",
        "stray-file": root / "notes.png",
        "not-an-image": root / "1" / "labels.csv",
        "too-small": root / "1" / "dot.png",
        "float-pixels": root / "1" / "scan.tif",
        "npz-label": root / "more.npz",
    }.get(case)
    if case == "unknown-class":
        assert bad is not None
        bad.mkdir()
    elif case == "empty":
        for f in root.rglob("*.png"):
            f.unlink()
    elif case in ("stray-file", "not-an-image"):
        assert bad is not None
        bad.write_text("x")
    elif case == "too-small":
        assert bad is not None
        Image.fromarray(np.zeros((1, 1), np.uint8)).save(bad)
    elif case == "float-pixels":  # a readable image, but not one a fleet input can be made of: not "skipped"
        assert bad is not None
        Image.fromarray(np.full((8, 8), 0.5, np.float32)).save(bad)
    else:
        assert bad is not None
        np.savez(bad, x=np.zeros((2, 8, 8), np.uint8), y=np.array([0, 10]))
    with pytest.raises(DataError) as err:
        LocalData(root, DIGIT_CLASSES, NORM).scan()
    msg, hint = err.value.message, err.value.hint or ""
    assert str(bad or root) in msg
    want = {"unknown-class": "[data] classes", "empty": "sub-folder per class", "stray-file": "sub-folder",
            "not-an-image": "remove it", "too-small": "remove the file", "float-pixels": "8- or 16-bit image",
            "npz-label": "positions in [data] classes"}
    assert want[case] in hint


def test_npz_files_hold_raw_images_and_label_ids(tmp_path: Path) -> None:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images[:60] * (255 / 16)).round().astype(np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=d.target[:60])
    scan = LocalData(tmp_path / "d.npz", DIGIT_CLASSES, NORM, test_fraction=0.25).scan()
    assert scan.num_images == 60
    all_x = np.concatenate([scan.train.x, scan.test.x])
    from fedge.runtime.inputs import prepare

    ref = prepare(x, NORM)
    assert sorted(map(bytes, all_x)) == sorted(map(bytes, ref))


def test_16bit_images_are_scaled_not_clipped(tmp_path: Path) -> None:
    # The runtime's image reader keeps 16 bits and says so (full scale 65535): a folder of
    # 16-bit scans trains on the same inputs as their 8-bit originals, not on saturated ones.
    eight, sixteen = tmp_path / "u8", tmp_path / "u16"
    files = write_digit_pngs(eight, 3, classes=(0, 1))
    for paths in files.values():
        for p in paths:
            dst = sixteen / p.parent.name / p.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.asarray(Image.open(p)).astype(np.uint16) * 257).save(dst)
    with Image.open(dst) as im:
        assert im.mode == "I;16"
    a = LocalData(eight, DIGIT_CLASSES, NORM, test_fraction=0.0).scan()
    b = LocalData(sixteen, DIGIT_CLASSES, NORM, test_fraction=0.0).scan()
    assert b.num_images == a.num_images == 6 and b.skipped == {}
    assert np.abs(np.sort(b.train.x, axis=None) - np.sort(a.train.x, axis=None)).max() < 1e-5
    assert float(b.train.x.max()) > 1.0  # not a saturated image squeezed into a few grey levels


def test_fleet_data_section_is_validated(tmp_path: Path) -> None:
    base = own_data_fleet(tmp_path / "f.toml").read_text()
    cases = {'classes = ["a", "a"]': "twice", 'classes = ["a", "b/c"]': "folder name",
             'classes = ["a", "b"]\nchannels = 3': "1x32x32"}
    for section, want in cases.items():
        p = tmp_path / "bad.toml"
        p.write_text(base.replace('classes = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]', section))
        with pytest.raises(ConfigError, match=want):
            load_fleet(p)
    cfg = load_fleet(tmp_path / "f.toml")
    assert cfg.own_data and cfg.num_classes == 10 and cfg.input_norm() == NORM
    no_data = tmp_path / "plain.toml"
    no_data.write_text(base.replace('[data]\nclasses = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]', ""))
    with pytest.raises(ConfigError, match=r"\[data\] classes"):
        local_data(load_fleet(no_data), tmp_path)


class _NullTransport:
    def send_hello(self, data: bytes) -> None: ...
    def current_round(self) -> bytes | None: return None
    def fetch_global(self, artifact: str) -> bytes | None: return None
    def send_update(self, data: bytes) -> None: self.sent.append(data)
    def __init__(self) -> None: self.sent: list[bytes] = []


def test_agent_trains_on_new_images_and_survives_a_bad_rescan(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_digit_pngs(root, 4)
    cfg = load_fleet(own_data_fleet(tmp_path / "f.toml"))
    data = local_data(cfg, root)
    dev, scan = build_own_device(cfg, "rpi4-2gb-2", data)
    transport = _NullTransport()
    status = tmp_path / "status.json"
    agent = OwnDataAgent(dev.method, transport, dev.info, fleet="own", data=data, scan=scan,
                         status_file=status)
    info = lambda r: RoundInfo(round=r, phase="train", method="fedavg")  # noqa: E731
    agent.handle_round(info(1))
    assert Message.from_bytes(transport.sent[-1]).info["num_samples"] == len(scan.train) == 30
    write_digit_pngs(root, 2, offset=4)
    agent.handle_round(info(2))
    assert Message.from_bytes(transport.sent[-1]).info["num_samples"] == len(dev.method.ctx.train) == 50
    (root / "cats").mkdir()  # an unknown class folder appears mid-run: keep training on what was there
    agent.handle_round(info(3))
    assert len(transport.sent) == 3 and len(dev.method.ctx.train) == 50
    st = json.loads(status.read_text())
    assert st["round"] == 3 and st["train"] == 50 and "cats" in st["error"] and "[data] classes" in st["error"]
    (root / "cats").rmdir()
    # A corrupt file: skipped, counted, its path in the status; the other images train.
    broken = root / "4" / "cut.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    agent.handle_round(info(4))
    st = json.loads(status.read_text())
    assert (st["round"], st["train"], st["skipped"], st["error"]) == (4, 50, 1, None)
    assert list(st["skipped_files"]) == [str(broken)] and "not a readable image" in st["skipped_files"][str(broken)]
    # The folder emptied (a card swapped, a cleanup script): the device keeps its last data, says why.
    for f in root.rglob("*.png"):
        f.unlink()
    agent.handle_round(info(5))
    assert len(transport.sent) == 5 and Message.from_bytes(transport.sent[-1]).info["num_samples"] == 50
    st = json.loads(status.read_text())
    assert st["train"] == 50 and "the data set is empty (1 unreadable files)" in st["error"]


def test_a_device_whose_folder_cannot_start_says_why_in_its_status(tmp_path: Path) -> None:
    """At first boot the data folder is still empty: `fedge edge run --data` exits with the data error (systemd
    starts it again later), no traceback, and the status file says what to do."""
    cfg_path = own_data_fleet(tmp_path / "f.toml")
    empty = tmp_path / "data"
    (empty / "3").mkdir(parents=True)
    status = tmp_path / "state" / "status.json"
    proc = subprocess.run([sys.executable, "-m", "fedge", "edge", "run", "--config", str(cfg_path), "--device-id",
                           "rpi4-2gb-1", "--broker", "mqtt://127.0.0.1:9", "--data", str(empty), "--status-file",
                           str(status)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == DataError.exit_code, proc.stderr
    assert f"{empty}: the data set is empty (no images)" in proc.stderr and "Traceback" not in proc.stderr
    st = json.loads(status.read_text())
    assert (st["device"], st["train"], st["round"]) == ("rpi4-2gb-1", 0, 0)
    assert "the data set is empty" in st["error"] and "fix: put images in one sub-folder per class" in st["error"]


def test_a_data_device_sends_only_the_methods_artifacts(tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    """Every message a --data device publishes, captured at the broker: a hello with its registry record,
    online/offline status, and per round one update whose tensors are exactly the method's prototypes."""
    root = tmp_path / "data"
    files = write_digit_pngs(root, 12)
    names = {p.name for ps in files.values() for p in ps}
    cfg_path = own_data_fleet(tmp_path / "f.toml", method="fedproto", rounds=2, fleet="private")
    cfg = load_fleet(cfg_path)
    topics = FleetTopics("private")
    captured: list[tuple[str, bytes]] = []
    lock = threading.Lock()
    spy = new_paho_client("spy", True)

    def on_message(_c: object, _u: object, m: paho.MQTTMessage, *_: object) -> None:
        with lock:
            captured.append((m.topic, bytes(m.payload)))

    spy.on_message = on_message
    spy.connect("127.0.0.1", mosquitto.port)
    spy.subscribe(f"{topics.base}/devices/#", qos=1)
    spy.loop_start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    coord = subprocess.Popen([sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(cfg_path),
                              "--broker", mosquitto.url, "--state-dir", str(tmp_path / "state"), "--min-devices",
                              "1", "--quorum", "0.5", "--round-timeout", "0", "--deadline-slack", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        dev = subprocess.run([sys.executable, "-m", "fedge", "edge", "run", "--config", str(cfg_path),
                              "--device-id", "rpi4-2gb-1", "--broker", mosquitto.url, "--data", str(root),
                              "--chunk-bytes", str(16 << 20)], capture_output=True, text=True, env=env, timeout=240)
        assert dev.returncode == 0, dev.stderr
        assert "100 training and 20 local test images" in dev.stderr
        out, _ = coord.communicate(timeout=120)
        assert coord.returncode == 0, out.decode()
    finally:
        if coord.poll() is None:
            coord.kill()
        spy.loop_stop()
        spy.disconnect()
    by_kind: dict[str, list[bytes]] = {}
    for topic, payload in captured:
        parsed = topics.parse_device(topic)
        assert parsed is not None and parsed.device_id == "rpi4-2gb-1", topic
        by_kind.setdefault(parsed.kind, []).append(payload)
    assert set(by_kind) == {"status", "hello", "update", "health"}
    # heartbeats: no tensors, only the health record's fields (system figures, versions, rounds)
    for raw_health in by_kind["health"]:
        beat = Message.from_bytes(raw_health)
        assert beat.kind == "health" and beat.tensors == {} and set(beat.info) == {"health"}
        assert set(beat.info["health"]) == set(HEALTH_FIELDS)
    assert set(by_kind["status"]) <= {b"online", b"offline"}
    hello = Message.from_bytes(by_kind["hello"][0])
    assert hello.tensors == {}
    info = DeviceInfo.from_dict(hello.info["device"])
    assert info.num_samples == 100
    strat = method_entry("fedproto").build_strategy(None, num_classes=cfg.num_classes, rounds=2)
    updates = [Message.from_bytes(p) for p in by_kind["update"] if frame_kind(p) == "message"]
    assert len(updates) == len(by_kind["update"]) == 3  # rounds 1-2 (train) and 3 (final: metrics only)
    image_bytes = 1 * 32 * 32 * 4
    for upd in updates:
        spec = (strat.expected_update(info, upd.round) or {}) if upd.round <= 2 else {}  # final: no tensors
        assert {k: tuple(v.shape) for k, v in upd.tensors.items()} == {k: tuple(s) for k, (s, _) in spec.items()}
        # train_s: the round's seconds of work on the device's clock (issue 27), a timing, nothing of the data
        assert set(upd.info) <= {"metrics", "bytes_down", "num_samples", "loss", "train_s"}
        assert set(upd.info["metrics"]) <= {"acc_local"}  # no global test set on a device's own data
        raw = next(p for p in by_kind["update"] if Message.from_bytes(p).round == upd.round)
        # Less than two preprocessed images' worth per round: no room for the 100 training images.
        assert len(raw) < 2 * image_bytes, len(raw)
    # The device reports its accuracy on its own held-out split (20 images: a multiple of 1/20).
    acc = updates[-1].info["metrics"]["acc_local"]
    assert 0.0 <= acc <= 1.0 and round(acc * 20, 6).is_integer(), acc
    for _, payload in captured:
        assert not any(n.encode() in payload for n in names)  # no file names either
        assert str(root).encode() not in payload
