"""Reading inference inputs from files: PNG/JPEG images (PIL, imported lazily), ``.npy`` arrays, and for audio
and sensor models WAV clips and ``.csv`` windows (:mod:`fedge.runtime.signals`).

Raw pixels go through :func:`fedge.common.preprocess.preprocess`, the same
function training used, so a device sees inputs prepared exactly as in training.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.common.preprocess import Normalization, preprocess
from fedge.errors import FedgeError, PayloadError
from fedge.runtime.signals import AUDIO_SUFFIXES, WINDOW_SUFFIXES, check_signal_batch, fit_clip, read_wav, read_window

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".pgm", ".ppm", ".tif", ".tiff")


@dataclass(frozen=True)
class Batch:
    """Model inputs (N, C, S, S) float32 and one label per row (``file`` or ``file[i]``)."""

    x: np.ndarray
    names: tuple[str, ...]


SINGLE_IMAGE_RULE = (
    "a 3-D array whose last axis is 1 or 3 is one image (H, W, C); any other 3-D array is a batch (N, H, W)"
)


def largest_normalized(norm: Normalization) -> float:
    """The largest magnitude a preprocessed pixel can have: pixels in [0, 1], normalized."""
    return max(abs(norm.mean), abs(1.0 - norm.mean)) / norm.std


def _nonfinite(arr: np.ndarray, what: str) -> PayloadError:
    bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
    return PayloadError(f"{what} holds {bad} NaN or infinite values (of {arr.size}): no prediction can be made",
                        hint="check the sensor or the file; every pixel must be a finite number")


def check_model_input(x: np.ndarray, norm: Normalization, *, what: str = "input") -> np.ndarray:
    """Validate an already preprocessed batch: (N, C, S, S) (a single (C, S, S) gets a batch axis).

    Refused: NaN or infinite values, and arrays whose root mean square exceeds twice
    the largest magnitude a normalized pixel can have (for digits 2 x 1.82): no
    preprocessed input is that large, raw 0..255 pixels almost always are.
    """
    arr = np.asarray(x)
    if arr.ndim == 3:
        arr = arr[None]
    want = (norm.channels, norm.size, norm.size)
    if arr.ndim != 4 or tuple(arr.shape[1:]) != want:
        raise PayloadError(
            f"{what} has shape {tuple(np.shape(x))}, the model expects (N, {want[0]}, {want[1]}, {want[2]})",
            hint="pass raw images instead (they are resized and normalized), or preprocess to that shape",
        )
    if arr.shape[0] == 0:
        raise PayloadError(f"{what} holds no images")
    if not np.issubdtype(arr.dtype, np.floating):
        raise PayloadError(f"{what} is {arr.dtype}, preprocessed inputs must be floating point",
                           hint="raw pixel arrays must not be marked as preprocessed")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    check_preprocessed_values(arr, norm, what=what)
    return arr


def check_preprocessed_values(x: np.ndarray, norm: Normalization, *, what: str = "input") -> None:
    """NaN/infinity and raw-pixel check of a float32 (N, C, S, S) batch: one BLAS dot product.

    ``vdot(x, x)`` is finite exactly when every value is (short of overflow, which
    only values beyond 1e17 reach, and which the root-mean-square bound refuses anyway).
    """
    ss = float(np.vdot(x, x))
    if math.isfinite(ss) and math.sqrt(ss / x.size) <= 2.0 * largest_normalized(norm):
        return
    if not np.isfinite(x).all():
        raise _nonfinite(x, what)
    bound = largest_normalized(norm)
    raise PayloadError(
        f"{what} does not look preprocessed: its root mean square is {math.sqrt(ss / x.size):.3g}, but normalized "
        f"pixels lie within ±{bound:.2f} (mean {norm.mean:g}, std {norm.std:g}); these look like raw pixels",
        hint="pass raw images without --preprocessed (preprocessed=False): they are resized and normalized",
    )


def is_single_image(arr: np.ndarray) -> bool:
    """Whether a raw-pixel array is one image rather than a batch (see :data:`SINGLE_IMAGE_RULE`)."""
    return arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (1, 3))


def check_pixel_values(arr: np.ndarray, *, max_value: float, what: str) -> None:
    """Raw pixels must be finite and within 0..``max_value``; say what the array looks like otherwise.

    A float array with a negative value cannot be raw pixels: a preprocessed input of
    any fedge data set has one wherever a pixel is darker than the data set's mean.
    With the default 0..255 range, a float array whose values all lie in (0, 1] is
    refused as ambiguous (an image scaled to 0..1 would be read as almost black).
    """
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise PayloadError(f"{what} is {arr.dtype}: raw pixels must be integers or floats")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise _nonfinite(arr, what)
    lo, hi = float(arr.min()), float(arr.max())
    if lo < 0:
        looks = (" (this looks like an already preprocessed model input)" if arr.dtype.kind == "f" else "")
        raise PayloadError(
            f"{what} holds negative values (min {lo:.3g}): raw pixels are 0..{max_value:g}{looks}",
            hint="pass model inputs with --preprocessed (preprocessed=True), or raw pixels 0..255",
        )
    if hi > max_value:
        raise PayloadError(
            f"{what} has values up to {hi:.6g}, above the raw pixel range 0..{max_value:g}",
            hint="16-bit pixels: pass max_value=65535 (image files are scaled automatically); "
                 "otherwise scale the array to 0..255",
        )
    if max_value == 255.0 and arr.dtype.kind == "f" and 0 < hi <= 1.0:
        raise PayloadError(
            f"{what} holds floats within 0..1 (max {hi:.3g}), but raw pixels are 0..255: read as such, "
            "the image would be almost black",
            hint="multiply by 255, or pass max_value=1.0 if the pixels are scaled to 0..1",
        )


def prepare(images: np.ndarray, norm: Normalization, *, max_value: float = 255.0,
            what: str = "images") -> np.ndarray:
    """Raw pixels → model input (N, C, S, S).

    Accepted: (H, W) or (H, W, C) (one image), (N, H, W), (N, C, H, W) or (N, H, W, C),
    C in {1, 3}, values in 0..``max_value`` (see :func:`check_pixel_values`).
    """
    arr = np.asarray(images)
    if arr.size == 0 or any(d == 0 for d in arr.shape):
        raise PayloadError(f"{what} is empty (shape {arr.shape})")
    if arr.ndim not in (2, 3, 4):
        raise PayloadError(f"{what} has shape {arr.shape}; expected (H, W), (H, W, C), (N, H, W), (N, C, H, W) "
                           "or (N, H, W, C)")
    if arr.ndim == 3 and arr.shape[-1] == 4:
        raise PayloadError(f"{what} has shape {arr.shape}: one RGBA image (H, W, 4)? The model takes grey or RGB",
                           hint="drop the alpha channel (image[..., :3]), or pass a batch of grey images (N, H, W)")
    if is_single_image(arr) and arr.ndim == 3:
        arr = arr[None]  # one (H, W, C) image, not H images of W x C pixels
    if arr.ndim == 4:
        if arr.shape[1] in (1, 3):
            hw = arr.shape[2:]
        elif arr.shape[-1] in (1, 3):
            hw = arr.shape[1:3]
        else:
            raise PayloadError(
                f"{what} has shape {arr.shape}: no axis of 1 or 3 channels; the model expects {norm.channels}",
                hint="pass grey-scale (1 channel) or RGB (3 channels) images",
            )
    else:
        hw = arr.shape[-2:]
    if min(hw) < 2:
        raise PayloadError(f"{what} has shape {arr.shape}: images must be at least 2x2 pixels")
    check_pixel_values(arr, max_value=max_value, what=what)
    try:
        return preprocess(arr, norm, max_value=max_value)
    except PayloadError as exc:
        raise PayloadError(f"{what}: {exc.message}", hint=exc.hint) from exc


# Pillow modes of 16-bit grey images (PNG, TIFF); converting them to "L" would clip at 255.
_MODES_16BIT = ("I;16", "I;16B", "I;16L", "I;16N")


def read_image(path: str | os.PathLike[str], channels: int) -> tuple[np.ndarray, float]:
    """An image file as (H, W) grey or (H, W, 3) RGB pixels, and their full-scale value.

    8-bit images give uint8 and 255; 16-bit grey images (PNG, TIFF) keep their 16 bits
    and give 65535, so they are scaled, not clipped.
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # a runtime install without Pillow: say which extra brings it
        from fedge.common.extras import missing_extra

        raise (missing_extra(exc) or exc) from exc
    try:
        with Image.open(path) as img:
            if img.mode in _MODES_16BIT or img.mode == "I":
                arr = np.asarray(img)
                if arr.min() < 0 or arr.max() > 65535:
                    raise PayloadError(f"{path}: a 32-bit integer image with values outside 0..65535",
                                       hint="save it as an 8- or 16-bit image")
                if img.mode == "I" and arr.max() <= 255:
                    # A 32-bit container says nothing of the pixels' range: 8-bit pixels scaled as
                    # 16-bit would read as an almost black image, a silently wrong answer.
                    raise PayloadError(f"{path}: a 32-bit integer image whose values all lie within 0..255 "
                                       f"(max {int(arr.max())}): 8-bit or 16-bit pixels?",
                                       hint="save it as an 8-bit (or 16-bit) image, so that its range is known")
                if channels != 1:
                    arr = np.repeat(arr[:, :, None], 3, axis=2)
                return arr.astype(np.uint16), 65535.0
            if img.mode == "F":
                raise PayloadError(f"{path}: a 32-bit floating point image; pixels must be 8 or 16-bit",
                                   hint="save it as an 8- or 16-bit image, or pass a .npy array of 0..255 pixels")
            return np.asarray(img.convert("L" if channels == 1 else "RGB")), 255.0
    except (OSError, UnidentifiedImageError) as exc:
        raise PayloadError(f"{path}: not a readable image ({exc})") from exc


