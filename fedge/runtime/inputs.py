"""Reading inference inputs from files: PNG/JPEG images (PIL, imported lazily) and ``.npy`` arrays.

Raw pixels go through :func:`fedge.common.preprocess.preprocess`, the same
function training used, so a device sees inputs prepared exactly as in training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.common.preprocess import Normalization, preprocess
from fedge.errors import PayloadError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".pgm", ".ppm")


@dataclass(frozen=True)
class Batch:
    """Model inputs (N, C, S, S) float32 and one label per row (``file`` or ``file[i]``)."""

    x: np.ndarray
    names: tuple[str, ...]


def check_model_input(x: np.ndarray, norm: Normalization, *, what: str = "input") -> np.ndarray:
    """Validate an already preprocessed batch: (N, C, S, S) (a single (C, S, S) gets a batch axis)."""
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
    return np.ascontiguousarray(arr, dtype=np.float32)


def prepare(images: np.ndarray, norm: Normalization, *, max_value: float = 255.0,
            what: str = "images") -> np.ndarray:
    """Raw pixels (H, W), (N, H, W), (N, C, H, W) or (N, H, W, C) → model input (N, C, S, S)."""
    arr = np.asarray(images)
    if arr.size == 0 or any(d == 0 for d in arr.shape):
        raise PayloadError(f"{what} is empty (shape {arr.shape})")
    if arr.ndim not in (2, 3, 4):
        raise PayloadError(f"{what} has shape {arr.shape}; expected (H, W), (N, H, W), (N, C, H, W) or (N, H, W, C)")
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
    try:
        return preprocess(arr, norm, max_value=max_value)
    except PayloadError as exc:
        raise PayloadError(f"{what}: {exc.message}", hint=exc.hint) from exc


def read_image(path: str | os.PathLike[str], channels: int) -> np.ndarray:
    """An image file as uint8 (H, W) (grey) or (H, W, 3) (RGB)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # a runtime install without Pillow: say which extra brings it
        from fedge.common.extras import missing_extra

        raise (missing_extra(exc) or exc) from exc
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("L" if channels == 1 else "RGB"))
    except (OSError, UnidentifiedImageError) as exc:
        raise PayloadError(f"{path}: not a readable image ({exc})") from exc


def read_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """A ``.npy`` array (no pickles)."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PayloadError(f"{path}: not a readable .npy array ({exc})") from exc


def load_inputs(paths: list[str | os.PathLike[str]], norm: Normalization, *, preprocessed: bool = False) -> Batch:
    """Read files into one batch. ``.npy`` files hold raw pixels unless ``preprocessed``."""
    xs: list[np.ndarray] = []
    names: list[str] = []
    if not paths:
        raise PayloadError("no inputs given")
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise PayloadError(f"{path}: no such file")
        suffix = path.suffix.lower()
        if suffix == ".npy":
            arr = read_npy(path)
            x = check_model_input(arr, norm, what=str(path)) if preprocessed else prepare(arr, norm, what=str(path))
            single = (arr.ndim == 2) or (arr.ndim == 3 and preprocessed)
            names += [str(path)] if single else [f"{path}[{i}]" for i in range(len(x))]
        elif suffix in IMAGE_SUFFIXES:
            x = prepare(read_image(path, norm.channels)[None], norm, what=str(path))
            names.append(str(path))
        else:
            raise PayloadError(f"{path}: unsupported input type {suffix or '(none)'}",
                               hint=f"pass images ({', '.join(IMAGE_SUFFIXES)}) or .npy arrays")
        xs.append(x)
    return Batch(np.concatenate(xs), tuple(names))
