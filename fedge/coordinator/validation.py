"""Checks every device message passes before it may touch an aggregate or a report.

Everything here reads untrusted input: each check raises :class:`Rejected` with
a short reason (the counter key of the round report) and a message naming the
device and what was wrong.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedge.common.rounds import DeviceInfo
from fedge.common.tensorcodec import PRECISIONS
from fedge.coordinator.strategy import Arrays, UpdateSpec
from fedge.errors import PayloadError

MAX_SAMPLES = 1 << 31  # per device: keeps every count sum far from int64's range
MAX_FEATURE_DIM = 1 << 16
MAX_TEXT = 256  # characters of an id, arch, profile or an info string
MAX_ENTRIES = 64  # keys of info, metrics, a hello's extra
RESERVED_INFO = ("metrics", "bytes_down")  # kept apart in a round report
MAX_TRAIN_S = 1e7  # info.train_s, the device's seconds of work in a round: ~4 months is surely a lie


class Rejected(PayloadError):
    """An update was refused; ``reason`` is a short counter key (e.g. ``"duplicate"``)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


def _text(value: object, what: str, reason: str = "malformed") -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise Rejected(reason, f"{what} must be a string of 1-{MAX_TEXT} characters, got {str(value)[:40]!r}")
    return value


def _count(value: object, what: str, limit: int, reason: str = "malformed") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise Rejected(reason, f"{what} must be an integer in [0, {limit}], got {str(value)[:40]!r}")
    return value


def _scalar(value: object) -> bool:
    """A JSON scalar fedge keeps in a report: finite number, bool, null or a short string."""
    if value is None or isinstance(value, bool | int):
        return not isinstance(value, int) or abs(value) < 1 << 63
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= MAX_TEXT


def _scalars(value: object, what: str, reason: str) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > MAX_ENTRIES:
        raise Rejected(reason, f"{what} must be an object of at most {MAX_ENTRIES} entries, "
                               f"got {type(value).__name__}")
    for k, v in value.items():
        if len(k) > MAX_TEXT or not _scalar(v):
            raise Rejected(reason, f"{what}[{k[:40]!r}] must be a number, bool, null or a short string")
    return dict(value)


def parse_device(raw: object) -> DeviceInfo:
    """A hello's ``info.device`` with every field's type and range checked."""
    if not isinstance(raw, dict):
        raise Rejected("malformed", f"hello info.device must be an object, got {type(raw).__name__}")
    known = {"device_id", "arch", "profile", "upload_precision", "num_samples", "feature_dim", "extra"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise Rejected("malformed", f"hello info.device has unknown fields {[u[:40] for u in unknown[:5]]}")
    precision = raw.get("upload_precision", "fp32")
    if precision not in PRECISIONS:
        raise Rejected("malformed", f"hello upload_precision {str(precision)[:16]!r} is not one of {PRECISIONS}")
    return DeviceInfo(
        device_id=_text(raw.get("device_id"), "hello device_id"),
        arch=_text(raw.get("arch"), "hello arch"),
        profile=_text(raw.get("profile"), "hello profile"),
        upload_precision=str(precision),
        num_samples=_count(raw.get("num_samples", 0), "hello num_samples", MAX_SAMPLES),
        feature_dim=_count(raw.get("feature_dim", 0), "hello feature_dim", MAX_FEATURE_DIM),
        extra=_scalars(raw.get("extra", {}), "hello extra", "malformed"),
    )


def parse_update_info(info: dict[str, Any], device: DeviceInfo) -> tuple[dict[str, float], int, dict[str, Any]]:
    """(metrics, bytes_down, the other info scalars) of an update, every type checked.

    ``metrics`` maps names to finite numbers, ``bytes_down`` is a non-negative integer,
    ``num_samples`` (if sent) equals the device's registered sample count, and every
    other value is a JSON scalar: what a round report and ``state.json`` can hold.
    """
    metrics = _scalars(info.get("metrics", {}), f"{device.device_id}: info.metrics", "info")
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise Rejected("info", f"{device.device_id}: metric {k[:40]!r} must be a number, got {str(v)[:40]!r}")
    down = _count(info.get("bytes_down", 0), f"{device.device_id}: info.bytes_down", 1 << 62, "info")
    if "num_samples" in info and info["num_samples"] != device.num_samples:
        raise Rejected("info", f"{device.device_id}: info.num_samples {str(info['num_samples'])[:20]} differs "
                               f"from its hello's {device.num_samples}")
    rest = _scalars({k: v for k, v in info.items() if k not in RESERVED_INFO}, f"{device.device_id}: info", "info")
    if "train_s" in rest:
        t = rest["train_s"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= MAX_TRAIN_S:
            raise Rejected("info", f"{device.device_id}: info.train_s must be seconds in [0, {MAX_TRAIN_S:g}], "
                                   f"got {str(t)[:40]!r}")
    return {k: float(v) for k, v in metrics.items()}, down, rest


def check_arrays(arrays: Arrays, spec: UpdateSpec | None, sender: str, device: DeviceInfo | None = None) -> None:
    """Names, shapes, dtype kinds exactly as ``spec``; every float finite; counts within the device's samples.

    Integer tensors in an update are class counts: each entry is >= 0 and, with ``device``,
    their sum is at most the device's registered sample count (so no sum of counts over a
    fleet can overflow, and no device can outweigh its data).
    """
    if spec is not None:
        missing = sorted(set(spec) - set(arrays))
        extra = sorted(set(arrays) - set(spec))
        if missing or extra:
            raise Rejected(
                "schema",
                f"update from {sender} has wrong tensor names (missing {missing[:5]}, unexpected {extra[:5]})",
            )
        for name, (shape, kind) in spec.items():
            arr = arrays[name]
            if tuple(arr.shape) != tuple(shape):
                raise Rejected(
                    "shape", f"{sender}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}"
                )
            is_float = np.issubdtype(arr.dtype, np.floating)
            if (kind == "float") != is_float:
                raise Rejected("dtype", f"{sender}: tensor {name!r} has dtype {arr.dtype}, expected {kind}")
    for name, arr in arrays.items():
        if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
            raise Rejected("nonfinite", f"{sender}: tensor {name!r} contains NaN or Inf")
        if np.issubdtype(arr.dtype, np.integer) and arr.size:
            if arr.min() < 0:
                raise Rejected("negative", f"{sender}: integer tensor {name!r} has negative entries")
            if device is not None:
                # max first: with every entry <= num_samples (< 2**31) the int64 sum below cannot wrap
                total = int(arr.max()) if int(arr.max()) > device.num_samples else int(arr.sum(dtype=np.int64))
                if total > device.num_samples:
                    raise Rejected("counts", f"{sender}: counts in {name!r} sum to at least {total}, more than "
                                             f"its {device.num_samples} samples")
