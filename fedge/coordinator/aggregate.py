"""Streaming aggregation: running weighted sums, so no per-device update is kept in memory."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


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

    def __bool__(self) -> bool:
        return self.weight > 0

    def result(self) -> dict[str, np.ndarray]:
        return {k: (v / self.weight).astype(np.float32) for k, v in self.sums.items()}


class GroupedMean:
    """One :class:`WeightedMean` per group key."""

    def __init__(self) -> None:
        self.groups: dict[str, WeightedMean] = {}

    def add(self, group: str, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        self.groups.setdefault(group, WeightedMean()).add(arrays, weight)

    def results(self) -> dict[str, dict[str, np.ndarray]]:
        return {g: m.result() for g, m in self.groups.items() if m}
