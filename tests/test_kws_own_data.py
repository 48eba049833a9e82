"""Devices training on their own WAV folders: the folder reader (bad files skipped and reported, rescans), and a
keyword-spotting fleet over Mosquitto with `fedge edge run --data`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from fedge.common.catalog import KWS_CLASSES
from fedge.edge.data.speech import WORDS
from fedge.edge.own_data import local_data
from fedge.errors import ConfigError
from fedge.fleet.config import load_fleet, parse_fleet
from fedge.mqtt.broker import MosquittoProcess

KWS_OWN = """
[run]
method = "fedavg"
rounds = {rounds}
fleet = "kws"
seed = 0

[model]
family = "dscnn"

[data]
kind = "audio"
classes = {classes}

[train]
lr = 0.05
local_epochs = 1
batch_size = 16

[[devices]]
profile = "rpi4-4gb"
count = 2
arch = "xs"
"""


def own_fleet(path: Path, rounds: int = 1) -> Path:
    path.write_text(KWS_OWN.format(rounds=rounds, classes=json.dumps(list(KWS_CLASSES))))
    return path


def device_folder(espeak_kws: Path, root: Path, speakers: tuple[str, ...]) -> Path:
    """The clips of ``speakers`` in class folders (auxiliary words under unknown/), plus the noise folder that a
    Speech Commands copy carries (skipped: it is not a class)."""
    for word_dir in sorted(p for p in espeak_kws.iterdir() if p.is_dir() and not p.name.startswith("_")):
        cls = word_dir.name if word_dir.name in WORDS else "unknown"
        for f in word_dir.iterdir():
            if f.name.split("_nohash_")[0] in speakers:
                (root / cls).mkdir(parents=True, exist_ok=True)
                shutil.copy(f, root / cls / f"{word_dir.name}-{f.name}")
    shutil.copytree(espeak_kws / "_background_noise_", root / "_background_noise_")
    return root


def test_a_wav_folder_is_read_with_bad_files_skipped_and_reported(espeak_kws: Path, tmp_path: Path) -> None:
    root = device_folder(espeak_kws, tmp_path / "dev", ("spk00",))
    good = root / "yes" / "yes-spk00_nohash_0.wav"
    (root / "no" / "cut.wav").write_bytes(good.read_bytes()[:3000])  # truncated body
    (root / "no" / "text.wav").write_text("not a wav")
    (root / "up" / "readme.txt").write_text("x")
    with wave.open(str(root / "up" / "eight.wav"), "wb") as w:  # 8-bit PCM
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(16_000)
        w.writeframes(np.full(16_000, 128, np.uint8).tobytes())
    cfg = parse_fleet({"run": {"method": "fedavg", "rounds": 1}, "model": {"family": "dscnn"},
                       "data": {"kind": "audio", "classes": list(KWS_CLASSES)},
                       "devices": [{"profile": "rpi4-4gb"}]})
    assert cfg.input_shape == (1, 16_000)
    data = local_data(cfg, root)
    scan = data.scan()
    n = 10 * 2 + 10  # 10 words x 2 takes + 10 auxiliary words (unknown)
    assert scan.num_images == n and scan.train.x.shape[1:] == (1, 16_000)
    assert np.bincount(np.concatenate([scan.train.y, scan.test.y]), minlength=12).tolist() == [2] * 10 + [0, 10]
    reasons = {Path(p).name: r for p, r in scan.skipped.items()}
    assert reasons["cut.wav"].startswith("truncated: its header says")
    assert reasons["text.wav"].startswith("not a readable WAV file")
    assert reasons["eight.wav"] == "8-bit samples; only 16-bit PCM WAV is read"
    assert reasons["readme.txt"] == "not a .wav file (audio data)"
    # a rescan picks up a new clip and reuses the rest
    shutil.copy(espeak_kws / "go" / "spk01_nohash_0.wav", root / "go" / "new.wav")
    again = data.scan()
    assert again.num_images == n + 1 and again.new == 1
    with pytest.raises(ConfigError, match="audio is read as mono"):
        parse_fleet({"run": {"method": "fedavg", "rounds": 1}, "model": {"family": "dscnn"},
                     "data": {"kind": "audio", "channels": 2, "classes": ["a", "b"]},
                     "devices": [{"profile": "rpi4-4gb"}]})
    with pytest.raises(ConfigError, match="kind = 'audio' is 1-D \\(1x16000\\), the GeFL CNN family takes images"):
        parse_fleet({"run": {"method": "fedavg", "rounds": 1}, "data": {"kind": "audio", "classes": ["a", "b"]},
                     "devices": [{"profile": "rpi4-4gb"}]})


@pytest.mark.slow
def test_a_kws_fleet_over_mosquitto_trains_on_the_devices_own_wav_folders(
        espeak_kws: Path, tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    cfg_path = own_fleet(tmp_path / "kws.toml", rounds=2)
    assert load_fleet(cfg_path).input_shape == (1, 16_000)
    folders = [device_folder(espeak_kws, tmp_path / f"dev{i}", spk) for i, spk in
               enumerate((("spk00", "spk01"), ("spk02", "spk03")))]
    (folders[1] / "left" / "broken.wav").write_bytes(b"RIFF\x00\x00")  # skipped, never fatal
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # `fedge coordinator run` cannot measure a family other than the GeFL CNNs without the device side loaded
    # (docs/models.md, "Limits today"): the coordinator here loads it first, as the error's hint says
    coordinator = ("import sys, fedge.edge.models\nfrom fedge.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))")
    coord = subprocess.Popen([sys.executable, "-c", coordinator, "coordinator", "run", "--config", str(cfg_path),
                              "--broker", mosquitto.url, "--state-dir", str(tmp_path / "state"), "--min-devices",
                              "2", "--round-timeout", "0", "--deadline-slack", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    devices = [subprocess.Popen([sys.executable, "-m", "fedge", "edge", "run", "--config", str(cfg_path),
                                 "--device-id", f"rpi4-4gb-{i + 1}", "--broker", mosquitto.url, "--data", str(d),
                                 "--status-file", str(tmp_path / f"status{i}.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
               for i, d in enumerate(folders)]
    try:
        outs = [d.communicate(timeout=400)[0].decode() for d in devices]
        assert [d.returncode for d in devices] == [0, 0], outs
        out, _ = coord.communicate(timeout=120)
        assert coord.returncode == 0, out.decode()
    finally:
        for p in (coord, *devices):
            if p.poll() is None:
                p.kill()
    # 2 speakers x 30 clips a device; a fifth of each class (rounded) is its local test split: 1 of each word's 4,
    # 4 of the 20 unknown
    assert "46 training and 14 local test images" in outs[0]
    status = json.loads((tmp_path / "status1.json").read_text())
    assert status["skipped"] == 1 and str(folders[1] / "left" / "broken.wav") in status["skipped_files"]
    reports = [json.loads(line) for line in (tmp_path / "state" / "reports.jsonl").read_text().splitlines()]
    assert [sorted(r["accepted"]) for r in reports[:2]] == [["rpi4-4gb-1", "rpi4-4gb-2"]] * 2
