"""Partial aggregates: a strategy's streaming accumulators as tensors, checked and merged exactly.

An aggregation worker or a relay (``fedge coordinator worker``, ``fedge relay``) runs the update gate
and the strategy's ``accumulate`` over its share of a round's updates, then sends what its
accumulators hold as one ``partial`` message; its parent folds that into its own accumulators.
Tensor names are paths, per attribute the strategy lists in ``partial_fields``:

===============  ============================================================================
accumulator      tensors under ``{field}/`` (``group/{g}/`` prefixes a :class:`GroupedMean`'s group)
===============  ============================================================================
WeightedMean     ``sum/{k}/hi`` + ``sum/{k}/lo`` and ``weight/hi`` + ``weight/lo`` (1,): the float64
                 running sums as two float32 halves (``hi = f32(x)``, ``lo = f32(x - hi)``), so
                 the sum of the parts equals the flat sum to ~2^-48 (the wire has no float64)
RobustMean       ``rows/{k}`` (n, *shape) float32 and ``weights/hi`` + ``weights/lo`` (n,):
                 every update's row, forwarded — a trimmed mean or a median cannot be merged from
                 sums, so the parent combines all rows exactly as one coordinator would
ClassMean        ``counts`` (C,) int64, and ``sums/hi`` + ``sums/lo`` (C, p) for the mean, or
                 ``rows/stats`` (n, C, p) float32 + ``rows/counts`` (n, C) int64 for a robust rule
===============  ============================================================================

Merging is exact for weighted means (sums and weights add) and for the robust rules (rows are
concatenated: the parent's trimmed mean, median or clipping sees every device's row, as a single
coordinator does; the cost is bytes, n rows instead of one sum). Anything from the network is
untrusted: :func:`check_partial` compares the tensors with a *template* — the partial the parent's
own strategy would produce for one device of each kind the partial claims — and refuses wrong
names, shapes, dtypes, non-finite values, negative weights and weights beyond what the listed
devices can carry.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fedge.common.rounds import DeviceInfo
from fedge.coordinator.aggregate import ClassMean, GroupedMean, RobustMean, WeightedMean, mean
from fedge.coordinator.strategy import Arrays, Strategy
from fedge.coordinator.validation import Rejected
from fedge.errors import ConfigError

Accumulator = WeightedMean | RobustMean | GroupedMean | ClassMean
# The bound on a partial's envelope info: it lists every device it covers with its report entry.
MAX_PARTIAL_INFO_BYTES = 8 << 20
MAX_PARTIAL_DEVICES = 100_000


def check_splittable(strategy: Strategy) -> tuple[str, ...]:
    """The strategy's ``partial_fields``, or a :class:`ConfigError` saying the method cannot be split."""
    fields = type(strategy).partial_fields
    if fields is None:
        raise ConfigError(
            f"method {strategy.name!r} cannot aggregate in parts: its coordinator half keeps per-round state "
            "beyond streaming accumulators",
            hint="run it with one coordinator (no workers, no relays); fedavg, lgfedavg, fedproto and local split")
    return fields


def split64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 → (hi, lo) float32 with ``hi + lo`` equal to ``x`` to ~2^-48 relative."""
    x = np.asarray(x, dtype=np.float64)
    hi = x.astype(np.float32)
    lo = (x - hi.astype(np.float64)).astype(np.float32)
    return hi, lo


def join64(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The float64 value :func:`split64` split."""
    return np.asarray(hi, dtype=np.float64) + np.asarray(lo, dtype=np.float64)


def _put64(out: Arrays, name: str, x: np.ndarray | float) -> None:
    hi, lo = split64(np.asarray(x))
    out[f"{name}/hi"], out[f"{name}/lo"] = hi, lo


