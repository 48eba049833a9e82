"""The Speech Commands loader on WAV folders in the real layout, written here with numpy + wave."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest

from fedge.edge.data.partition import by_group
from fedge.edge.data.speech import (
    CLASSES,
    CLIP_SAMPLES,
    SAMPLE_RATE,
    fit_clip,
    load_speech_commands,
    read_wav,
    resample_linear,
    speaker_of,
)
from fedge.errors import DataError


def write_wav(path: Path, x: np.ndarray, rate: int = SAMPLE_RATE, width: int = 2) -> Path:
    """``x``: (T,) or (T, channels) floats in [-1, 1]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = x if x.ndim == 2 else x[:, None]
    with wave.open(str(path), "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes(np.round(frames * 32767).astype("<i2").tobytes())
        else:
            w.writeframes((np.round(frames * 127) + 128).astype(np.uint8).tobytes())
    return path


def tone(freq: float, seconds: float = 1.0, rate: int = SAMPLE_RATE, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * freq * np.arange(round(seconds * rate)) / rate)


def build_layout(root: Path) -> None:
    """4 speakers x (yes, no, bed) + background noise; speaker 'dd' is held out for test, 'cc' for validation."""
    for s_i, spk in enumerate(["aa", "bb", "cc", "dd"]):
        for w_i, word in enumerate(["yes", "no", "bed"]):
            for k in range(2):
                write_wav(root / word / f"{spk}_nohash_{k}.wav", tone(200 + 50 * w_i + 10 * s_i, 0.8 + 0.1 * k))
    write_wav(root / "_background_noise_" / "white.wav", np.random.default_rng(0).uniform(-0.3, 0.3, 3 * SAMPLE_RATE))
    (root / "_background_noise_" / "README.md").write_text("noise")
    val = [f"{w}/cc_nohash_{k}.wav" for w in ("yes", "no", "bed") for k in range(2)]
    test = [f"{w}/dd_nohash_{k}.wav" for w in ("yes", "no", "bed") for k in range(2)]
    (root / "validation_list.txt").write_text("\n".join(val) + "\n")
    (root / "testing_list.txt").write_text("\n".join(test) + "\n")


def test_the_layout_gives_twelve_classes_split_by_the_lists(tmp_path: Path) -> None:
    build_layout(tmp_path)
    train = load_speech_commands(tmp_path, split="train", silence_fraction=0.5, unknown_fraction=None)
    assert train.classes == CLASSES and len(CLASSES) == 12
    assert train.x.shape == (8 + 4 + 4, CLIP_SAMPLES) and train.x.dtype == np.float32
    # 8 word clips (yes, no of aa, bb), 4 unknown (bed), 4 silence = 0.5 x 8 word clips.
    assert np.bincount(train.y, minlength=12).tolist() == [4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4]
    assert set(train.speakers[train.y != 10]) == {"aa", "bb"}
    assert set(train.speakers[train.y == 10]) == {"_background_noise_"}
    assert train.skipped == []  # the README beside the noise is not a clip
    test = load_speech_commands(tmp_path, split="test", silence_fraction=0, unknown_fraction=None)
    assert set(test.speakers) == {"dd"} and len(test) == 6
    val = load_speech_commands(tmp_path, split="validation", silence_fraction=0, unknown_fraction=0.5)
    assert set(val.speakers) == {"cc"} and np.bincount(val.y, minlength=12)[11] == 2  # 0.5 x 4 word clips
    # a 0.8 s clip is padded with zeros at the end, the signal kept as written
    i = int(np.flatnonzero((train.speakers == "aa") & (train.y == 0))[0])
    ref = tone(200, 0.8)
    assert np.allclose(train.x[i, : len(ref)], ref, atol=1e-4) and not train.x[i, len(ref):].any()


def test_bad_files_are_read_converted_or_skipped_by_name(tmp_path: Path) -> None:
    build_layout(tmp_path)
    good = write_wav(tmp_path / "yes" / "ee_nohash_0.wav", tone(300))
    cut = tmp_path / "yes" / "ee_nohash_1.wav"
    cut.write_bytes(good.read_bytes()[: 44 + 1000])  # the header says 16000 frames, 500 follow
    write_wav(tmp_path / "no" / "ee_nohash_2.wav", tone(300, rate=8000), rate=8000)  # resampled
    stereo = np.stack([tone(300), np.zeros(SAMPLE_RATE)], axis=1)
    write_wav(tmp_path / "no" / "ee_nohash_3.wav", stereo)  # downmixed
    write_wav(tmp_path / "no" / "ee_nohash_4.wav", tone(300), width=1)  # 8-bit: refused
    (tmp_path / "no" / "ee_nohash_5.wav").write_text("not audio")  # a .wav that is not one
    (tmp_path / "no" / "notes.txt").write_text("x")
    (tmp_path / "left").mkdir()  # an empty class folder
    ds = load_speech_commands(tmp_path, split="train", silence_fraction=0, unknown_fraction=None)
    reasons = dict(ds.skipped)
    assert set(reasons) == {str(cut), str(tmp_path / "no" / "ee_nohash_4.wav"),
                            str(tmp_path / "no" / "ee_nohash_5.wav"), str(tmp_path / "no" / "notes.txt"),
                            str(tmp_path / "left")}
    assert reasons[str(cut)] == "truncated: its header says 16000 frames, the file holds 500"
    assert reasons[str(tmp_path / "no" / "ee_nohash_4.wav")].startswith("8-bit samples")
    assert reasons[str(tmp_path / "no" / "ee_nohash_5.wav")].startswith("not a readable WAV file")
    assert reasons[str(tmp_path / "no" / "notes.txt")] == "not a .wav file"
    assert reasons[str(tmp_path / "left")] == "class folder holds no .wav file"
    ee = ds.x[ds.speakers == "ee"]
    assert len(ee) == 3  # folder then file order: no/ee_2 (8 kHz), no/ee_3 (stereo), yes/ee_0
    # 8 kHz -> 16 kHz by linear interpolation; the last output sample lies past the last input (held)
    assert np.abs(ee[0] - tone(300))[:-1].max() < 0.01 and ee[0][-1] == ee[0][-2]
    assert np.allclose(ee[1], tone(300) / 2, atol=1e-4)  # (left + right) / 2
    assert np.allclose(ee[2], tone(300), atol=1e-4)


def test_read_wav_names_the_file_it_refuses(tmp_path: Path) -> None:
    header_cut = tmp_path / "h.wav"
    header_cut.write_bytes(write_wav(tmp_path / "ok.wav", tone(100)).read_bytes()[:20])
    with pytest.raises(DataError, match=r"h\.wav: not a readable WAV file"):
        read_wav(header_cut)
    empty = write_wav(tmp_path / "empty.wav", np.zeros(0))
    with pytest.raises(DataError, match=r"empty\.wav: the WAV holds no samples"):
        read_wav(empty)


@pytest.mark.parametrize("src", [8000, 22050, 48000])
def test_linear_resampling_follows_the_waveform(src: int) -> None:
    n_in = src // 2
    out = resample_linear(tone(440, 0.5, rate=src).astype(np.float32), src, SAMPLE_RATE)
    assert len(out) == SAMPLE_RATE // 2
    inside = (n_in - 1) * SAMPLE_RATE // src + 1  # output samples up to the last input one; later ones hold it
    out, ref = out[:inside], tone(440, 0.5)[:inside]
    # interpolation error of a 440 Hz sine sampled at 8 kHz: at most (2 pi 440 / 8000)^2 / 8 x 0.5 = 0.0075
    assert np.abs(out - ref).max() < 0.008


def test_fit_clip_pads_and_centre_crops() -> None:
    assert fit_clip(np.ones(3, np.float32), 5).tolist() == [1, 1, 1, 0, 0]
    assert fit_clip(np.arange(7, dtype=np.float32), 3).tolist() == [2, 3, 4]
    assert speaker_of("0a7c2a8d_nohash_0.wav") == "0a7c2a8d" and speaker_of("loose.wav") == "loose"


def test_by_group_keeps_each_speaker_on_one_device() -> None:
    groups = np.array(["a"] * 5 + ["b"] * 4 + ["c"] * 3 + ["d"] * 2 + ["e"] * 2)
    parts = by_group(groups, 3, seed=1)
    assert sorted(np.concatenate(parts).tolist()) == list(range(16))
    owners = [{g for g in groups[p]} for p in parts]
    assert sum(len(o) for o in owners) == 5  # no speaker on two devices
    assert sorted(len(p) for p in parts) == [5, 5, 6]  # largest first, to the lightest device
    assert [p.tolist() for p in parts] == [p.tolist() for p in by_group(groups, 3, seed=1)]
    with pytest.raises(DataError, match="5 speakers/subjects cannot be split over 6 devices"):
        by_group(groups, 6, seed=0)
