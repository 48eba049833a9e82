"""Name-keyed tensors <-> bytes, in the safetensors format (no pickle).

Layout (the safetensors format, see https://huggingface.co/docs/safetensors):
8-byte little-endian header length, a JSON header mapping each tensor name to
``dtype``/``shape``/``data_offsets`` plus a ``__metadata__`` map of strings, then
the raw little-endian bytes. The same bytes are produced and read by numpy,
torch, or a 30-line parser in any language, which is why the wire protocol uses
it.

Upload precision is applied here, per floating tensor:

* ``fp32``: unchanged.
* ``fp16``: cast to IEEE half.
* ``int8``: symmetric per-tensor quantization ``q = round(x / s)``, ``s = max|x| / 127``;
  the scale travels as a float32 scalar tensor named ``__scale__/<name>``.

Integer tensors (class counts, labels) are never quantized. Decoding always
returns float32 for floating tensors, so code above this layer never sees the
wire precision.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import safetensors.numpy

from fedge.errors import PayloadError

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
SCALE_PREFIX = "__scale__/"


class OversizeError(PayloadError):
    """A payload is larger than the limit its receiver set."""


@dataclass
class Payload:
    """Named arrays plus string metadata: the unit that crosses every transport."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Raw size of the tensors (not the encoding)."""
        return sum(int(a.nbytes) for a in self.tensors.values())


def check_precision(precision: str) -> Precision:
    """Return ``precision`` if it is one fedge knows, else raise a clear error."""
    if precision not in PRECISIONS:
        raise PayloadError(
            f"unknown upload precision {precision!r}",
            hint=f"use one of {', '.join(PRECISIONS)}",
        )
    return precision  # type: ignore[return-value]


def quantize(tensors: Mapping[str, np.ndarray], precision: str) -> dict[str, np.ndarray]:
    """Apply an upload precision to the floating tensors of ``tensors``."""
    check_precision(precision)
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name.startswith(SCALE_PREFIX):
            raise PayloadError(f"tensor name {name!r} uses the reserved prefix {SCALE_PREFIX!r}")
        arr = np.ascontiguousarray(value)
        if not np.issubdtype(arr.dtype, np.floating) or precision == "fp32":
            out[name] = arr.astype(np.float32) if np.issubdtype(arr.dtype, np.floating) else arr
        elif precision == "fp16":
            out[name] = arr.astype(np.float16)
        else:
            amax = float(np.max(np.abs(arr))) if arr.size else 0.0
            scale = amax / 127.0 if amax > 0 and np.isfinite(amax) else 1.0
            out[name] = np.clip(np.rint(arr / scale), -127, 127).astype(np.int8)
            out[SCALE_PREFIX + name] = np.asarray(scale, dtype=np.float32)
    return out


def dequantize(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Invert :func:`quantize`: floating tensors come back as float32."""
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name.startswith(SCALE_PREFIX):
            continue
        scale = tensors.get(SCALE_PREFIX + name)
        if scale is not None:
            out[name] = arr.astype(np.float32) * np.float32(scale)
        elif np.issubdtype(arr.dtype, np.floating):
            out[name] = arr.astype(np.float32)
        else:
            out[name] = arr
    return out


def encode(payload: Payload, precision: str = "fp32") -> bytes:
    """Encode ``payload`` to safetensors bytes at the given upload precision."""
    for key, value in payload.meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise PayloadError(f"metadata must map str to str, got {key!r}: {type(value).__name__}")
    tensors = quantize(payload.tensors, precision)
    meta = dict(payload.meta)
    meta["fedge.precision"] = precision
    return bytes(safetensors.numpy.save(tensors, metadata=meta))


def read_header(data: bytes) -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Parse and sanity-check the safetensors header of ``data``.

    Returns (tensor entries, metadata). Raises :class:`PayloadError` naming the
    problem for truncated, oversize or non-JSON headers.
    """
    if len(data) < 8:
        raise PayloadError(f"payload of {len(data)} bytes is too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > len(data) - 8:
        raise PayloadError(
            f"payload header claims {hlen} bytes but only {len(data) - 8} follow (truncated?)"
        )
    try:
        header = json.loads(data[8 : 8 + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"payload header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise PayloadError("payload header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PayloadError("payload __metadata__ must map strings to strings")
    return header, meta


def decode(data: bytes, *, max_bytes: int | None = None) -> Payload:
    """Decode safetensors bytes into a float32 :class:`Payload`.

    ``max_bytes`` rejects oversize payloads before anything is parsed.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise OversizeError(
            f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes",
            hint="raise the size limit or send at a lower upload precision",
        )
    _, meta = read_header(data)
    try:
        tensors = safetensors.numpy.load(bytes(data))
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise PayloadError(f"payload tensors could not be decoded: {exc}") from exc
    meta.pop("fedge.precision", None)
    return Payload(tensors=dequantize(tensors), meta=meta)