def _get64(t: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return join64(t[f"{name}/hi"], t[f"{name}/lo"])


# -- export ---------------------------------------------------------------------------------------

def export_partial(strategy: Strategy) -> Arrays:
    """What the strategy's accumulators hold now, as tensors (see the module docstring)."""
    out: Arrays = {}
    for name in check_splittable(strategy):
        acc = getattr(strategy, name, None)
        if acc is not None:
            _export(acc, f"{name}/", out)
    return out


def _export(acc: Accumulator, prefix: str, out: Arrays) -> None:
    if isinstance(acc, WeightedMean):
        for k, v in acc.sums.items():
            _put64(out, f"{prefix}sum/{k}", v)
        _put64(out, f"{prefix}weight", np.atleast_1d(acc.weight))  # (1,): the codec has no 0-d tensors
    elif isinstance(acc, RobustMean):
        keys = list(acc.updates[0]) if acc.updates else []
        for k in keys:
            out[f"{prefix}rows/{k}"] = np.stack([u[k] for u in acc.updates]).astype(np.float32)
        _put64(out, f"{prefix}weights", np.asarray(acc.weights, dtype=np.float64))
    elif isinstance(acc, GroupedMean):
        for g, sub in acc.groups.items():
            _export(sub, f"{prefix}group/{g}/", out)
    elif isinstance(acc, ClassMean):
        out[f"{prefix}counts"] = acc.counts.copy()
        if acc.sums is not None:
            _put64(out, f"{prefix}sums", acc.sums)
        if acc.rows:
            out[f"{prefix}rows/stats"] = np.stack([s for s, _ in acc.rows]).astype(np.float32)
            out[f"{prefix}rows/counts"] = np.stack([c for _, c in acc.rows]).astype(np.int64)
    else:
        raise TypeError(f"{type(acc).__name__} is not an accumulator a partial can carry")


# -- checking against a template ------------------------------------------------------------------

def _kind(name: str) -> str:
    """``rows`` tensors have a leading row dimension; everything else has a fixed shape."""
    return "rows" if "/rows/" in f"/{name}" or name.endswith("/weights/hi") or name.endswith("/weights/lo") else "fixed"


def template(strategy: Strategy, rnd: int, devices: Iterable[DeviceInfo]) -> Arrays:
    """The partial the strategy would send after accumulating zeros from one device of each kind among
    ``devices`` (group, architecture, feature size): the names, shapes and dtypes a partial covering
    those devices may hold (row tensors: with one row per kind, the real count varies)."""
    probe = copy.copy(strategy)  # begin_round rebinds the accumulators: the original's are untouched
    probe.begin_round(rnd)
    seen: set[tuple[str, str, int]] = set()
    for dev in devices:
        key = (dev.group, dev.arch, dev.feature_dim)
        if key in seen:
            continue
        seen.add(key)
        spec = strategy.expected_update(dev, rnd) or {}
        probe.accumulate(dev, {k: np.zeros(shape, np.int64 if kind == "int" else np.float32)
                               for k, (shape, kind) in spec.items()}, {})
    return export_partial(probe)


def check_partial(tensors: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], devices: int,
                  weight_budget: float) -> None:
    """Refuse (:class:`Rejected`) a partial whose tensors differ from ``expected`` (a :func:`template`):
    other names, shapes or dtypes, more rows than ``devices``, NaN or Inf, a negative weight or count,
    or an accumulator whose total weight exceeds ``weight_budget`` (what the listed devices can carry:
    the sum of their ``max(num_samples, 1)``)."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise Rejected("schema", f"partial has tensors its devices cannot produce: {extra[:5]}")
    # A group or a row set that received nothing is simply absent; a half of a float64 pair is not.
    for name in missing:
        pair = name[:-3] + ("/lo" if name.endswith("/hi") else "/hi")
        if (name.endswith(("/hi", "/lo"))) and pair in tensors:
            raise Rejected("schema", f"partial has {pair!r} without {name!r}")
    rows: dict[str, int] = {}
    for name, arr in tensors.items():
        want = expected[name]
        kind_ok = np.issubdtype(arr.dtype, np.integer) == np.issubdtype(want.dtype, np.integer)
        if not kind_ok:
            raise Rejected("dtype", f"partial tensor {name!r} is {arr.dtype}, expected {want.dtype}")
        if _kind(name) == "rows":
            if arr.ndim != want.ndim or arr.shape[1:] != want.shape[1:]:
                raise Rejected("shape", f"partial tensor {name!r} has shape {arr.shape}, expected (n, "
                                        f"{', '.join(map(str, want.shape[1:]))})")
            if arr.shape[0] > devices:
                raise Rejected("shape", f"partial tensor {name!r} has {arr.shape[0]} rows for {devices} devices")
            prefix = name.split("/rows/")[0] if "/rows/" in name else name.rsplit("/weights/", 1)[0]
            if rows.setdefault(prefix, arr.shape[0]) != arr.shape[0]:
                raise Rejected("shape", f"partial accumulator {prefix!r} has row tensors of different lengths")
        elif arr.shape != want.shape:
            raise Rejected("shape", f"partial tensor {name!r} has shape {arr.shape}, expected {want.shape}")
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            raise Rejected("nonfinite", f"partial tensor {name!r} holds NaN or Inf")
    for name, arr in tensors.items():
        if name.endswith(("/weight/hi", "/weights/hi")):
            total = _get64(tensors, name[:-3])
        elif np.issubdtype(arr.dtype, np.integer):
            total = np.asarray(arr, dtype=np.float64)  # class counts, per device row or summed
        else:
            continue
        if (total < 0).any():
            raise Rejected("negative", f"partial tensor {name!r} holds a negative weight or count")
        if float(total.sum()) > weight_budget * (1 + 1e-9) + 1e-6:
            raise Rejected("weight", f"partial tensor {name!r} carries weight {float(total.sum()):g}, more than "
                                     f"the {weight_budget:g} samples of the devices it lists")


# -- merging --------------------------------------------------------------------------------------

def merge_partial(strategy: Strategy, tensors: Mapping[str, np.ndarray]) -> None:
    """Fold a checked partial into the strategy's accumulators (as if its updates had been accumulated here)."""
    for name in check_splittable(strategy):
        prefix = f"{name}/"
        part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not part:
            continue
        acc = getattr(strategy, name, None)
        if acc is None:
            raise ConfigError(f"{type(strategy).__name__}.{name} is not set: begin_round first")
        _merge(acc, part)


