"""One device's share of a fleet, each tier trained alone on it: local accuracy after 5-40 epochs (issue 48).

Tells a tier's capacity on that device's data apart from what a federated method made of it:

    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.share_alone benchmarks/fleets/issue48.toml 1 s,m [LR [MIN_TAIL]]

(device 1 of the issue-48 fleet is rpi-zero-2w-2; LR default the planner's; MIN_TAIL: an epoch's last batch smaller
than this joins the one before, default 1 (every last batch kept, as the curves of benchmarks.tier_curves were
measured; the planner's default is 8)). Prints the accuracies after 5, 8, 10, 20 and 40 epochs; nothing is written.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from fedge.edge.data.datasets import load_dataset
from fedge.edge.models.zoo import build_model
from fedge.edge.training import TrainConfig, accuracy, train_epochs
from fedge.fleet.config import load_fleet
from fedge.fleet.slots import fleet_splits
from fedge.profiles.planner import DEFAULT_LR


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg, dev, tiers = load_fleet(args[0]), int(args[1]), args[2].split(",")
    lr = float(args[3]) if len(args) > 3 else cfg.train.lr or DEFAULT_LR
    min_tail = int(args[4]) if len(args) > 4 else 1
    torch.set_num_threads(1)
    train = load_dataset(cfg.run.dataset, train=True, seed=cfg.run.seed)
    share = fleet_splits(cfg, train.y)[dev]
    x, y = train.x[share.train], train.y[share.train]
    xt, yt = train.x[share.test], train.y[share.test]
    print(f"device {dev}: {len(y)} training, {len(yt)} local test images; classes "
          f"{np.bincount(y, minlength=len(train.classes)).tolist()}", flush=True)
    for tier in tiers:
        t0 = time.process_time()
        model = build_model(f"tier-{tier}", seed=dev, num_classes=len(train.classes))
        rng = np.random.default_rng(dev)
        batch = 64 if tier in ("xs", "s") else 32  # as the Pi Zero 2 W's plan: tier-m and up at batch 32
        done, accs = 0, []
        for e in (5, 8, 10, 20, 40):  # 8: the synchronous schedule of a pinned tier-xl on issue 48's Zeros
            train_epochs(model, x, y, TrainConfig(lr=lr, batch_size=batch, min_tail=min_tail), rng, epochs=e - done)
            done = e
            accs.append(f"{e} ep {100 * accuracy(model, xt, yt):.1f} %")
        print(f"tier-{tier}: {', '.join(accs)} ({time.process_time() - t0:.0f} s CPU)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
