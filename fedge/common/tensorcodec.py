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

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import safetensors.numpy

from fedge.common import boundedjson
from fedge.errors import PayloadError

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
SCALE_PREFIX = "__scale__/"


# Header limits: a safetensors header is a flat map of name -> {dtype, shape, data_offsets}, so two
# levels of nesting (three with the shape lists) is all a valid one has.
MAX_HEADER_BYTES = 8 << 20
MAX_HEADER_DEPTH = 3
MAX_DIMS = 8
# Bytes per element of every dtype fedge puts on the wire, and the kind each decodes to.
DTYPE_BYTES = {"F32": 4, "F16": 2, "I8": 1, "I32": 4, "I64": 8}
FLOAT_DTYPES = frozenset({"F32", "F16"})
INT_DTYPES = frozenset({"I32", "I64"})
# name -> (shape, kind "float" | "int"): what a receiver expects (``fedge.coordinator.strategy.UpdateSpec``)
TensorSpec = Mapping[str, tuple[tuple[int, ...], str]]


class OversizeError(PayloadError):
    """A payload is larger than the limit its receiver set."""


class SchemaError(PayloadError):
    """Declared tensors differ from what the receiver expects; ``reason``: ``schema``, ``shape`` or ``dtype``."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header declares it (checked before anything is allocated)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PayloadError(f"{what} must be a non-negative integer, got {value!r}"[:200])
    return value


def check_layout(header: Mapping[str, object], data_bytes: int) -> dict[str, TensorEntry]:
    """Validate every declared tensor of a parsed header against the data section's size.

    Dtypes must be ones fedge sends, shapes lists of at most :data:`MAX_DIMS` non-negative
    integers, offsets must tile the data section exactly, and every ``__scale__/x`` must be
    a float32 scalar next to an int8 tensor ``x`` (and every int8 tensor must have one).
    Nothing is allocated: this runs before the tensors are read.
    """
    entries: dict[str, TensorEntry] = {}
    for name, raw in header.items():
        if not isinstance(raw, dict):
            raise PayloadError(f"tensor {name[:64]!r}: header entry is not an object")
        dtype = raw.get("dtype")
        if dtype not in DTYPE_BYTES:
            raise SchemaError("dtype", f"tensor {name[:64]!r} has dtype {str(dtype)[:16]!r}; "
                                       f"fedge sends {', '.join(DTYPE_BYTES)}")
        shape, offsets = raw.get("shape"), raw.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise PayloadError(f"tensor {name[:64]!r}: shape must be a list of at most {MAX_DIMS} sizes")
        dims = tuple(_int(d, f"tensor {name[:64]!r} shape entry") for d in shape)
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise PayloadError(f"tensor {name[:64]!r}: data_offsets must be [begin, end]")
        begin, end = (_int(o, f"tensor {name[:64]!r} data offset") for o in offsets)
        if math.prod(dims) * DTYPE_BYTES[str(dtype)] != end - begin:
            raise PayloadError(f"tensor {name[:64]!r}: shape {dims} of {dtype} does not fill "
                               f"data_offsets [{begin}, {end}]")
        entries[name] = TensorEntry(str(dtype), dims, begin, end)
    spans = sorted((e.begin, e.end) for e in entries.values())
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise PayloadError(f"tensor data offsets overlap or leave a gap at byte {pos}")
        pos = end
    if pos != data_bytes:
        raise PayloadError(f"tensors declare {pos} data bytes but {data_bytes} follow the header")
    for name, e in entries.items():
        if name.startswith(SCALE_PREFIX):
            target = entries.get(name[len(SCALE_PREFIX):])
            if e.dtype != "F32" or e.shape != ():
                raise SchemaError("dtype", f"{name[:64]!r} must be a float32 scalar, got {e.dtype} {e.shape}")
            if target is None or target.dtype != "I8":
                raise SchemaError("schema", f"{name[:64]!r} scales no int8 tensor")
        elif e.dtype == "I8" and SCALE_PREFIX + name not in entries:
            raise SchemaError("dtype", f"int8 tensor {name[:64]!r} has no {SCALE_PREFIX} scale")
    return entries


def kind_of(entry: TensorEntry) -> str:
    """``float`` or ``int``: what the tensor decodes to (int8 with a scale decodes to float)."""
    return "int" if entry.dtype in INT_DTYPES else "float"


def check_spec(entries: Mapping[str, TensorEntry], spec: TensorSpec, sender: str) -> None:
    """Names, shapes and kinds exactly as ``spec`` (run on the header, before decoding)."""
    names = {n for n in entries if not n.startswith(SCALE_PREFIX)}
    missing, extra = sorted(set(spec) - names), sorted(names - set(spec))
    if missing or extra:
        raise SchemaError("schema", f"update from {sender} has wrong tensor names "
                                    f"(missing {missing[:5]}, unexpected {[n[:64] for n in extra[:5]]})")
    for name, (shape, kind) in spec.items():
        e = entries[name]
        if e.shape != tuple(shape):
            raise SchemaError("shape", f"{sender}: tensor {name!r} has shape {e.shape}, expected {tuple(shape)}")
        if kind_of(e) != kind:
            raise SchemaError("dtype", f"{sender}: tensor {name!r} has dtype {e.dtype}, expected {kind}")


def max_encoded_bytes(spec: TensorSpec, header_bytes: int) -> int:
    """Largest valid encoding of ``spec``: fp32 floats or int64 ints, plus ``header_bytes`` of header."""
    raw = sum(math.prod(shape) * (4 if kind == "float" else 8) + 4 for shape, kind in spec.values())
    return 8 + header_bytes + raw


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


def header_length(data: bytes) -> int:
    """Bytes of the JSON header of ``data`` (checked against the payload's size)."""
    if len(data) < 8:
        raise PayloadError(f"payload of {len(data)} bytes is too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > len(data) - 8:
        raise PayloadError(
            f"payload header claims {hlen} bytes but only {len(data) - 8} follow (truncated?)"
        )
    return int(hlen)


def read_header(data: bytes) -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Parse and sanity-check the safetensors header of ``data``.

    Returns (tensor entries, metadata). Raises :class:`PayloadError` naming the
    problem for truncated, oversize, too deeply nested or non-JSON headers.
    """
    hlen = header_length(data)
    header = boundedjson.loads(data[8 : 8 + hlen], max_bytes=MAX_HEADER_BYTES, max_depth=MAX_HEADER_DEPTH,
                               what="payload header")
    if not isinstance(header, dict):
        raise PayloadError("payload header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PayloadError("payload __metadata__ must map strings to strings")
    return header, meta


def check_size(data: bytes, max_bytes: int | None) -> None:
    """:class:`OversizeError` if ``data`` is longer than ``max_bytes`` (None: no limit)."""
    if max_bytes is not None and len(data) > max_bytes:
        raise OversizeError(
            f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes",
            hint="raise the size limit or send at a lower upload precision",
        )


def load_tensors(data: bytes, header: Mapping[str, object], spec: TensorSpec | None = None,
                 sender: str = "sender") -> dict[str, np.ndarray]:
    """The tensors of ``data`` (whose parsed header is ``header``), dequantized to float32.

    The declared layout is checked first (:func:`check_layout`) and, with ``spec``, every
    name, shape and kind against it (:func:`check_spec`): a payload that declares anything
    else is refused before a byte of it is copied or broadcast.
    """
    entries = check_layout(header, len(data) - 8 - header_length(data))
    if spec is not None:
        check_spec(entries, spec, sender)
    try:
        tensors = safetensors.numpy.load(bytes(data))
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise PayloadError(f"payload tensors could not be decoded: {exc}") from exc
    return dequantize(tensors)


def decode(data: bytes, *, max_bytes: int | None = None, spec: TensorSpec | None = None) -> Payload:
    """Decode safetensors bytes into a float32 :class:`Payload`.

    ``max_bytes`` rejects oversize payloads before anything is parsed; ``spec`` (name ->
    (shape, kind)) rejects any other tensors before they are read (:class:`SchemaError`).
    """
    check_size(data, max_bytes)
    header, meta = read_header(data)
    tensors = load_tensors(data, header, spec)
    meta.pop("fedge.precision", None)
    return Payload(tensors=tensors, meta=meta)
