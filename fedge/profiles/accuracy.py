"""Per-tier accuracy against training work, per task: what the planner weighs a tier's time against (issue 48).

``fedge/profiles/curves/<task>.json`` holds, for each model tier and a few local sample counts, the median local
accuracy (percent) a tier reaches training alone after 1, 2, 5, 10, 20 and 40 epochs on a Dirichlet(0.5) share of
the task's training set — measured once by ``python -m benchmarks.tier_curves`` (the file names its command).
:meth:`AccuracyCurves.expected` interpolates it linearly in log(samples) and log(epochs) and holds the ends.

No torch here: the planner stays torch-free.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.common.archs import TIERS
from fedge.errors import ProfileError
from fedge.profiles.speed import interp_clamped

CURVES_DIR = Path(__file__).resolve().parent / "curves"
REFRESH = "python -m benchmarks.tier_curves"


@dataclass(frozen=True)
class AccuracyCurves:
    """One task's curves: ``curves[tier][samples]`` = accuracy % after each of ``epochs``."""

    task: str
    samples: tuple[int, ...]
    epochs: tuple[float, ...]
    curves: Mapping[str, Mapping[int, tuple[float, ...]]]
    source: str

    def expected(self, tier: str, samples: int, epochs: float) -> float:
        """Expected local accuracy (%) of ``tier`` after ``epochs`` epochs over ``samples`` local samples."""
        row = self.curves[tier]
        by_n = [interp_clamped(math.log(max(epochs, 1e-9)), [math.log(e) for e in self.epochs], list(row[n]))
                for n in self.samples]
        return interp_clamped(math.log(max(samples, 1)), [math.log(n) for n in self.samples], by_n)


def parse_curves(doc: Mapping[str, Any], *, source: str) -> AccuracyCurves:
    """Check a curve document (``<task>.json``) and build its :class:`AccuracyCurves`."""
    hint = f"regenerate it with `{REFRESH}`"
    try:
        samples = tuple(int(n) for n in doc["samples"])
        epochs = tuple(float(e) for e in doc["epochs"])
        raw = doc["curves"]
        task = str(doc["task"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{source}: not an accuracy-curve file ({exc!r}: needs task, samples, epochs, curves)",
                           hint=hint) from exc
    if not samples or list(samples) != sorted(set(samples)) or samples[0] < 1:
        raise ProfileError(f"{source}: samples = {list(samples)}: must be ascending positive counts", hint=hint)
    if not epochs or list(epochs) != sorted(set(epochs)) or epochs[0] <= 0:
        raise ProfileError(f"{source}: epochs = {list(epochs)}: must be ascending and positive", hint=hint)
    missing = [t for t in TIERS if t not in raw]
    if missing:
        raise ProfileError(f"{source}: no curve for tier(s) {', '.join(missing)}", hint=hint)
    curves: dict[str, dict[int, tuple[float, ...]]] = {}
    for tier in TIERS:
        curves[tier] = {}
        for n in samples:
            row = raw[tier].get(str(n)) if isinstance(raw[tier], Mapping) else None
            if (not isinstance(row, list) or len(row) != len(epochs)
                    or not all(isinstance(a, int | float) and 0 <= a <= 100 for a in row)):
                raise ProfileError(f"{source}: curves.{tier}.{n} must list {len(epochs)} accuracies in percent "
                                   f"(0-100), one per epoch count {list(epochs)}", hint=hint)
            curves[tier][n] = tuple(float(a) for a in row)
    return AccuracyCurves(task, samples, epochs, curves, source)


@functools.cache
def load_curves(task: str, directory: Path = CURVES_DIR) -> AccuracyCurves | None:
    """The curves of ``task`` (a data set name), or None when none were measured for it."""
    path = directory / f"{task}.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc})", hint=f"regenerate it with `{REFRESH}`") from exc
    return parse_curves(doc, source=str(path))


def available_tasks(directory: Path = CURVES_DIR) -> tuple[str, ...]:
    """The tasks with measured curves."""
    return tuple(sorted(p.stem for p in directory.glob("*.json")))
