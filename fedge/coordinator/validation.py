"""Checks every update passes before it may touch an aggregate."""

from __future__ import annotations

import numpy as np

from fedge.coordinator.strategy import Arrays, UpdateSpec
from fedge.errors import PayloadError


class Rejected(PayloadError):
    """An update was refused; ``reason`` is a short counter key (e.g. ``"duplicate"``)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


def check_arrays(arrays: Arrays, spec: UpdateSpec | None, sender: str) -> None:
    """Names, shapes, dtype kinds exactly as ``spec``; every float finite."""
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
        if np.issubdtype(arr.dtype, np.integer) and arr.size and arr.min() < 0:
            raise Rejected("negative", f"{sender}: integer tensor {name!r} has negative entries")
