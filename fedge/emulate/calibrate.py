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
import time
from pathlib import Path
from typing import Any

from fedge.common.archs import arch_by_name
from fedge.profiles.planner import TRAIN_MACS_FACTOR

log = logging.getLogger(__name__)


def host_mac_rate(arch: str, batch_size: int, *, embed_dim: int = 64, seconds: float = 1.5) -> float:
    """Training MACs per CPU second one thread of this host reaches on ``arch`` at ``batch_size``."""
    import torch
    from torch import nn

    from fedge.edge.models.zoo import build_model

    spec = arch_by_name(arch, embed_dim=embed_dim if arch.startswith("tier-") else None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(spec, seed=0, num_classes=spec.num_classes)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, spec.in_channels, spec.image_size, spec.image_size, generator=gen)
        y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)
        loss_fn = nn.CrossEntropyLoss()

        def step() -> None:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        step()  # warm-up: first-call allocations and kernel selection
        # CPU seconds, not wall seconds: the container's quota is CPU time (CFS), and on a busy host the
        # wall clock would count the time other processes ran, making the host look slower than it is
        # and every quota too large (measured: rounds 1.5-2.8x faster than planned under load).
        steps, t0 = 0, time.process_time()
        while (elapsed := time.process_time() - t0) < seconds or steps < 3:
            step()
            steps += 1
    finally:
        torch.set_num_threads(threads)
    return TRAIN_MACS_FACTOR * spec.macs() * batch_size * steps / elapsed


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
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"host": detect_hardware(), "embed_dim": embed_dim, "rates": rates}, indent=1))
    return out
