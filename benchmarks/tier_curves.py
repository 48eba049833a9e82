"""Per-tier accuracy against training work, per task: the curves the planner trades time against (issue 48).

For each task (``fmnist``, ``digits``), each sample-count bucket and each draw, a device's share is drawn as a
fleet's Dirichlet(α) partition gives it: class proportions ~ Dir(α), ``n`` training images in those proportions.
Every model tier trains **alone** on that share from the same seed (the project's training loop,
:func:`fedge.edge.training.train_epochs`, at the planner's learning rate (``--lr``), last-batch floor
(``--min-tail``) and batch 64)
and is evaluated after 1, 2, 5, 10, 20 and 40 epochs on the test set weighted by the share's class proportions —
the device's *local* accuracy, what issue 48 promises does not drop. The curve of a (tier, bucket) is the median
over the draws, in percent, made non-decreasing in the work (a planner reads "accuracy reachable within this many
epochs"). Written to ``fedge/profiles/curves/<task>.json`` (what the planner reads) and
``benchmarks/results/tier_curves-<task>.json`` (every draw).

    python -m benchmarks.tier_curves                    # both tasks: 100 and 300 samples, one draw
    python -m benchmarks.tier_curves --samples 100,300,1000 --draws 3   # better curves, when the CPU allows
    python -m benchmarks.tier_curves --tasks digits --draws 1 --samples 100 --epochs 1,2   # a quick look

Niced, one thread: ``OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.tier_curves``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, text_table
from fedge.common.archs import TIERS
from fedge.edge.data.datasets import load_dataset
from fedge.edge.models.zoo import build_model
from fedge.edge.training import TrainConfig, accuracy, predict, train_epochs
from fedge.fleet.sections import TrainSection
from fedge.profiles.accuracy import CURVES_DIR
from fedge.profiles.planner import DEFAULT_LR, MIN_BATCH

SAMPLES = (100, 300)
EPOCHS = (1, 2, 5, 10, 20, 40)
ALPHA = 0.5  # the Dirichlet α of the held-out fleets issue 48 measured on
BATCH = 64  # the planner's default batch
TEST_CAP = 1000  # test images per evaluation (a random subset: evaluating 10,000 six times costs as much as training)


def draw_share(y: np.ndarray, n: int, alpha: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, class proportions): ``n`` images in Dir(α) class proportions (at least one class)."""
    classes = np.unique(y)
    p = rng.dirichlet(np.full(len(classes), alpha))
    counts = np.floor(p * n).astype(int)
    counts[np.argmax(p)] += n - counts.sum()
    idx = [rng.choice(np.flatnonzero(y == c), size=min(k, int((y == c).sum())), replace=False)
           for c, k in zip(classes, counts, strict=True) if k > 0]
    share = np.concatenate(idx)
    props = np.bincount(y[share], minlength=len(classes)) / len(share)
    return share, props


def local_accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, props: np.ndarray) -> float:
    """Test accuracy weighted by the share's class proportions (its local distribution), in [0, 1]."""
    pred = predict(model, x)
    per_class = np.array([(pred[y == c] == c).mean() if (y == c).any() else 0.0 for c in range(len(props))])
    return float((per_class * props).sum())


def run_draw(task: str, n: int, draw: int, epochs: tuple[int, ...], train: Any, test: Any,
             lr: float, min_tail: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(1000 * draw + n)
    share, props = draw_share(train.y, n, ALPHA, rng)
    defaults = TrainSection()
    cfg = TrainConfig(lr=lr, batch_size=BATCH, momentum=defaults.momentum, weight_decay=defaults.weight_decay,
                      min_tail=min_tail)
    out: dict[str, Any] = {"task": task, "samples": n, "draw": draw, "classes": int((props > 0).sum()), "tiers": {}}
    for tier in TIERS:
        t0 = time.process_time()
        model = build_model(f"tier-{tier}", seed=draw, num_classes=len(train.classes))
        accs, done = [], 0
        trng = np.random.default_rng(draw)
        for e in epochs:
            train_epochs(model, train.x[share], train.y[share], cfg, trng, epochs=e - done)
            done = e
            accs.append(round(100 * local_accuracy(model, test.x, test.y, props), 2))
        out["tiers"][tier] = {"local_acc": accs, "global_acc": round(100 * accuracy(model, test.x, test.y), 2),
                              "cpu_s": round(time.process_time() - t0, 1)}
        print(f"  {task} n={n} draw {draw} tier-{tier}: {accs} ({out['tiers'][tier]['cpu_s']} s)", flush=True)
    return out


def _monotone(xs: list[float]) -> list[float]:
    best, out = 0.0, []
    for x in xs:
        best = max(best, x)
        out.append(round(best, 2))
    return out


def summarise(task: str, cells: list[dict[str, Any]], samples: tuple[int, ...], epochs: tuple[int, ...],
              command: str, lr: float, min_tail: int = 1) -> dict[str, Any]:
    curves: dict[str, dict[str, list[float]]] = {}
    for tier in TIERS:
        curves[tier] = {}
        for n in samples:
            rows = [c["tiers"][tier]["local_acc"] for c in cells if c["samples"] == n]
            curves[tier][str(n)] = _monotone([statistics.median(col) for col in zip(*rows, strict=True)])
    return {"task": task, "measure": "local accuracy %, median over draws, non-decreasing in epochs",
            "alpha": ALPHA, "batch": BATCH, "lr": lr, "min_tail": min_tail, "draws": len(cells) // len(samples),
            "samples": list(samples), "epochs": list(epochs), "curves": curves, "command": command,
            "measured": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="fmnist,digits")
    ap.add_argument("--samples", default=",".join(map(str, SAMPLES)))
    ap.add_argument("--epochs", default=",".join(map(str, EPOCHS)))
    ap.add_argument("--draws", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=CURVES_DIR, help="where the planner's curve files go")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR,
                    help=f"learning rate, constant (default the planner's first-round rate, {DEFAULT_LR:g}; the "
                         "shipped curves used 0.1)")
    ap.add_argument("--min-tail", type=int, default=MIN_BATCH,
                    help=f"an epoch's last batch smaller than this joins the one before (default the planner's, "
                         f"{MIN_BATCH}; the shipped curves kept every last batch, 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    samples = tuple(int(s) for s in args.samples.split(","))
    epochs = tuple(int(e) for e in args.epochs.split(","))
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.tier_curves", *given])
    for task in args.tasks.split(","):
        train, test = load_dataset(task, train=True), load_dataset(task, train=False)
        keep = np.random.default_rng(0).permutation(len(test.y))[:TEST_CAP]
        test = test.subset(keep)
        cells = [run_draw(task, n, d, epochs, train, test, args.lr, args.min_tail)
                 for n in samples for d in range(args.draws)]
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"tier_curves-{task}.json").write_text(json.dumps(cells, indent=1))
        doc = summarise(task, cells, samples, epochs, command, args.lr, args.min_tail)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{task}.json").write_text(json.dumps(doc, indent=1) + "\n")
        rows = [[f"tier-{t}", str(n), *[f"{a:.1f}" for a in doc["curves"][t][str(n)]]] for t in TIERS for n in samples]
        print(f"\n{task}: local accuracy % after this many epochs (median of {args.draws} draws)")
        print(text_table(["tier", "samples", *[f"{e} ep" for e in epochs]], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
