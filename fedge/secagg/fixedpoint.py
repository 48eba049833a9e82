"""Fixed-point encoding of float vectors into Z_{2^k}, with clipping, sized so that a group's sum cannot wrap.

A vector is laid out in **segments** (:class:`Segment`: a name, a shape and a clipping range ``clip``). Each
value x of a segment is clipped to [−clip, clip] and encoded as the integer q = round((x + clip) · scale) in
[0, L], L = ⌊2 · clip · scale⌋. With ``levels = ⌊(2^k − 1) / n⌋`` for a group of at most n devices, every
segment's scale is ``levels / (2 · clip)``, so L ≤ levels and the sum of n encodings is at most n · levels
< 2^k: the sum mod 2^k *is* the integer sum, and :meth:`FieldPlan.decode_sum` recovers Σx from it exactly up to
rounding — at most n / (2 · scale) per coordinate (:meth:`FieldPlan.max_error`).

:func:`plan_field` chooses k: given ``field_bits`` it checks that the step 2 · clip / levels is still fine
enough; with ``field_bits = 0`` it takes the smaller of 32 and 64 bits whose step is at most
:data:`AUTO_RESOLUTION` of the range. Values are clipped on the device: clipping is the one protection of the
coordinator's robust aggregation that survives masking (docs/security.md#secure-aggregation).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedge.errors import ConfigError, PayloadError


def word_dtype(bits: int) -> type[np.unsignedinteger]:
    """The unsigned word that holds Z_{2^bits} (sums wrap in it exactly; narrower fields are masked).

    Here, not in :mod:`fedge.secagg.crypto`: the fleet config reads :mod:`fedge.secagg.terms` (which needs this
    module), and loading a config — ``fedge infer`` on the runtime install included — must not import
    ``cryptography``."""
    return np.uint32 if bits <= 32 else np.uint64


AUTO_RESOLUTION = 2.0**-20  # field_bits = 0: the smallest word whose step is at most this share of [-clip, clip]
MIN_RESOLUTION = 2.0**-12  # an explicit field_bits whose step is coarser than this is refused
MIN_BITS, MAX_BITS = 16, 64


@dataclass(frozen=True)
class Segment:
    """One named array of the summed vector, clipped to [−clip, clip] before encoding."""

    name: str
    shape: tuple[int, ...]
    clip: float

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "clip": self.clip}


def check_segments(segments: Sequence[Segment]) -> None:
    """:class:`ConfigError` for an empty layout, a repeated name or a clip that is not a finite number > 0."""
    if not segments:
        raise ConfigError("secure aggregation needs at least one segment to sum")
    names = [s.name for s in segments]
    if len(set(names)) != len(names):
        raise ConfigError(f"secure aggregation segments repeat a name: {names}")
    for s in segments:
        if not (math.isfinite(s.clip) and s.clip > 0):
            raise ConfigError(f"segment {s.name!r}: clipping range must be a finite number > 0, got {s.clip}")


@dataclass(frozen=True)
class FieldPlan:
    """Z_{2^bits} for a group of at most ``group_size`` devices, and the layout of the vector they sum."""

    bits: int
    group_size: int
    segments: tuple[Segment, ...]

    @property
    def levels(self) -> int:
        """The largest encoding one device may contribute to a coordinate (n of them stay below 2^bits).

        Less a margin of 2^-40 of itself: above 2^53 the float64 encoding rounds, and must not round past it."""
        raw = ((1 << self.bits) - 1) // self.group_size
        return raw - (raw >> 40)

    @functools.cached_property
    def length(self) -> int:
        """Words in the encoded vector."""
        return sum(s.size for s in self.segments)

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return word_dtype(self.bits)

    def scale(self, segment: Segment) -> float:
        return self.levels / (2.0 * segment.clip)

    def max_error(self, segment: Segment, count: int | None = None) -> float:
        """Largest rounding error of a decoded sum of ``count`` (default: the group size) devices, per coordinate:
        half a step per device, plus float64's own rounding of values near 2^64 (which matters at 64 bits only)."""
        n = self.group_size if count is None else count
        return n * (0.5 / self.scale(segment) + segment.clip * 2.0**-48)

    def encode(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """One device's arrays (by segment name) clipped and encoded: a vector of :attr:`length` words."""
        out = np.empty(self.length, dtype=self.dtype)
        pos = 0
        for seg in self.segments:
            if seg.name not in arrays:
                raise PayloadError(f"secure aggregation: no array {seg.name!r} to encode")
            x = np.asarray(arrays[seg.name], dtype=np.float64)
            if x.shape != seg.shape:
                raise PayloadError(f"secure aggregation: {seg.name!r} has shape {x.shape}, the round sums {seg.shape}")
            x = np.where(np.isfinite(x), x, 0.0)  # a diverged value must not poison the group's sum
            q = np.rint((np.clip(x, -seg.clip, seg.clip) + seg.clip) * self.scale(seg))
            out[pos:pos + seg.size] = np.minimum(q, self.levels).astype(self.dtype).ravel()
            pos += seg.size
        return out

    def reduce(self, words: np.ndarray) -> np.ndarray:
        """``words`` mod 2^bits (a word of 32 or 64 bits wraps by itself)."""
        if self.bits in (32, 64):
            return words
        return words & self.dtype((1 << self.bits) - 1)

    def decode_sum(self, total: np.ndarray, count: int) -> dict[str, np.ndarray]:
        """Σx per segment (float64) from the sum of ``count`` encodings mod 2^bits."""
        if not 0 < count <= self.group_size:
            raise ValueError(f"a sum of {count} devices in a field planned for {self.group_size}")
        out = {}
        pos = 0
        for seg in self.segments:
            q = np.asarray(total[pos:pos + seg.size], dtype=np.float64)
            out[seg.name] = (q / self.scale(seg) - count * seg.clip).reshape(seg.shape)
            pos += seg.size
        return out


def resolution(bits: int, group_size: int) -> float:
    """The encoding step as a share of [−clip, clip]: 1 / ⌊(2^bits − 1) / n⌋."""
    return 1.0 / (((1 << bits) - 1) // group_size)


def plan_field(group_size: int, segments: Sequence[Segment], field_bits: int = 0, *, group: str = "") -> FieldPlan:
    """The field for a group of ``group_size`` devices: ``field_bits`` checked, or (0) chosen; see the module."""
    check_segments(segments)
    where = f"group {group!r}: " if group else ""
    if group_size < 1:
        raise ConfigError(f"{where}secure aggregation needs at least one device, got {group_size}")
    if field_bits == 0:
        for bits in (32, 64):
            if resolution(bits, group_size) <= AUTO_RESOLUTION:
                return FieldPlan(bits, group_size, tuple(segments))
        raise ConfigError(f"{where}{group_size} devices are too many for a 64-bit field at resolution "
                          f"{AUTO_RESOLUTION}", hint="split the group, or set [privacy] field_bits = 64 explicitly")
    if not MIN_BITS <= field_bits <= MAX_BITS:
        raise ConfigError(f"[privacy] field_bits must be 0 (auto) or in [{MIN_BITS}, {MAX_BITS}], got {field_bits}")
    step = resolution(field_bits, group_size) if group_size < (1 << field_bits) else math.inf
    if step > MIN_RESOLUTION:
        need = math.ceil(math.log2(group_size / MIN_RESOLUTION + 1))
        raise ConfigError(f"{where}a {field_bits}-bit field summing {group_size} devices leaves a step of {step:.3g} "
                          f"of the clipping range (coarser than {MIN_RESOLUTION:.3g})",
                          hint=f"set [privacy] field_bits >= {need}, or 0 to choose it from the group size")
    return FieldPlan(field_bits, group_size, tuple(segments))
