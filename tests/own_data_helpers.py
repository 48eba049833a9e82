"""A device's own data for tests: scikit-learn digits written out as PNG files, one folder per class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

DIGIT_CLASSES = tuple(str(i) for i in range(10))


def write_digit_pngs(root: Path, per_class: int, *, offset: int = 0, classes: tuple[int, ...] = tuple(range(10)),
                     prefix: str = "img") -> dict[int, list[Path]]:
    """``per_class`` real digits per class as 8-bit grey PNGs under ``root/<digit>/``; starts at the
    ``offset``-th image of each class (so later calls add different images)."""
    d = load_digits()
    pixels = (d.images * (255.0 / 16.0)).round().astype(np.uint8)
    out: dict[int, list[Path]] = {}
    for c in classes:
        idx = np.flatnonzero(d.target == c)[offset : offset + per_class]
        folder = root / str(c)
        folder.mkdir(parents=True, exist_ok=True)
        out[c] = []
        for k, i in enumerate(idx):
            path = folder / f"{prefix}_{offset + k:04d}.png"
            Image.fromarray(pixels[i], mode="L").save(path)
            out[c].append(path)
    return out


OWN_DATA_FLEET = """
[run]
method = "{method}"
rounds = {rounds}
dataset = "digits"
fleet = "{fleet}"
seed = 1

[data]
classes = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]

[train]
lr = 0.05
local_epochs = 1

[[devices]]
profile = "rpi4-2gb"
count = 2
arch = "tier-xs"
"""


def own_data_fleet(path: Path, *, method: str = "fedavg", rounds: int = 2, fleet: str = "own") -> Path:
    path.write_text(OWN_DATA_FLEET.format(method=method, rounds=rounds, fleet=fleet))
    return path
