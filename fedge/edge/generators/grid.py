"""Image grids of generator samples (``fedge simulate ... --samples``) and generator checkpoints.

One grid per *distinct* generator: devices that average a generator share one
grid (keyed by its artifact, e.g. ``generator-image-cvae-tiny``); FedVTC's
decoders are per device, so each device gets its own. Rows are classes, so a
person can see at a glance whether class conditioning works. Feature-level
samples (3×16×16 extractor maps) are shown as RGB, each sample min-max scaled.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from fedge.edge.models.checkpoint import save_checkpoint

log = logging.getLogger(__name__)


def to_display(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) samples -> (N, H, W, 3) floats in [0, 1]: grey images as is, 3-channel maps rescaled."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[1] == 1:
        return np.repeat(np.clip(x, 0.0, 1.0), 3, axis=1).transpose(0, 2, 3, 1)
    rgb = x[:, :3]
    lo = rgb.min(axis=(1, 2, 3), keepdims=True)
    hi = rgb.max(axis=(1, 2, 3), keepdims=True)
    return ((rgb - lo) / np.maximum(hi - lo, 1e-8)).transpose(0, 2, 3, 1)


def image_grid(x: np.ndarray, ncol: int, pad: int = 1) -> np.ndarray:
    """Tile (N, C, H, W) samples row-major into one (rows·(H+pad)+pad, ncol·(W+pad)+pad, 3) image."""
    imgs = to_display(x)
    n, h, w, _ = imgs.shape
    rows = max(1, -(-n // ncol))
    grid = np.ones((rows * (h + pad) + pad, ncol * (w + pad) + pad, 3), dtype=np.float32)
    for i, img in enumerate(imgs):
        r, c = divmod(i, ncol)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = img
    return grid


def save_grid(path: str | os.PathLike[str], x: np.ndarray, ncol: int) -> Path:
    """Write samples as a PNG grid (rows = classes when ``ncol`` = samples per class)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    big = np.kron(image_grid(x, ncol), np.ones((3, 3, 1), dtype=np.float32))  # upscale ×3 for viewing
    plt.imsave(path, big)
    return path


def write_sample_grids(methods: Iterable[Any], out_dir: str | os.PathLike[str], per_class: int = 8,
                       ids: Iterable[str] | None = None) -> list[Path]:
    """A grid and a checkpoint per distinct generator among device ``methods``.

    A method takes part if it has ``grid_samples(per_class)`` (GeFL, GeFL-F, FedVTC);
    methods without a trained generator are skipped. Writes ``samples/<key>.png``
    and ``checkpoints/generators/<key>.safetensors`` under ``out_dir``.
    """
    out = Path(out_dir)
    gen_dir = out / "checkpoints" / "generators"
    written: list[Path] = []
    seen: set[str] = set()
    index: dict[str, str] = {}  # device id -> the generator it used (fedge audit privacy reads it)
    id_list = list(ids) if ids is not None else None
    for i, m in enumerate(methods):
        fn = getattr(m, "grid_samples", None)
        if fn is None:
            continue
        dev = id_list[i] if id_list is not None else m.ctx.device_id
        key = getattr(m, "gen_artifact", None) or f"vtc-{dev}"
        if key in seen:
            index[dev] = key
            continue
        samples = fn(per_class)
        if samples is None:
            log.info("%s: no trained generator to sample", dev)
            continue
        seen.add(key)
        index[dev] = key
        written.append(save_grid(out / "samples" / f"{key}.png", samples[0], per_class))
        save_checkpoint(m.generator, gen_dir / f"{key}.safetensors", extra={"fedge.device": dev})
        latents = getattr(m, "latent_distribution", None)
        if latents is not None:  # FedVTC: the decoder samples around the global prototypes, with the global σ
            safetensors.numpy.save_file(latents(), str(gen_dir / f"{key}.latents.safetensors"))
    if index:
        (gen_dir / "index.json").write_text(json.dumps(index, indent=1))
    return written
