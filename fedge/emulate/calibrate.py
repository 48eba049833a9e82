"""Calibrate CPU quotas: how fast one core of this host trains a device's model.

The planner's speed model (:func:`fedge.profiles.planner.round_time_s`) counts training as
``3 × forward MACs`` per sample. :func:`host_mac_rate` times SGD steps of the real model at the
device's batch size on one thread of this host and returns the same quantity, training MACs per
second, so ``device rate ÷ host rate`` is the fraction of a host core that trains at the device's
speed (:func:`fedge.emulate.limits.limits_for`). The host's CPU as `fedge profile probe` sees it
(:func:`fedge.export.probe.detect_hardware`) is recorded next to the figures.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedge.common.atomicfile import write_atomic

log = logging.getLogger(__name__)


def host_mac_rate(arch: str, batch_size: int, *, embed_dim: int = 64, seconds: float = 1.5) -> float:
    """Training MACs per CPU second one thread of this host reaches on ``arch`` at ``batch_size``."""
    from fedge.edge.training import train_mac_rate

    # CPU seconds, not wall seconds: the container's quota is CPU time (CFS), and on a busy host the
    # wall clock would count the time other processes ran, making the host look slower than it is
    # and every quota too large (measured: rounds 1.5-2.8x faster than planned under load).
    return train_mac_rate(arch, batch_size, embed_dim=embed_dim, threads=1, seconds=seconds, cpu_time=True)


def calibrate(keys: set[tuple[str, int]], *, embed_dim: int, cache: Path | None = None,
              seconds: float = 1.5) -> dict[tuple[str, int], float]:
    """Host training rate for each (arch, batch); reuses ``cache`` (JSON) for keys measured before."""
    from fedge.export.probe import detect_hardware

    known: dict[str, Any] = {}
    if cache is not None and cache.is_file():
        try:
            known = json.loads(cache.read_text())
        except ValueError:
            log.warning("ignoring unreadable calibration cache %s", cache)
    rates: dict[str, float] = dict(known.get("rates", {}))
    out = {}
    for arch, batch in sorted(keys):
        k = f"{arch}@{batch}/embed{embed_dim}"
        if k not in rates:
            rates[k] = host_mac_rate(arch, batch, embed_dim=embed_dim, seconds=seconds)
            log.info("calibration: %s at batch %d trains at %.2f GMAC/s on one host core", arch, batch, rates[k] / 1e9)
        out[(arch, batch)] = rates[k]
    if cache is not None:
        doc = {"host": detect_hardware(), "embed_dim": embed_dim, "rates": rates}
        write_atomic(cache, json.dumps(doc, indent=1).encode(), durable=False)  # a cache: whole, not durable
    return out
