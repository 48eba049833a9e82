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

A ``lo`` half may be left out (``export_partial(exact=False)``, ``--fp32-sums``): the value is then its
float32 ``hi``, half the bytes of the sums for one float32 rounding per partial.

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
from fedge.coordinator.accumulators import ClassMean, GroupedMean, RobustMean, WeightedMean, mean
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


def _put64(out: Arrays, name: str, x: np.ndarray | float, exact: bool = True) -> None:
    hi, lo = split64(np.asarray(x))
    out[f"{name}/hi"] = hi
    if exact:  # without ``lo`` the value is float32: half the bytes, one float32 rounding
        out[f"{name}/lo"] = lo


def _get64(t: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    lo = t.get(f"{name}/lo")
    return join64(t[f"{name}/hi"], np.zeros_like(t[f"{name}/hi"]) if lo is None else lo)


# -- export ---------------------------------------------------------------------------------------

def export_partial(strategy: Strategy, *, exact: bool = True) -> Arrays:
    """What the strategy's accumulators hold now, as tensors (see the module docstring); ``exact=False``
    sends each float64 sum as its float32 ``hi`` half only (no ``lo``): half the bytes of the sums, at the
    price of one float32 rounding per partial."""
    out: Arrays = {}
    for name in check_splittable(strategy):
        acc = getattr(strategy, name, None)
        if acc is not None:
            _export(acc, f"{name}/", out, exact)
    return out


def _export(acc: Accumulator, prefix: str, out: Arrays, exact: bool = True) -> None:
    if isinstance(acc, WeightedMean):
        for k, v in acc.sums.items():
            _put64(out, f"{prefix}sum/{k}", v, exact)
        _put64(out, f"{prefix}weight", np.atleast_1d(acc.weight), exact)  # (1,): the codec has no 0-d tensors
    elif isinstance(acc, RobustMean):
        keys = list(acc.updates[0]) if acc.updates else []
        for k in keys:
            out[f"{prefix}rows/{k}"] = np.stack([u[k] for u in acc.updates]).astype(np.float32)
        _put64(out, f"{prefix}weights", np.asarray(acc.weights, dtype=np.float64), exact)
    elif isinstance(acc, GroupedMean):
        for g, sub in acc.groups.items():
            _export(sub, f"{prefix}group/{g}/", out, exact)
    elif isinstance(acc, ClassMean):
        out[f"{prefix}counts"] = acc.counts.copy()
        if acc.sums is not None:
            _put64(out, f"{prefix}sums", acc.sums, exact)
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
    # A group or a row set that received nothing is simply absent; a float64 pair's ``hi`` half is not (its
    # ``lo`` half may be: a float32 sum, export_partial(exact=False)).
    for name in missing:
        pair = name[:-3] + "/lo"
        if name.endswith("/hi") and pair in tensors:
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


# -- device lists: runs of numbered ids ---------------------------------------------------------

MAX_ID_CHARS = 128  # a device id in a partial (fleet ids are far shorter; the bound keeps a list cheap)
MAX_RUN_WIDTH = 20


def _numbered(dev: str) -> tuple[str, int, int] | None:
    """``PREFIX-0042`` → (``PREFIX-``, 42, width 4): the id's trailing ASCII digits as a number, width 0 for an
    unpadded one; None if the id does not end in digits."""
    head = dev.rstrip("0123456789")
    digits = dev[len(head):]
    if not digits or len(digits) > MAX_RUN_WIDTH:
        return None
    width = len(digits) if digits[0] == "0" and len(digits) > 1 else 0
    return head, int(digits), width


def pack_ids(ids: Iterable[str]) -> list[Any]:
    """Device ids as runs: ``[prefix, first, last, width]`` stands for ``prefix + str(i)`` (zero-padded to
    ``width`` if not 0) for i in first..last; an id outside any run of two or more stays a string. fedge's
    ids are ``PREFIX-1, PREFIX-2, ...``, so a shard whose devices all answered packs into one run per device
    group, whatever its size (:func:`unpack_ids` reverses it exactly)."""
    runs: dict[tuple[str, int], list[int]] = {}
    out: list[Any] = []
    for dev in ids:
        n = _numbered(dev)
        if n is None:
            out.append(dev)
        else:
            runs.setdefault((n[0], n[2]), []).append(n[1])
    for (prefix, width), nums in sorted(runs.items()):
        nums.sort()
        start = prev = nums[0]
        for x in [*nums[1:], None]:
            if x is not None and x == prev + 1:
                prev = x
                continue
            if prev > start:
                out.append([prefix, start, prev, width])
            else:
                out.append(prefix + (str(start).zfill(width) if width else str(start)))
            if x is not None:
                start = prev = x
    return out


def unpack_ids(raw: object, limit: int = MAX_PARTIAL_DEVICES) -> list[str]:
    """The ids :func:`pack_ids` packed, checked as untrusted input: a list of strings and runs, at most
    ``limit`` ids in all (counted before any run is expanded), none twice (:class:`Rejected` otherwise)."""
    if not isinstance(raw, list) or len(raw) > limit:
        raise Rejected("malformed", f"a partial's ids must be a list of at most {limit} entries")
    total = 0
    for item in raw:
        if isinstance(item, str):
            if not 0 < len(item) <= MAX_ID_CHARS:
                raise Rejected("malformed", f"a device id in a partial must have 1 to {MAX_ID_CHARS} characters")
            total += 1
        elif isinstance(item, list) and len(item) == 4:
            prefix, first, last, width = item
            if (not isinstance(prefix, str) or len(prefix) > MAX_ID_CHARS or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in (first, last, width))
                    or not 0 <= first <= last < 10 ** MAX_RUN_WIDTH or not 0 <= width <= MAX_RUN_WIDTH):
                raise Rejected("malformed", "a run of ids must be [prefix, first, last, width] with "
                                            "0 <= first <= last and 0 <= width <= 20")
            total += last - first + 1
        else:
            raise Rejected("malformed", "a partial's ids hold strings and [prefix, first, last, width] runs")
        if total > limit:
            raise Rejected("malformed", f"a partial's ids stand for more than {limit} devices")
    out: list[str] = []
    for item in raw:
        if isinstance(item, str):
            out.append(item)
        else:
            prefix, first, last, width = item
            out += [prefix + (str(i).zfill(width) if width else str(i)) for i in range(first, last + 1)]
    if len(set(out)) != len(out):
        raise Rejected("malformed", "a partial lists a device twice")
    return out
