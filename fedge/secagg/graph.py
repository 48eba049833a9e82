"""The sparse neighbour graph of SecAgg+ (Bell et al., CCS 2020): a ring of logarithmic degree per round.

Every member of a group is placed on a ring in an order drawn from the round seed (SHA-256 of the seed and the
device id, so every party computes the same ring from the setup alone), and is a neighbour of the ``degree/2``
members on each side. A device exchanges keys and shares only with its neighbours: its work and traffic grow
with log n instead of n. An odd ``degree`` is rounded up; a group of at most ``degree + 1`` members is a
complete graph (the all-to-all protocol of Bonawitz et al.).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence


def default_degree(group_size: int) -> int:
    """8 · ⌈log2 n⌉ neighbours (capped at n − 1): the degree used when ``[privacy] neighbours = 0``.

    The constant buys dropout tolerance: with the default majority threshold a device's secrets need more than
    half of its k + 1 shares, and at 30 % dropout k = 8 ⌈log2 n⌉ leaves each device short with probability
    ~3e-4 at n = 100 (binomial tail); 2 ⌈log2 n⌉ would fail one device in a few at that rate."""
    if group_size <= 1:
        return 0
    return min(group_size - 1, 8 * math.ceil(math.log2(group_size)))


def default_threshold(degree: int) -> int:
    """A majority of a device's degree + 1 shares: ⌊(k + 1) / 2⌋ + 1, the threshold when ``threshold = 0``.

    A majority is what keeps a coordinator that lies about who dropped from getting both a device's seed and
    its mask key (docs/security.md#secure-aggregation)."""
    return (degree + 1) // 2 + 1


def ring_order(members: Sequence[str], seed: bytes) -> list[str]:
    """``members`` in the ring's order for this round (a keyed hash of each id: unpredictable without the seed)."""
    return sorted(members, key=lambda m: hashlib.sha256(seed + b"|" + m.encode()).digest())


def neighbours(members: Sequence[str], degree: int, seed: bytes) -> dict[str, list[str]]:
    """Each member's neighbours (sorted), ``degree`` of them (rounded up to even; all others in a small group)."""
    n = len(members)
    if len(set(members)) != n:
        raise ValueError("group members must be distinct")
    if degree + 1 >= n:
        return {m: sorted(set(members) - {m}) for m in members}
    half = (degree + 1) // 2
    ring = ring_order(members, seed)
    out = {}
    for i, m in enumerate(ring):
        out[m] = sorted({ring[(i + d) % n] for d in range(-half, half + 1) if d})
    return out
