"""The mean nearest-neighbour distance ratio (MND) of the GeFL article, in numpy.

For a device's training images T, held-out images V of the same classes and
synthetic samples S, each in some space (pixels, or a fixed network's features):

    MND_S = mean over s in S of min over t in T of ‖s − t‖₂
    MND_V = mean over v in V of min over t in T of ‖v − t‖₂
    ratio = MND_S / MND_V

A generator that produces new samples of the same distribution sits as far from
the training set as fresh real data does (ratio ≈ 1); one that reproduces its
training images sits closer (ratio → 0). Lower is more memorized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def nearest(queries: np.ndarray, refs: np.ndarray, *, chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """For each query row, the L2 distance to its nearest row of ``refs`` and that row's index."""
    q = queries.reshape(len(queries), -1).astype(np.float64)
    r = refs.reshape(len(refs), -1).astype(np.float64)
    r2 = (r**2).sum(1)
    dist = np.empty(len(q))
    idx = np.empty(len(q), dtype=np.int64)
    for i in range(0, len(q), chunk):
        qb = q[i : i + chunk]
        d2 = (qb**2).sum(1)[:, None] - 2 * qb @ r.T + r2[None, :]
        j = d2.argmin(1)
        idx[i : i + chunk] = j
        dist[i : i + chunk] = np.sqrt(np.maximum(d2[np.arange(len(qb)), j], 0.0))
    return dist, idx


@dataclass(frozen=True)
class MND:
    """One MND measurement in one space."""

    synthetic: float  # mean NN distance, synthetic -> training
    validation: float  # mean NN distance, held-out -> training
    ratio: float  # synthetic / validation: lower = more memorized

    def to_dict(self) -> dict[str, float]:
        return {"synthetic": self.synthetic, "validation": self.validation, "ratio": self.ratio}


def mnd(synthetic: np.ndarray, validation: np.ndarray, train: np.ndarray) -> tuple[MND, np.ndarray, np.ndarray]:
    """The MND of ``synthetic`` against ``train``, normalized by ``validation``; also each synthetic sample's
    nearest-neighbour distance and the index of its nearest training sample."""
    ds, js = nearest(synthetic, train)
    dv, _ = nearest(validation, train)
    s, v = float(ds.mean()), float(dv.mean())
    return MND(s, v, s / v if v > 0 else float("nan")), ds, js
