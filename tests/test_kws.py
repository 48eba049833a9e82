"""Keyword spotting end to end: the espeak-ng set in the Speech Commands layout, the fleet partitioned by speaker,
a DS-CNN with its front end inside, exported and run on WAV files by the torch-free runtime."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from audio_helpers import SMALL_KWS

import fedge.edge.models  # noqa: F401  (registers the measurer, as every training process does)
from fedge.common.catalog import KWS_CLASSES
from fedge.edge.data.datasets import load_dataset, load_groups, load_labels
from fedge.edge.data.espeak import UNKNOWN_WORDS, KeywordSetSettings, espeak_binary, make_keyword_set
from fedge.edge.data.speech import WORDS, load_speech_commands, speaker_of
from fedge.errors import ConfigError, DataError
from fedge.fleet.config import parse_fleet
from fedge.fleet.slots import device_slots, fleet_splits


def kws_fleet(data_dir: Path, *, method: str = "fedavg", rounds: int = 1, devices: int = 3,
              **extra: Any) -> Any:
    return parse_fleet({
        "run": {"name": "kws", "method": method, "rounds": rounds, "dataset": "espeak_kws",
                "data_dir": str(data_dir), "seed": 0},
        "model": {"family": "dscnn"},
        "partition": {"kind": "group", "local_test_fraction": 0.2},
        "train": {"lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 16},
        "devices": [{"profile": "rpi4-4gb", "count": devices, "arch": "xs"}],
        **extra,
    })


def test_the_set_is_in_the_speech_commands_layout_with_unseen_test_speakers(espeak_kws: Path) -> None:
    s = SMALL_KWS
    for word in (*WORDS, *UNKNOWN_WORDS):
        files = sorted((espeak_kws / word).iterdir())
        takes = s.takes if word in WORDS else s.unknown_takes
        assert len(files) == s.speakers * takes, word
        assert {speaker_of(f.name) for f in files} == {f"spk{i:02d}" for i in range(s.speakers)}
    with wave.open(str(espeak_kws / "yes" / "spk00_nohash_1.wav"), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16_000, 1, 2, 16_000)
    assert sorted(p.name for p in (espeak_kws / "_background_noise_").iterdir()) == [
        "brown_noise.wav", "hum_noise.wav", "pink_noise.wav", "white_noise.wav"]
    voices = json.loads((espeak_kws / "speakers.json").read_text())
    assert len({v["voice"] for v in voices}) == s.speakers  # every speaker a voice of its own
    splits = {sp: load_speech_commands(espeak_kws, split=sp, unknown_fraction=None) for sp in
              ("train", "validation", "test")}
    speakers = {sp: set(d.speakers) - {"_background_noise_"} for sp, d in splits.items()}
    assert [len(speakers[sp]) for sp in ("train", "validation", "test")] == [5, 1, 2]
    assert not speakers["test"] & speakers["train"] and not speakers["validation"] & speakers["train"]
    test = splits["test"]
    # 2 test speakers x (10 words x 2 takes + 10 unknown words): every class, silence at 10 % of the word clips
    assert np.bincount(test.y, minlength=12).tolist() == [4] * 10 + [4, 20]
    assert test.x.shape == (64, 16_000) and test.skipped == []
    # the word is there: a clip's loudest 100 ms carries far more energy than its quietest (noise only)
    energy = np.convolve(test.x[0] ** 2, np.ones(1600), "valid")
    assert energy.max() > 5 * energy.min()


def test_the_folder_is_a_cache_and_is_never_overwritten(espeak_kws: Path, tmp_path: Path) -> None:
    stamp = (espeak_kws / "settings.json").stat().st_mtime_ns
    assert make_keyword_set(espeak_kws, SMALL_KWS) == espeak_kws
    assert make_keyword_set(espeak_kws) == espeak_kws  # no settings asked for: any set fedge made
    assert (espeak_kws / "settings.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match="made with other settings"):
        make_keyword_set(espeak_kws, KeywordSetSettings(speakers=9, test_speakers=2, val_speakers=1))
    (tmp_path / "mine.txt").write_text("x")
    with pytest.raises(DataError, match="not a keyword set made by fedge"):
        make_keyword_set(tmp_path)
    with pytest.raises(DataError, match="leave none of 4 for training"):
        KeywordSetSettings(speakers=4, test_speakers=3, val_speakers=1)


def test_without_espeak_ng_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without espeak-ng
    with pytest.raises(DataError, match="espeak-ng is not installed") as err:
        espeak_binary()
    assert "apt-get install espeak-ng" in (err.value.hint or "")


def test_the_fleet_reads_it_by_name_and_puts_each_speaker_on_one_device(espeak_kws: Path) -> None:
    train = load_dataset("espeak_kws", train=True, data_dir=espeak_kws)
    assert train.x.shape[1:] == (1, 16_000) and train.x.dtype == np.float32
    assert train.classes == KWS_CLASSES and train.norm.kind == "audio" and train.norm.sample_shape == (1, 16_000)
    assert (load_labels("espeak_kws", train=True, data_dir=espeak_kws) == train.y).all()
    groups = load_groups("espeak_kws", train=True, data_dir=espeak_kws)
    cfg = kws_fleet(espeak_kws)
    assert cfg.input_shape == (1, 16_000)
    splits = fleet_splits(cfg, train.y)
    owner: dict[str, set[int]] = {}
    for d, s in enumerate(splits):
        for i in np.concatenate([s.train, s.test, s.val]):
            owner.setdefault(str(groups[i]), set()).add(d)
    voices = {g: o for g, o in owner.items() if g.startswith("spk")}
    assert len(voices) == 5 and all(len(o) == 1 for o in voices.values())  # each speaker on exactly one device
    silence = np.flatnonzero(train.y == KWS_CLASSES.index("silence"))
    assert len({d for i in silence for d, s in enumerate(splits) if i in s.train or i in s.test or i in s.val}) == 3
    slots = device_slots(cfg, train.y)
    assert [s.arch for s in slots] == ["dscnn-xs-16000"] * 3


def test_refusals_at_load_name_the_fix(espeak_kws: Path) -> None:
    with pytest.raises(ConfigError, match="the GeFL CNN family takes images") as err:
        kws_fleet(espeak_kws, model={"family": "gefl-cnn"})
    assert 'family = "dscnn"' in (err.value.hint or "")
    with pytest.raises(ConfigError, match="splits by speaker or subject, which digits has not"):
        parse_fleet({"run": {"method": "fedavg", "rounds": 1, "dataset": "digits"}, "partition": {"kind": "group"},
                     "devices": [{"profile": "rpi4-4gb", "count": 2}]})
    with pytest.raises(DataError, match="speech_commands needs \\[run\\] data_dir"):
        load_labels("speech_commands", train=True)
    # GeFL-F's feature generator needs a (C, S, S) stem; the DS-CNN's is (32, 25, 5): refused when the fleet is
    # planned, before any device is built or trains (not by the generator on the first device)
    with pytest.raises(ConfigError, match="feature generator imitates a \\(C, H, W\\) stem output with H = W") as err:
        device_slots(kws_fleet(espeak_kws, method="geflf"))
    assert "(32, 25, 5)" in str(err.value) and "fedavg, lgfedavg or fedproto" in (err.value.hint or "")


@pytest.mark.slow
def test_a_kws_fleet_trains_exports_and_the_runtime_classifies_wav_files(espeak_kws: Path, tmp_path: Path) -> None:
    from fedge.export.fleet import export_checkpoint
    from fedge.runtime import EdgeModel, load_inputs
    from fedge.sim.simulate import simulate

    cfg = kws_fleet(espeak_kws, rounds=2)
    result = simulate(cfg, out_dir=tmp_path / "run")
    assert [sorted(r.accepted) for r in result.reports[:2]] == [["rpi4-4gb-1", "rpi4-4gb-2", "rpi4-4gb-3"]] * 2
    ckpt = tmp_path / "run" / "checkpoints" / "rpi4-4gb-1.safetensors"
    manifest = export_checkpoint(ckpt, tmp_path / "export", profile="rpi4-4gb", data_dir=espeak_kws, quant="fp32")
    assert list(manifest.input_shape) == ["batch", 1, 16_000]
    assert manifest.normalization["kind"] == "audio"
    test_files = [espeak_kws / line for line in (espeak_kws / "testing_list.txt").read_text().split()]
    model = EdgeModel.load(tmp_path / "export")
    batch = load_inputs(test_files, model.norm)  # WAV files, read by the runtime
    assert batch.x.shape == (len(test_files), 1, 16_000)
    got = model.logits(batch.x, preprocessed=True)
    from fedge.edge.models.checkpoint import load_checkpoint

    net = load_checkpoint(ckpt).eval()
    with torch.no_grad():
        want = net(torch.from_numpy(batch.x)).numpy()
    assert np.abs(got - want).max() <= 1e-4
    assert (got.argmax(1) == want.argmax(1)).all()
    # fedge infer on a WAV, on the runtime alone: torch never imported
    code = ("import sys\nfrom fedge.cli import main\n"
            f"rc = main(['infer', '--model', {str(tmp_path / 'export')!r}, '--json', {str(test_files[0])!r}])\n"
            "print(rc, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    rows = json.loads(out.stdout.rsplit("]", 1)[0] + "]")
    assert rows[0]["input"] == str(test_files[0]) and rows[0]["top"][0]["class"] in KWS_CLASSES
    assert out.stdout.strip().splitlines()[-1] == "0 False"