def read_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """A ``.npy`` array (no pickles)."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PayloadError(f"{path}: not a readable .npy array ({exc})") from exc


INPUT_SUFFIXES = (*IMAGE_SUFFIXES, ".npy", *AUDIO_SUFFIXES, ".csv")


def expand_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files to classify: each file as given, each directory's images and ``.npy`` arrays (sorted, not recursive)."""
    if not paths:
        raise PayloadError("no inputs given")
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in INPUT_SUFFIXES)
            if not found:
                raise PayloadError(
                    f"{path}: a directory with no images, .npy arrays, WAV clips or .csv windows",
                    hint=f"a directory input is classified file by file: put images ({', '.join(IMAGE_SUFFIXES)}) "
                         "or .npy arrays directly in it (subdirectories are not searched)",
                )
            skipped = sum(1 for f in path.iterdir() if f not in found)
            if skipped:
                log.info("%s: %d entries are not images or .npy arrays and are skipped", path, skipped)
            files += found
        elif not path.exists():
            raise PayloadError(f"{path}: no such file or directory")
        else:
            files.append(path)
    return files


def load_inputs(paths: Sequence[str | os.PathLike[str]], norm: Normalization, *,
                preprocessed: bool = False) -> Batch:
    """Read files (and directories' images, see :func:`expand_inputs`) into one batch.

    ``.npy`` files hold raw pixels unless ``preprocessed``; a raw array is one image
    or a batch by :data:`SINGLE_IMAGE_RULE`. An audio or sensor model (``norm.kind``) reads
    :func:`load_signal_inputs` instead.
    """
    if norm.kind != "image":
        return load_signal_inputs(paths, norm)
    xs: list[np.ndarray] = []
    names: list[str] = []
    for path in expand_inputs(paths):
        suffix = path.suffix.lower()
        if suffix == ".npy":
            arr = read_npy(path)
            x = check_model_input(arr, norm, what=str(path)) if preprocessed else prepare(arr, norm, what=str(path))
            single = (arr.ndim == 3) if preprocessed else is_single_image(arr)
            names += [str(path)] if single else [f"{path}[{i}]" for i in range(len(x))]
        elif suffix in IMAGE_SUFFIXES:
            pixels, full_scale = read_image(path, norm.channels)
            x = prepare(pixels, norm, max_value=full_scale, what=str(path))
            names.append(str(path))
        else:
            raise PayloadError(f"{path}: unsupported input type {suffix or '(none)'}",
                               hint=f"pass images ({', '.join(IMAGE_SUFFIXES)}) or .npy arrays")
        xs.append(x)
    return Batch(np.concatenate(xs), tuple(names))


