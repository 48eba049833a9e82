"""Keyword-spotting audio from WAV folders in the Speech Commands layout (Warden 2018).

The layout: one folder per word (``yes/``, ``no/``, ... and any other word), a ``_background_noise_/``
folder of long noise recordings, and ``validation_list.txt`` / ``testing_list.txt`` naming the held-out
clips as ``word/file.wav``; every clip not listed is training data. A clip's speaker is its file name
before ``_nohash_`` (``0a7c2a8d_nohash_0.wav`` -> ``0a7c2a8d``), so a fleet can be partitioned by speaker
(:func:`fedge.edge.data.partition.by_group`).

The twelve-class setting: the ten command words, ``silence`` (1-s windows cut from the background noise)
and ``unknown`` (every other word). Clips are mono float32 in [-1, 1], 1 s at 16 kHz (zero-padded at the
end or centre-cropped). They are read by :func:`fedge.runtime.signals.read_wav` (the reader ``fedge infer``
uses too): a file that is not a 16-bit PCM WAV is skipped and reported with its name, never fatal.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.common.catalog import KWS_CLASSES, KWS_WORDS
from fedge.errors import DataError
from fedge.runtime.signals import CLIP_SAMPLES, SAMPLE_RATE, fit_clip, read_wav, resample_linear

__all__ = [
    "BACKGROUND",
    "CLASSES",
    "CLIP_SAMPLES",
    "SAMPLE_RATE",
    "WORDS",
    "SpeechSet",
    "fit_clip",
    "load_speech_commands",
    "read_wav",
    "resample_linear",
    "speaker_of",
]

log = logging.getLogger(__name__)

WORDS = KWS_WORDS
SILENCE, UNKNOWN = "silence", "unknown"
CLASSES = KWS_CLASSES
BACKGROUND = "_background_noise_"
SPLITS = ("train", "validation", "test")
_LISTS = {"validation": "validation_list.txt", "test": "testing_list.txt"}


def speaker_of(name: str) -> str:
    """The speaker id of a Speech Commands file name: its part before ``_nohash_`` (else the stem)."""
    stem = Path(name).stem
    return stem.split("_nohash_", 1)[0]


@dataclass
class SpeechSet:
    """One split of clips: x float32 (N, 16000) raw audio, y int64 (N,) into ``classes``, the speaker of
    each clip (``silence`` clips have speaker ``_background_noise_``), and what was skipped and why."""

    name: str
    x: np.ndarray
    y: np.ndarray
    speakers: np.ndarray
    classes: tuple[str, ...] = CLASSES
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> SpeechSet:
        return SpeechSet(self.name, self.x[idx], self.y[idx], self.speakers[idx], self.classes, self.skipped)

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def _listed(root: Path, split: str) -> set[str]:
    path = root / _LISTS[split]
    if not path.is_file():
        return set()
    return {line.strip().replace("\\", "/") for line in path.read_text().splitlines() if line.strip()}


def _split_files(root: Path, split: str, skipped: list[tuple[str, str]]) -> list[tuple[Path, str]]:
    """(file, word folder) of every .wav of ``split``; non-.wav files and empty folders go to ``skipped``."""
    held = {s: _listed(root, s) for s in _LISTS}
    out = []
    for folder in sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("_")):
        files = sorted(f for f in folder.iterdir() if f.is_file())
        wavs = [f for f in files if f.suffix.lower() == ".wav"]
        skipped += [(str(f), "not a .wav file") for f in files if f.suffix.lower() != ".wav"]
        if not wavs:
            skipped.append((str(folder), "class folder holds no .wav file"))
        for f in wavs:
            key = f"{folder.name}/{f.name}"
            in_split = next((s for s, names in held.items() if key in names), "train")
            if in_split == split:
                out.append((f, folder.name))
    return out


def _read_all(files: list[Path], skipped: list[tuple[str, str]]) -> list[tuple[Path, np.ndarray]]:
    out = []
    for f in files:
        try:
            out.append((f, read_wav(f)))
        except DataError as exc:
            skipped.append((str(f), exc.message.removeprefix(f"{f}: ")))
    return out


def _silence(noise: list[np.ndarray], count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` 1-s windows at random places of random noise recordings."""
    noise = [n for n in noise if len(n) >= CLIP_SAMPLES]
    if count and not noise:
        raise DataError(f"no {BACKGROUND} recording of at least 1 s to cut silence clips from",
                        hint=f"put long noise WAVs in {BACKGROUND}/, or pass silence_fraction=0")
    out = np.zeros((count, CLIP_SAMPLES), dtype=np.float32)
    for i in range(count):
        n = noise[rng.integers(len(noise))]
        start = int(rng.integers(len(n) - CLIP_SAMPLES + 1))
        out[i] = n[start : start + CLIP_SAMPLES]
    return out


def load_speech_commands(root: str | os.PathLike[str], *, split: str = "train", silence_fraction: float = 0.1,
                         unknown_fraction: float | None = 0.1, seed: int = 0) -> SpeechSet:
    """One split of a Speech Commands folder in the twelve-class setting.

    ``silence_fraction``: silence clips per word clip (the usual 10 %), cut from ``_background_noise_/``
    (the same recordings for every split, as in the original protocol). ``unknown_fraction``: unknown
    clips kept per word clip, drawn at random (``None`` keeps every one). Unreadable files, non-.wav files
    and empty class folders are logged and listed in ``skipped``; nothing among them is fatal.
    """
    base = Path(root)
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}", hint=f"use one of {', '.join(SPLITS)}")
    if not base.is_dir():
        raise DataError(f"{base}: no such directory", hint="point it at a Speech Commands folder")
    skipped: list[tuple[str, str]] = []
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    files = _split_files(base, split, skipped)
    words = [(f, w) for f, w in files if w in WORDS]
    others = [f for f, w in files if w not in WORDS]
    n_words = len(words)
    if unknown_fraction is not None and len(others) > unknown_fraction * n_words:
        keep = np.sort(rng.permutation(len(others))[: round(unknown_fraction * n_words)])
        others = [others[i] for i in keep]
    labelled = [(f, CLASSES.index(w)) for f, w in words] + [(f, CLASSES.index(UNKNOWN)) for f in others]
    label_of = dict(labelled)
    clips = _read_all([f for f, _ in labelled], skipped)
    noise_dir = base / BACKGROUND
    noise_files = sorted(f for f in noise_dir.glob("*.wav")) if noise_dir.is_dir() else []
    noise = [x for _, x in _read_all(noise_files, skipped)]
    silence = _silence(noise, round(silence_fraction * n_words), rng)
    for path, reason in skipped:
        log.warning("speech commands: skipped %s: %s", path, reason)
    x = np.concatenate([np.stack([fit_clip(c) for _, c in clips]) if clips
                        else np.zeros((0, CLIP_SAMPLES), np.float32), silence])
    y = np.array([label_of[f] for f, _ in clips] + [CLASSES.index(SILENCE)] * len(silence), dtype=np.int64)
    speakers = np.array([speaker_of(f.name) for f, _ in clips] + [BACKGROUND] * len(silence), dtype=object)
    log.info("loaded speech commands %s from %s: %d clips (%d silence), %d skipped",
             split, base, len(y), len(silence), len(skipped))
    return SpeechSet(f"speech_commands:{split}", x, y, speakers, CLASSES, skipped)
