"""The one preprocessing path: raw images → normalized float32 (N, C, S, S), S the model's input size.

Numpy only, because the on-device ONNX runtime uses it too (it must not import
torch). Training, evaluation, calibration and inference all call
:func:`preprocess`, so a model never sees inputs prepared two different ways.

Resizing is bilinear with half-pixel centres (``align_corners=False``), the
same sampling as ``torch.nn.functional.interpolate(mode="bilinear")`` and
torchvision's ``Resize`` without antialiasing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedge.errors import PayloadError

INPUT_KINDS = ("image", "audio", "series")


@dataclass(frozen=True)
class Normalization:
    """Per-dataset input normalization; pixels are first scaled to [0, 1].

    ``kind``: ``image`` inputs are (channels, size, size); ``audio`` (raw samples in [-1, 1]) and ``series``
    (sensor windows) are (channels, size) and pass to the model as they are (mean 0, std 1): an audio model
    computes its own features (:mod:`fedge.edge.models.frontend`)."""

    mean: float
    std: float
    size: int = 32
    channels: int = 1
    kind: str = "image"

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The model's input without the batch axis: (C, S, S) for images, (C, S) otherwise."""
        if self.kind == "image":
            return (self.channels, self.size, self.size)
        return (self.channels, self.size)

    def to_dict(self) -> dict[str, float | int | str]:
        d: dict[str, float | int | str] = {"mean": self.mean, "std": self.std, "size": self.size,
                                           "channels": self.channels}
        if self.kind != "image":  # an image export's manifest stays as it always was
            d["kind"] = self.kind
        return d


def signal_normalization(kind: str, channels: int, samples: int) -> Normalization:
    """The identity normalization of a 1-D input (audio or a sensor window) of ``channels`` x ``samples``."""
    return Normalization(0.0, 1.0, size=samples, channels=channels, kind=kind)


# Means/stds of the training sets after scaling to [0, 1].
NORMALIZATION: dict[str, Normalization] = {
    "fmnist": Normalization(0.2860, 0.3530),
    "mnist": Normalization(0.1307, 0.3081),
    "digits": Normalization(0.3070, 0.3810),
    "cifar10": Normalization(0.4734, 0.2516),  # converted to grey, see datasets.py
}


def _resize_axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = n_in / n_out
    src = (np.arange(n_out, dtype=np.float64) + 0.5) * scale - 0.5
    src = np.clip(src, 0, n_in - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, n_in - 1)
    w = (src - lo).astype(np.float32)
    return lo, hi, w


def resize_bilinear(images: np.ndarray, size: int) -> np.ndarray:
    """Resize (N, C, H, W) float32 images to (N, C, size, size)."""
    h, w = images.shape[2:]
    if h == size and w == size:
        return images
    y0, y1, wy = _resize_axis(h, size)
    x0, x1, wx = _resize_axis(w, size)
    top = images[:, :, y0, :] * (1 - wy)[None, None, :, None] + images[:, :, y1, :] * wy[None, None, :, None]
    out = top[:, :, :, x0] * (1 - wx) + top[:, :, :, x1] * wx
    return out.astype(np.float32)


def preprocess(images: np.ndarray, norm: Normalization, *, max_value: float = 255.0) -> np.ndarray:
    """Raw pixels → model input.

    ``images``: (N, H, W), (N, C, H, W) or (N, H, W, C) with C in {1, 3}, values
    in [0, ``max_value``]. Returns float32 (N, norm.channels, size, size).
    """
    x = np.asarray(images)
    if x.ndim == 2:
        x = x[None]
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4:
        raise PayloadError(f"images must be (N, H, W) or (N, C, H, W), got shape {images.shape}")
    x = x.astype(np.float32) / np.float32(max_value)
    if x.shape[1] == 3 and norm.channels == 1:
        # ITU-R 601 luma, as PIL's convert("L").
        x = (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).astype(np.float32)
    if x.shape[1] == 1 and norm.channels == 3:
        x = np.repeat(x, 3, axis=1)  # a grey image for an RGB model: the same grey in each channel
    if x.shape[1] != norm.channels:
        raise PayloadError(
            f"images have {x.shape[1]} channels, the model expects {norm.channels}",
            hint="pass grey-scale images (or RGB, converted to grey automatically)",
        )
    x = resize_bilinear(x, norm.size)
    return ((x - np.float32(norm.mean)) / np.float32(norm.std)).astype(np.float32)
