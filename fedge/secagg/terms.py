"""What each method sums securely: a device's upload as the terms whose group sum its coordinator half needs.

* ``fedavg`` — within each architecture group: the weight w = (sample count / the group's largest) and w · x
  for every float tensor x of the state dict (x clipped to ±``clip``); the group mean is Σ w·x / Σ w.
* ``fedproto`` — over the whole fleet: per-class counts n^y and sums n^y · c^y (c^y clipped to ±``clip``).
* ``fedvtc`` — over the whole fleet: n^y, S1^y = n^y μ^y and S2^y = n^y (σ² + (μ^y)²) (μ, σ clipped to ±``clip``).

Counts are bounded by the group's largest sample count (``cap``), so every term has a known range and the field
(:func:`fedge.secagg.fixedpoint.plan_field`) holds the group's sum; counts come back exact after rounding.
Everything a method needs beyond sums — a trimmed mean, a median, checks of one device's values — cannot run on
masked inputs: :func:`refusal` names why.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedge.common.rounds import DeviceInfo
from fedge.secagg.fixedpoint import Segment

SECURE_METHODS = ("fedavg", "fedproto", "fedvtc")
FLEET_GROUP = "fleet"  # the one group of the statistics methods (their statistics are summed over every device)
Spec = Mapping[str, tuple[tuple[int, ...], str]]


def refusal(method: str, *, robust: bool, asynchronous: bool) -> str | None:
    """Why ``[privacy] secure_aggregation`` cannot run with this method and round loop (None: it can)."""
    if method not in SECURE_METHODS:
        return (f"secure aggregation sums {', '.join(SECURE_METHODS)} uploads; {method!r}'s (generators, shared "
                "parts) are not built on it yet")
    if robust:
        return ("[coordinator] aggregation = trimmed / median (or clip > 0) reads every device's values, which a "
                "masked sum hides; only the plain mean is a sum (clipping moves to the device: clipping_range)")
    if asynchronous:
        return ('[coordinator] mode = "async" folds single updates into versions; masks cancel only in the sum of '
                "one synchronous round's group")
    return None


def group_of(method: str, device: DeviceInfo) -> str:
    """The secure sum ``device`` takes part in: its architecture group (FedAvg) or the whole fleet."""
    return device.group if method == "fedavg" else FLEET_GROUP


def segments(method: str, spec: Spec, *, clip: float, cap: float) -> list[Segment]:
    """The layout of the summed vector for uploads of ``spec``; ``cap`` bounds a device's (class) counts."""
    if method == "fedavg":
        return [Segment("weight", (1,), 1.0), *(Segment(k, tuple(shape), clip) for k, (shape, kind) in spec.items()
                                                if kind == "float")]
    counts, protos = tuple(spec["counts"][0]), tuple(spec["protos"][0])
    if method == "fedproto":
        return [Segment("counts", counts, cap), Segment("sums", protos, cap * clip)]
    return [Segment("counts", counts, cap), Segment("s1", protos, cap * clip), Segment("s2", protos, cap * 2 * clip**2)]


def device_terms(method: str, arrays: Mapping[str, np.ndarray], *, num_samples: int, cap: float,
                 clip: float) -> dict[str, np.ndarray]:
    """One device's terms (by segment name) from its upload ``arrays``; runs on the device."""
    def clipped(name: str) -> np.ndarray:
        x = np.asarray(arrays[name], dtype=np.float64)
        return np.clip(np.where(np.isfinite(x), x, 0.0), -clip, clip)

    if method == "fedavg":
        w = min(max(num_samples, 1), cap) / cap
        return {"weight": np.array([w]), **{k: w * clipped(k) for k, v in arrays.items()
                                            if np.issubdtype(np.asarray(v).dtype, np.floating)}}
    n = np.minimum(np.asarray(arrays["counts"], dtype=np.float64), cap)
    mu = clipped("protos")
    if method == "fedproto":
        return {"counts": n, "sums": n[:, None] * mu}
    var = clipped("sigma") ** 2
    return {"counts": n, "s1": n[:, None] * mu, "s2": n[:, None] * (var[None, :] + mu**2)}
