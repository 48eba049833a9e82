"""Streaming aggregation: the accumulators strategies fold updates into.

* :class:`WeightedMean` keeps running weighted sums (float64), so no per-device
  update is held in memory — the default, and what every figure in ``docs/``
  was produced with.
* :class:`RobustMean` keeps each update (float32) until the round ends, then
  applies :class:`Aggregation`'s rule: optional **norm clipping** (each update's
  distance from the coordinate-wise median shrunk to at most ``clip`` × the
  median distance) followed by a **trimmed mean** (in every coordinate the
  ``ceil(trim × N)`` smallest and largest of the N devices' values cut, the rest
  weighted) or a weighted coordinate-wise **median**. Memory: one float32 copy of every update of the round.
* :class:`ClassMean` is the same per class row for class statistics
  (prototypes weighted by class counts): a class's row from a device counts
  only if that device has samples of the class.

Strategies ask for accumulators with :func:`mean`, :class:`GroupedMean` or
:class:`ClassMean`, passing their ``aggregation``; the rule is chosen in the
fleet config's ``[coordinator]`` table (:mod:`fedge.common.coordinator_section`, where :class:`Aggregation`
lives: the fleet config checks it when it loads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from fedge.common.coordinator_section import Aggregation


class Accumulator(Protocol):
    """Folds name-keyed arrays with a weight into one result."""

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None: ...
    def __bool__(self) -> bool: ...
    def result(self) -> dict[str, np.ndarray]: ...


class WeightedMean:
    """Running ``sum(w_i * x_i) / sum(w_i)`` over name-keyed arrays (float64 accumulators)."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.weight = 0.0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        for k, v in arrays.items():
            acc = self.sums.get(k)
            contrib = np.asarray(v, dtype=np.float64) * weight
            self.sums[k] = contrib if acc is None else acc + contrib
        self.weight += weight

    def add_sum(self, sums: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold in arrays already summed with their weights (a secure group sum): ``sums[k]`` = Σ w_i x_i and
        ``weight`` = Σ w_i."""
        for k, v in sums.items():
            acc = self.sums.get(k)
            self.sums[k] = np.array(v, dtype=np.float64) if acc is None else acc + v
        self.weight += weight

    def __bool__(self) -> bool:
        return self.weight > 0

    def result(self) -> dict[str, np.ndarray]:
        return {k: (v / self.weight).astype(np.float32) for k, v in self.sums.items()}


def weighted_median(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Coordinate-wise weighted median of ``x`` (N, D) with weights ``w`` (N,) > 0: (D,)."""
    xt = np.ascontiguousarray(x.T)  # one row per coordinate: sorting along contiguous memory
    order = np.argsort(xt, axis=1, kind="stable")
    xs = np.take_along_axis(xt, order, 1)
    cw = np.cumsum(w[order], axis=1)
    idx = np.minimum((cw < 0.5 * cw[:, -1:]).sum(axis=1), len(w) - 1)
    return xs[np.arange(xt.shape[0]), idx]


def trimmed_count(n: int, trim: float) -> int:
    """Values cut at each end of a column of ``n``: ``ceil(trim × n)``, leaving at least one."""
    return min(math.ceil(trim * n - 1e-9), (n - 1) // 2)


def weighted_trimmed_mean(x: np.ndarray, w: np.ndarray, trim: float) -> np.ndarray:
    """Coordinate-wise trimmed mean of ``x`` (N, D): in each column the :func:`trimmed_count` smallest
    and largest values are cut, device by device, and the rest averaged with their weights ``w`` (N,).

    The cut counts devices, not weight: a device's weight (its sample or class count) says how much
    its value counts, never whether it survives the trim. Cutting by weight instead lets a few
    devices that hold most of a class's samples (common under non-IID data) outlast the trim.
    """
    n = len(w)
    k = trimmed_count(n, trim)
    if k == 0:
        return (x * w[:, None]).sum(axis=0) / np.maximum(w.sum(), np.finfo(np.float64).tiny)
    # One row per coordinate (contiguous), partitioned rather than sorted: only which k values are
    # the smallest and the largest matters, not their order (O(N) per coordinate, not O(N log N)).
    xt = np.ascontiguousarray(x.T)
    keep = np.argpartition(xt, (k - 1, n - k), axis=1)[:, k : n - k]  # (D, N - 2k): devices kept
    xs = np.take_along_axis(xt, keep, 1)
    ws = w[keep]
    return (xs * ws).sum(axis=1) / np.maximum(ws.sum(axis=1), np.finfo(np.float64).tiny)


def canonical_rows(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``x`` (N, D) and their weights ``w`` (N,) in one order fixed by their bytes alone.

    The rows come in arrival order (over MQTT, network order), and which values survive the trim is
    order-free, but their weighted sum is not (float addition is not associative), nor which of two tied
    values a stable sort puts first. One ulp apart in round 1, prototypes trained on for two more rounds
    ended 0.05 apart in accuracy. Sorted by content, the same updates give the same bits whatever their order.
    """
    order = sorted(range(len(w)), key=lambda i: (x[i].tobytes(), float(w[i])))
    return x[order], w[order]


def robust_combine(x: np.ndarray, w: np.ndarray, agg: Aggregation) -> np.ndarray:
    """Combine rows of ``x`` (N, D) with weights ``w`` (N,) by ``agg``'s clipping and rule (float64).

    The result depends only on the set of (row, weight) pairs, never on their order: see :func:`canonical_rows`.
    """
    x, w = canonical_rows(np.asarray(x, dtype=np.float64), np.asarray(w, dtype=np.float64))
    if agg.clip > 0 and len(w) > 1:
        center = weighted_median(x, w)
        dist = np.linalg.norm(x - center, axis=1)
        bound = agg.clip * float(np.median(dist))
        scale = np.where(dist > bound, bound / np.maximum(dist, np.finfo(np.float64).tiny), 1.0)
        x = center + (x - center) * scale[:, None]
    if agg.rule == "median":
        return weighted_median(x, w)
    if agg.rule == "trimmed":
        return weighted_trimmed_mean(x, w, agg.trim)
    return (x * w[:, None]).sum(axis=0) / w.sum()


class RobustMean:
    """Keeps every update of the round; :meth:`result` combines them by an :class:`Aggregation`.

    Clipping measures each update's distance over all its arrays together (one update, one norm).
    """

    def __init__(self, aggregation: Aggregation) -> None:
        self.aggregation = aggregation
        self.updates: list[dict[str, np.ndarray]] = []
        self.weights: list[float] = []

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        if weight > 0:
            self.updates.append({k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()})
            self.weights.append(float(weight))

    def __bool__(self) -> bool:
        return bool(self.weights)

    def result(self) -> dict[str, np.ndarray]:
        if not self.updates:
            return {}
        keys = list(self.updates[0])
        shapes = {k: self.updates[0][k].shape for k in keys}
        flat = np.stack([np.concatenate([u[k].ravel() for k in keys]) for u in self.updates])
        combined = robust_combine(flat, np.asarray(self.weights), self.aggregation)
        out, pos = {}, 0
        for k in keys:
            n = int(np.prod(shapes[k]))
            out[k] = combined[pos : pos + n].reshape(shapes[k]).astype(np.float32)
            pos += n
        return out


def mean(aggregation: Aggregation | None = None) -> WeightedMean | RobustMean:
    """The accumulator ``aggregation`` asks for (None or a plain mean: streaming sums)."""
    if aggregation is None or not aggregation.robust:
        return WeightedMean()
    return RobustMean(aggregation)


class GroupedMean:
    """One accumulator (see :func:`mean`) per group key."""

    def __init__(self, aggregation: Aggregation | None = None) -> None:
        self.aggregation = aggregation
        self.groups: dict[str, WeightedMean | RobustMean] = {}

    def add(self, group: str, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        acc = self.groups.get(group)
        if acc is None:
            acc = self.groups[group] = mean(self.aggregation)
        acc.add(arrays, weight)

    def add_sum(self, group: str, sums: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold a group's secure sum in (:meth:`WeightedMean.add_sum`; a plain mean only)."""
        acc = self.groups.get(group)
        if acc is None:
            acc = self.groups[group] = mean(self.aggregation)
        assert isinstance(acc, WeightedMean), "a robust rule needs every device's update, not a sum"
        acc.add_sum(sums, weight)

    def results(self) -> dict[str, dict[str, np.ndarray]]:
        return {g: m.result() for g, m in self.groups.items() if m}


class ClassMean:
    """Per-class statistics (C, p) weighted by class counts (C,): the global prototypes and counts.

    The plain mean streams float64 sums; a robust rule keeps each device's rows and combines,
    per class, the rows of the devices that have samples of it. Counts are summed in int64:
    the gate bounds every device's counts by its sample count, so the sum cannot wrap.
    """

    def __init__(self, num_classes: int, aggregation: Aggregation | None = None) -> None:
        self.aggregation = aggregation
        self.counts = np.zeros(num_classes, dtype=np.int64)
        self.weights = np.zeros(num_classes, dtype=np.float64)  # counts times each device's weight
        self.sums: np.ndarray | None = None
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, stats: np.ndarray, counts: np.ndarray, weight: float = 1.0) -> None:
        """Fold one device's rows in, each weighted by its class count times ``weight`` (a staleness weight;
        the published counts stay sample counts)."""
        stats = np.asarray(stats, dtype=np.float64)
        counts = np.asarray(counts, dtype=np.int64)
        self.counts += counts
        w = counts.astype(np.float64) * weight
        self.weights += w
        if self.aggregation is not None and self.aggregation.robust:
            self.rows.append((stats.astype(np.float32), w))
            return
        if self.sums is None:
            self.sums = np.zeros_like(stats)
        self.sums += stats * w[:, None]

    def add_sums(self, sums: np.ndarray, weights: np.ndarray, counts: np.ndarray) -> None:
        """Fold in rows already summed (plain mean only): ``sums`` (C, p) of statistics times their weights,
        ``weights`` (C,) and the class ``counts`` (C,) they stand for."""
        assert self.aggregation is None or not self.aggregation.robust, "a robust rule needs every device's rows"
        self.counts += np.asarray(counts, dtype=np.int64)
        self.weights += weights
        if self.sums is None:
            self.sums = np.zeros_like(sums, dtype=np.float64)
        self.sums += sums

    def __bool__(self) -> bool:
        return self.sums is not None or bool(self.rows)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(statistics (C, p) float32, counts (C,) int64); a class nobody has gets a zero row."""
        if self.sums is not None:
            safe = np.where(self.weights > 0, self.weights, 1.0)[:, None]
            return (self.sums / safe).astype(np.float32), self.counts.copy()
        assert self.aggregation is not None and self.rows
        stats = np.stack([s for s, _ in self.rows])  # (N, C, p)
        counts = np.stack([c for _, c in self.rows])  # (N, C) weights: class counts times the device's weight
        out = np.zeros(stats.shape[1:], dtype=np.float64)
        for c in range(stats.shape[1]):
            has = counts[:, c] > 0
            if has.any():
                out[c] = robust_combine(stats[has, c], counts[has, c], self.aggregation)
        return out.astype(np.float32), self.counts.copy()