def prepare_signal(x: np.ndarray, norm: Normalization, *, what: str = "input") -> np.ndarray:
    """Audio clips or sensor windows as the model's batch (N, *norm.sample_shape), checked (see
    :func:`fedge.runtime.signals.check_signal_batch`); they need no preprocessing."""
    try:
        return check_signal_batch(x, norm.sample_shape, audio=norm.kind == "audio", what=what)
    except FedgeError as exc:
        raise PayloadError(exc.message, hint=exc.hint) from exc


def load_signal_inputs(paths: Sequence[str | os.PathLike[str]], norm: Normalization) -> Batch:
    """WAV clips (an audio model), ``.csv`` windows (a sensor model) and ``.npy`` arrays of model inputs into
    one batch. A WAV is read as mono 16 kHz and cut or padded to the model's clip; a ``.csv`` or a 2-D sensor
    ``.npy`` is one (window, channels) window; any other ``.npy`` is a clip or a batch of model inputs."""
    audio = norm.kind == "audio"
    wanted = (*AUDIO_SUFFIXES, ".npy") if audio else WINDOW_SUFFIXES
    xs: list[np.ndarray] = []
    names: list[str] = []
    for path in expand_inputs(paths):
        suffix = path.suffix.lower()
        try:
            if suffix not in wanted:
                raise PayloadError(f"{path}: a {norm.kind} model does not read {suffix or 'files without a suffix'}",
                                   hint=f"pass {' or '.join(wanted)} files")
            if suffix in AUDIO_SUFFIXES:
                x = prepare_signal(fit_clip(read_wav(path), norm.size), norm, what=str(path))
            elif suffix == ".csv" or (not audio and read_npy(path).ndim == 2):  # one (window, channels) window
                x = prepare_signal(read_window(path, norm.size, norm.channels), norm, what=str(path))
            else:
                x = prepare_signal(read_npy(path), norm, what=str(path))
        except FedgeError as exc:
            raise PayloadError(exc.message, hint=exc.hint) from exc
        names += [str(path)] if len(x) == 1 else [f"{path}[{i}]" for i in range(len(x))]
        xs.append(x)
    return Batch(np.concatenate(xs), tuple(names))