def _merge(acc: Accumulator, t: Mapping[str, np.ndarray]) -> None:
    if isinstance(acc, WeightedMean):
        for name in t:
            if name.startswith("sum/") and name.endswith("/hi"):
                k = name[len("sum/"):-len("/hi")]
                v = _get64(t, f"sum/{k}")
                acc.sums[k] = v if k not in acc.sums else acc.sums[k] + v
        if "weight/hi" in t:
            acc.weight += float(_get64(t, "weight").sum())
    elif isinstance(acc, RobustMean):
        if "weights/hi" not in t:
            return
        weights = _get64(t, "weights")
        keys = [n[len("rows/"):] for n in t if n.startswith("rows/")]
        for i, w in enumerate(weights):
            acc.add({k: t[f"rows/{k}"][i] for k in keys}, float(w))
    elif isinstance(acc, GroupedMean):
        groups: dict[str, dict[str, np.ndarray]] = {}
        for name, v in t.items():
            g, _, rest = name[len("group/"):].partition("/")
            groups.setdefault(g, {})[rest] = v
        for g, sub in groups.items():
            if g not in acc.groups:
                acc.groups[g] = mean(acc.aggregation)
            _merge(acc.groups[g], sub)
    elif isinstance(acc, ClassMean):
        if "counts" in t:
            acc.counts += np.asarray(t["counts"], dtype=np.int64)
            # partials exist in synchronous rounds only (asynchronous mode refuses workers and relays), where
            # every update's staleness weight is 1: the mean's weights are the class counts
            acc.weights += np.asarray(t["counts"], dtype=np.float64)
        if "sums/hi" in t:
            s = _get64(t, "sums")
            acc.sums = s if acc.sums is None else acc.sums + s
        if "rows/stats" in t:
            acc.rows.extend((st.astype(np.float32), c.astype(np.int64))
                            for st, c in zip(t["rows/stats"], t["rows/counts"], strict=True))
    else:
        raise TypeError(f"{type(acc).__name__} is not an accumulator a partial can carry")


def weight_budget(devices: Iterable[DeviceInfo]) -> float:
    """The most weight the listed devices can put into one accumulator: every strategy weighs an update
    by its device's samples (at least 1) or by class counts, which the gate bounds by the samples."""
    return float(sum(max(d.num_samples, 1) for d in devices))


def describe(tensors: Mapping[str, Any]) -> str:
    """A short summary for logs: how many tensors and bytes."""
    return f"{len(tensors)} tensors, {sum(int(np.asarray(v).nbytes) for v in tensors.values())} bytes"
