"""Reading 1-D inputs: WAV audio and sensor windows (``.csv`` / ``.npy``), numpy and the standard library only.

The one reader of each for training (:mod:`fedge.edge.data.speech`, :mod:`fedge.edge.data.sensors`) and for
``fedge infer`` on the device: a clip or a window reaches the model the same way in both. Audio models take
raw samples (their MFCC front end is inside the exported graph); sensor models take the window as recorded.

* **WAV**: 16-bit PCM through :mod:`wave` (no libsndfile on a device), stereo averaged to mono, another
  sample rate resampled by linear interpolation (no anti-aliasing filter: tested on tones, 8, 22.05 and
  48 kHz -> 16 kHz within 0.008; fine for speech, not a studio resampler), then cut or zero-padded to the
  model's clip length (centre-cropped when longer).
* **Windows**: one window per file, (window, channels) — time down, channels across, as a logger writes
  CSV; stored as (channels, window).

Every refusal is a :class:`~fedge.errors.DataError` naming the file, what is wrong and how to fix it.
"""

from __future__ import annotations

import logging
import os
import wave
from pathlib import Path

import numpy as np

from fedge.errors import DataError

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
CLIP_SAMPLES = SAMPLE_RATE  # one second
AUDIO_SUFFIXES = (".wav",)
WINDOW_SUFFIXES = (".npy", ".csv")


def read_wav(path: str | os.PathLike[str], rate: int = SAMPLE_RATE) -> np.ndarray:
    """A 16-bit PCM WAV as mono float32 in [-1, 1] at ``rate`` Hz.

    Raises :class:`DataError` naming the file when it is not a readable 16-bit PCM WAV (not RIFF, another
    encoding or sample width, truncated, empty). Stereo is averaged to mono; another sample rate is
    resampled by linear interpolation.
    """
    p = Path(path)
    try:
        with wave.open(str(p), "rb") as w:
            channels, width, src_rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError, OSError) as exc:  # not RIFF/WAVE, a non-PCM format, a cut header
        why = str(exc) or ("the file ends inside its header" if isinstance(exc, EOFError) else type(exc).__name__)
        raise DataError(f"{p}: not a readable WAV file ({why})",
                        hint="convert it to 16-bit PCM WAV, e.g. sox in.x -b 16 out.wav") from exc
    if width != 2:
        raise DataError(f"{p}: {8 * width}-bit samples; only 16-bit PCM WAV is read",
                        hint="convert it with sox in.wav -b 16 out.wav")
    if n == 0:
        raise DataError(f"{p}: the WAV holds no samples")
    if len(raw) < n * width * channels:  # the header promises more than the file holds
        raise DataError(f"{p}: truncated: its header says {n} frames, the file holds "
                        f"{len(raw) // (width * channels)}", hint="re-copy or re-record the file")
    x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)  # downmix: speech is the same on every channel
    if src_rate != rate:
        log.debug("%s: resampling %d Hz -> %d Hz", p, src_rate, rate)
        x = resample_linear(x, src_rate, rate)
    return x


def resample_linear(x: np.ndarray, src_rate: int, rate: int) -> np.ndarray:
    """``x`` sampled at ``src_rate`` re-sampled at ``rate`` by linear interpolation (same duration)."""
    if src_rate <= 0 or rate <= 0:
        raise DataError(f"sample rates must be positive, got {src_rate} -> {rate}")
    n_out = max(1, round(len(x) * rate / src_rate))
    t_out = np.arange(n_out, dtype=np.float64) * (src_rate / rate)
    return np.interp(t_out, np.arange(len(x), dtype=np.float64), x).astype(np.float32)


def fit_clip(x: np.ndarray, length: int = CLIP_SAMPLES) -> np.ndarray:
    """``x`` zero-padded at the end, or centre-cropped, to exactly ``length`` samples."""
    if len(x) >= length:
        start = (len(x) - length) // 2
        return np.ascontiguousarray(x[start : start + length], dtype=np.float32)
    return np.pad(x.astype(np.float32), (0, length - len(x)))


def read_window(path: str | os.PathLike[str], window: int, channels: int) -> np.ndarray:
    """One window file (``.npy`` or ``.csv``, (window, channels): time down, channels across) as float32
    (channels, window); a :class:`DataError` naming the file and the fix otherwise."""
    p = Path(path)
    try:
        if p.suffix.lower() == ".npy":
            arr = np.load(p, allow_pickle=False)
        elif p.suffix.lower() == ".csv":
            arr = np.loadtxt(p, delimiter=",", ndmin=2, dtype=np.float64)
        else:
            raise DataError(f"{p}: not a .npy or .csv window", hint="save windows as .npy or .csv")
    except (OSError, ValueError) as exc:
        raise DataError(f"{p}: not a readable window ({exc})",
                        hint="save it as numbers, one row per time step, one column per channel") from exc
    want = (window, channels)
    if arr.shape != want:
        flip = " (transposed? save it as time x channels)" if arr.shape == want[::-1] else ""
        raise DataError(f"{p}: shape {arr.shape}, expected {want} ({window} samples x {channels} channels){flip}",
                        hint="cut windows of the model's length and channels ([data] window / channels)")
    if arr.dtype.kind not in "iuf" or not np.isfinite(arr).all():
        raise DataError(f"{p}: NaN, infinite or non-numeric values", hint="drop or repair the window")
    return np.ascontiguousarray(arr.T, dtype=np.float32)


def check_signal_batch(x: np.ndarray, shape: tuple[int, ...], *, audio: bool, what: str = "input") -> np.ndarray:
    """A batch of model inputs (N, *shape) float32 from ``x``: one sample ``shape``, a batch, or (audio) a bare
    (samples,) clip or (N, samples) clips. Refused, naming ``what``: another shape, NaN or infinity, and audio
    beyond [-1, 1] (16-bit integers not scaled)."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iuf" or arr.dtype.kind == "b":
        raise DataError(f"{what} is {arr.dtype}: the model takes numbers")
    if tuple(arr.shape) == shape or (audio and shape[0] == 1 and tuple(arr.shape) == shape[1:]):
        arr = arr.reshape(1, *shape)
    elif audio and shape[0] == 1 and arr.ndim == 2 and arr.shape[1] == shape[1]:
        arr = arr[:, None, :]
    if arr.ndim != len(shape) + 1 or tuple(arr.shape[1:]) != shape or arr.shape[0] == 0:
        raise DataError(f"{what} has shape {tuple(np.shape(x))}, the model expects (N, {', '.join(map(str, shape))})",
                        hint="audio: 1-s 16 kHz clips (read WAV files with fedge infer); sensor windows: "
                             "(channels, window) each")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise DataError(f"{what} holds {int(arr.size - np.isfinite(arr).sum())} NaN or infinite values",
                        hint="check the microphone or sensor, or the file")
    if audio and float(np.abs(arr).max()) > 1.0:
        raise DataError(f"{what}: audio samples up to {float(np.abs(arr).max()):.4g}, beyond [-1, 1]",
                        hint="scale 16-bit integers by 1/32768 (a WAV file is scaled by fedge infer itself)")
    return arr
