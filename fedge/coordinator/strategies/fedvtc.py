"""FedVTC, coordinator half: aggregate per-class feature statistics, streaming.

Each device k uploads class counts n_k^y, class means μ_k^y (C, p) and its
within-class standard deviation σ_k (p,). The coordinator keeps only the sums

    N^y = Σ_k n_k^y,   S1^y = Σ_k n_k^y μ_k^y,   S2^y = Σ_k n_k^y (σ_k² + (μ_k^y)²)

and publishes c^y = S1^y / N^y (count-weighted means) and the pooled
within-class variance σ² = Σ_y (S2^y − N^y (c^y)²) / Σ_y N^y, which includes the
spread of the device means μ_k^y around the global mean c^y (the law of total
variance), not just the average of the device variances.

A class that no device holds has N^y = 0: its prototype is published as zeros
with count 0, and devices never sample it (tested).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedge.common.method_settings import FedVTCSettings
from fedge.common.rounds import VTC_STATS_ARTIFACT, DeviceInfo, class_stats_spec
from fedge.coordinator.strategies.running import LatestUploads
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec


def pooled_statistics(n: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global prototypes (C, p) and σ (p,) from the streaming sums (see the module docstring)."""
    safe = np.maximum(n, 1.0)[:, None]
    protos = np.where(n[:, None] > 0, s1 / safe, 0.0)
    total = max(float(n.sum()), 1.0)
    var = (s2.sum(0) - (n[:, None] * protos**2).sum(0)) / total
    return protos, np.sqrt(np.maximum(var, 0.0))


class FedVTCStrategy(Strategy):
    """FedVTC: count-weighted prototypes and pooled σ over every device (asynchronous: a running aggregate of
    every device's latest statistics, :mod:`~fedge.coordinator.strategies.running`)."""

    settings_type = FedVTCSettings

    def __init__(self, settings: FedVTCSettings | None = None, *, num_classes: int, rounds: int) -> None:
        super().__init__(settings, num_classes=num_classes, rounds=rounds)
        self.latest = LatestUploads()

    def begin_round(self, rnd: int) -> None:
        self.n = np.zeros(self.num_classes, dtype=np.float64)
        self.s1: np.ndarray | None = None
        self.s2: np.ndarray | None = None

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        if self.asynchronous is not None:
            self.latest.put(device.device_id, arrays, at.version)
            return
        self._add(arrays, 1.0)

    def accumulate_group_sum(self, group: str, sums: Arrays) -> None:
        self.n += np.rint(sums["counts"])  # exact: the field's error on a count sum is far below 0.5
        self.s1 = sums["s1"] if self.s1 is None else self.s1 + sums["s1"]
        self.s2 = sums["s2"] if self.s2 is None else self.s2 + sums["s2"]

    def _add(self, arrays: Arrays, weight: float) -> None:
        """Fold one device's statistics in, its class counts weighted by ``weight``."""
        counts = np.asarray(arrays["counts"], dtype=np.float64) * weight  # (C,)
        mu = np.asarray(arrays["protos"], dtype=np.float64)  # (C, p)
        var = np.asarray(arrays["sigma"], dtype=np.float64) ** 2  # (p,)
        if self.s1 is None or self.s2 is None:
            self.s1 = np.zeros_like(mu)
            self.s2 = np.zeros_like(mu)
        self.n += counts
        self.s1 += counts[:, None] * mu
        self.s2 += counts[:, None] * (var[None, :] + mu**2)

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        if self.asynchronous is not None:
            counts = np.zeros(self.num_classes, dtype=np.int64)
            for arrays, version in self.latest.items():
                self._add(arrays, self.asynchronous.weight(rnd - version))
                counts += np.asarray(arrays["counts"], dtype=np.int64)
        if self.s1 is None or self.s2 is None:
            return {}
        protos, sigma = pooled_statistics(self.n, self.s1, self.s2)
        published = counts if self.asynchronous is not None else self.n.astype(np.int64)  # sample counts
        return {VTC_STATS_ARTIFACT: {"protos": protos.astype(np.float32), "sigma": sigma.astype(np.float32),
                                     "counts": published}}

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        return class_stats_spec(self.num_classes, device.feature_dim, with_sigma=True)

    def state_dict(self) -> dict[str, Any]:
        return {"latest": self.latest.state_dict()} if self.latest.uploads else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latest.load_state_dict(state.get("latest", {}))
