"""A synthetic keyword-spotting set spoken by Debian's ``espeak-ng``, in the Speech Commands layout.

Nothing can be downloaded here, so the keyword data fedge measures on is made on the machine: each
"speaker" is an espeak-ng voice (an English accent and a voice variant, ``en-gb-scotland+f3``) with a
speaking speed and pitch of its own; each take of a word varies them a little and places the word at a
random point of its 1-s clip, mixed with background noise at a random SNR. The folder it writes is the
Speech Commands layout (:mod:`fedge.edge.data.speech` reads both): one folder per word, the ten commands
and ten of Speech Commands' auxiliary words (``unknown``), ``_background_noise_/`` (white, pink, brown
noise and mains hum, generated), the speaker id in every file name (``spk07_nohash_2.wav``), and
``validation_list.txt`` / ``testing_list.txt`` naming every clip of the held-out speakers: test speakers
are never heard in training.

What it shows and what it does not: it is synthetic speech from one formant synthesizer. Speakers differ
by accent, voice variant, speed and pitch, not by microphone, room or age, and every take of a word by a
speaker is nearly the same signal, so accuracies on it are far above what real speech gives and say
little about real keyword spotting; it exercises the whole path (WAVs, the front end in the model, the
partition by speaker, unseen test speakers) and ranks methods on a speaker-partitioned task.

The folder is a cache: :func:`make_keyword_set` writes it once (``settings.json`` records how) and
returns at once when it exists with the same settings.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fedge.edge.data.speech import BACKGROUND, CLIP_SAMPLES, SAMPLE_RATE, WORDS, resample_linear, speaker_of
from fedge.errors import DataError

log = logging.getLogger(__name__)

# Speech Commands' auxiliary words: the "unknown" class
UNKNOWN_WORDS = ("bed", "bird", "cat", "dog", "happy", "house", "marvin", "sheila", "tree", "wow")
# espeak-ng's English voices that need no MBROLA database (package espeak-ng-data)
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029",
           "en-us-nyc")
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
NOISES = ("white", "pink", "brown", "hum")
SETTINGS_FILE = "settings.json"


@dataclass(frozen=True)
class KeywordSetSettings:
    """How a set is made; the same settings (and espeak-ng) give the same files."""

    speakers: int = 48
    takes: int = 3  # of each command word per speaker
    unknown_takes: int = 1  # of each auxiliary word per speaker
    test_speakers: int = 8
    val_speakers: int = 4
    snr_db: tuple[float, float] = (5.0, 30.0)
    noise_seconds: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.speakers > len(ACCENTS) * len(VARIANTS):
            raise DataError(f"{self.speakers} speakers: there are {len(ACCENTS) * len(VARIANTS)} voices",
                            hint=f"use at most {len(ACCENTS) * len(VARIANTS)}")
        if self.test_speakers + self.val_speakers >= self.speakers:
            raise DataError(f"{self.test_speakers} test + {self.val_speakers} validation speakers leave none of "
                            f"{self.speakers} for training", hint="use more speakers or hold fewer out")
        if self.takes < 1 or self.unknown_takes < 0:
            raise DataError("takes must be >= 1 and unknown_takes >= 0")


@dataclass(frozen=True)
class Speaker:
    """One synthetic speaker: an espeak-ng voice, words per minute and pitch (0-99)."""

    id: str
    voice: str
    speed: int
    pitch: int


def espeak_binary() -> str:
    """The ``espeak-ng`` executable, or a :class:`DataError` saying how to install it."""
    found = shutil.which("espeak-ng")
    if found is None:
        raise DataError("espeak-ng is not installed: the synthetic keyword set is spoken by it",
                        hint="apt-get install espeak-ng (Debian/Ubuntu), or use a real Speech Commands folder")
    return found


def make_speakers(s: KeywordSetSettings) -> list[Speaker]:
    """``s.speakers`` distinct voices (accent x variant, drawn without replacement), each with its speed and pitch."""
    rng = np.random.default_rng([s.seed, 1])
    voices = [f"{a}+{v}" for a in ACCENTS for v in VARIANTS]
    picked = rng.choice(len(voices), size=s.speakers, replace=False)
    return [Speaker(f"spk{i:02d}", voices[j], int(rng.integers(120, 201)), int(rng.integers(20, 81)))
            for i, j in enumerate(picked)]


def speak(binary: str, word: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    """``word`` spoken by espeak-ng as float32 mono at 16 kHz (espeak-ng writes 22.05 kHz 16-bit WAV)."""
    cmd = [binary, "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", word]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=30, check=True)
        with wave.open(io.BytesIO(done.stdout), "rb") as w:
            rate, raw = w.getframerate(), w.readframes(w.getnframes())
    except (subprocess.SubprocessError, OSError, wave.Error, EOFError) as exc:
        raise DataError(f"espeak-ng failed on {word!r} with voice {voice}: {exc}",
                        hint="check `espeak-ng -v VOICE WORD` works (package espeak-ng-data holds the voices)") from exc
    x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    return resample_linear(x, rate, SAMPLE_RATE)


def noise_recordings(s: KeywordSetSettings) -> dict[str, np.ndarray]:
    """The background "recordings": white, pink (1/f), brown (1/f^2) noise and 50 Hz mains hum, peak ~0.5."""
    rng = np.random.default_rng([s.seed, 2])
    n = s.noise_seconds * SAMPLE_RATE
    white = rng.standard_normal(n)
    f = np.fft.rfftfreq(n, 1 / SAMPLE_RATE)
    f[0] = f[1]
    spectrum = np.fft.rfft(rng.standard_normal(n))
    pink = np.fft.irfft(spectrum / np.sqrt(f), n)
    brown = np.fft.irfft(spectrum / f, n)
    t = np.arange(n) / SAMPLE_RATE
    hum = sum(np.sin(2 * np.pi * 50 * k * t + rng.uniform(0, 2 * np.pi)) / k for k in range(1, 6)) + 0.1 * white
    out = {"white": white, "pink": pink, "brown": brown, "hum": hum}
    return {k: (0.5 * v / np.abs(v).max()).astype(np.float32) for k, v in out.items()}


def place(word: np.ndarray, noise: np.ndarray, rng: np.random.Generator, snr_db: tuple[float, float]) -> np.ndarray:
    """A 1-s clip: ``word`` (trimmed of silence) at a random offset, plus a random stretch of ``noise`` at a random
    SNR (signal power over the word's voiced part)."""
    loud = np.flatnonzero(np.abs(word) > 0.02)
    if len(loud):
        word = word[loud[0] : loud[-1] + 1]
    word = word[:CLIP_SAMPLES]
    clip = np.zeros(CLIP_SAMPLES, dtype=np.float32)
    start = int(rng.integers(CLIP_SAMPLES - len(word) + 1))
    clip[start : start + len(word)] = word
    stretch = noise[(at := int(rng.integers(len(noise) - CLIP_SAMPLES + 1))) : at + CLIP_SAMPLES]
    snr = rng.uniform(*snr_db)
    gain = np.sqrt(np.mean(word**2) / (np.mean(stretch**2) * 10 ** (snr / 10)))
    mixed = clip + gain * stretch
    return (mixed * min(1.0, 0.9 / max(float(np.abs(mixed).max()), 1e-9))).astype(np.float32)


def write_wav16(path: Path, x: np.ndarray) -> None:
    """Mono 16-bit PCM at 16 kHz."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(np.round(np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def _jobs(s: KeywordSetSettings, speakers: list[Speaker]) -> list[tuple[str, Speaker, int, int, int]]:
    """(word, speaker, take, speed, pitch) of every clip: each take moves speed by up to 10 %, pitch by 5."""
    rng = np.random.default_rng([s.seed, 3])
    out = []
    for spk in speakers:
        for words, takes in ((WORDS, s.takes), (UNKNOWN_WORDS, s.unknown_takes)):
            for word in words:
                for k in range(takes):
                    speed = int(np.clip(spk.speed * rng.uniform(0.9, 1.1), 80, 450))
                    out.append((word, spk, k, speed, int(np.clip(spk.pitch + rng.integers(-5, 6), 0, 99))))
    return out


def make_keyword_set(root: str | os.PathLike[str], settings: KeywordSetSettings | None = None, *,
                     workers: int = 2) -> Path:
    """Write the set into ``root`` (a cache: an existing folder made with the same settings is kept as it is;
    with ``settings`` None, any set fedge made there is, and a new one gets the defaults).

    A folder holding anything else is refused rather than overwritten. ``workers`` espeak-ng processes run at
    once.
    """
    s = settings or KeywordSetSettings()
    base = Path(root)
    record = {**asdict(s), "snr_db": list(s.snr_db)}
    marker = base / SETTINGS_FILE
    if marker.is_file():
        if settings is None or json.loads(marker.read_text()) == record:
            log.info("keyword set in %s already made with these settings", base)
            return base
        raise DataError(f"{base} holds a keyword set made with other settings ({marker})",
                        hint="remove the folder or use another one")
    if base.exists() and any(base.iterdir()):
        raise DataError(f"{base} exists and is not a keyword set made by fedge (no {SETTINGS_FILE})",
                        hint="give an empty or new folder")
    binary = espeak_binary()
    speakers = make_speakers(s)
    noise = noise_recordings(s)
    (base / BACKGROUND).mkdir(parents=True, exist_ok=True)
    for name, x in noise.items():
        write_wav16(base / BACKGROUND / f"{name}_noise.wav", x)
    jobs = _jobs(s, speakers)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # espeak-ng runs outside the GIL
        spoken = list(pool.map(lambda j: speak(binary, j[0], j[1].voice, j[3], j[4]), jobs))
    rng = np.random.default_rng([s.seed, 4])
    noise_list = list(noise.values())
    for (word, spk, k, _, _), x in zip(jobs, spoken, strict=True):
        (base / word).mkdir(exist_ok=True)
        write_wav16(base / word / f"{spk.id}_nohash_{k}.wav",
                    place(x, noise_list[int(rng.integers(len(noise_list)))], rng, s.snr_db))
    held = [spk.id for spk in speakers]
    test_ids = set(held[-s.test_speakers :]) if s.test_speakers else set()
    val_ids = set(held[-s.test_speakers - s.val_speakers : -s.test_speakers or None]) if s.val_speakers else set()
    names = [f"{w}/{spk.id}_nohash_{k}.wav" for w, spk, k, _, _ in jobs]
    (base / "testing_list.txt").write_text("".join(f"{n}\n" for n in names if speaker_of(n) in test_ids))
    (base / "validation_list.txt").write_text("".join(f"{n}\n" for n in names if speaker_of(n) in val_ids))
    (base / "speakers.json").write_text(json.dumps([asdict(spk) for spk in speakers], indent=1))
    marker.write_text(json.dumps(record))  # last: a half-written folder is never taken for a finished one
    log.info("keyword set: %d clips by %d speakers (%d held out for test, %d for validation) in %s",
             len(jobs), len(speakers), len(test_ids), len(val_ids), base)
    return base
