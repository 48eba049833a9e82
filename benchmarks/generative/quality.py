"""How good a cell's generator is: classifier accuracy on synthetic data (issue 43).

Trained on generated samples, tested on real ones (the "classification accuracy score" of generative-model
evaluation): a fresh network of one architecture learns from ``n`` samples of the fleet's generator (labels
uniform over the classes) and is scored on the real test set; the same network from the same start trained on
as many real training samples (the fleet's own shares) is the reference, so ``ratio`` = synthetic / real says how
much of the real data's worth the samples carry. Image level (GeFL): the whole network on generated images.
Feature level (GeFL-F): the head (everything after the common extractor) on generated features, tested on the real
test images through the fleet's frozen extractor — what GeFL-F's head stage learns from.

Every device holds the same averaged generator (and GeFL-F the same extractor), so the first device's are used.
Each cell records the figure when it finishes; for a cell still running, the figure of a kept checkpoint (the last
generator round: GeFL-F's CVAE-F is frozen from then on, so it is the cell's final figure too):

    python -m benchmarks.generative.quality --method geflf-cvae --quick --seed 0 --round 15

writes ``results/generative/quality/KEY[-quick]-sSEED-rROUND.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from benchmarks.generative.checkpoint import checkpoint_dir, fleet_at, kept_path
from benchmarks.generative.rows import build_config, table1_methods
from fedge.edge.generators.train import sample_dataset
from fedge.edge.methods.gefl import GeFLDevice, GenerativeMixin
from fedge.edge.methods.geflf import GeFLFDevice, stem_features
from fedge.edge.models.zoo import EXTRACTOR, FedgeNet, build_model
from fedge.edge.training import TrainConfig, accuracy, train_epochs
from fedge.fleet.devices import SimDevice

# The probe: CNN-1 (one conv block and a linear layer on the stem), trained like a device (SGD, batch 64).
PROBE_ARCH = "cnn1"
PROBE_EPOCHS = 10
PROBE_TRAIN = TrainConfig(lr=0.1, batch_size=64, local_epochs=PROBE_EPOCHS)


def synthetic_accuracy(devices: list[SimDevice], *, samples: int = 6000, seed: int = 0,
                       arch: str = PROBE_ARCH, epochs: int = PROBE_EPOCHS) -> dict[str, Any] | None:
    """Accuracy on the real test set of ``arch`` trained on ``samples`` generated samples and on as many real
    ones (None: the cell has no generator, or it was never averaged)."""
    method = devices[0].method
    if not isinstance(method, GenerativeMixin) or not method.generator_loaded or method.ctx.global_test is None:
        return None
    t0 = time.perf_counter()
    test = method.ctx.global_test
    real_x = np.concatenate([d.method.ctx.train.x for d in devices])
    real_y = np.concatenate([d.method.ctx.train.y for d in devices])
    pick = np.random.default_rng(seed).permutation(len(real_y))[:samples]
    real_x, real_y = real_x[pick], real_y[pick]
    gen_x, gen_y = sample_dataset(method.generator, len(real_y), np.arange(method.ctx.num_classes),
                                  torch.Generator().manual_seed(seed))
    if isinstance(method, GeFLFDevice):
        level = "feature"
        model = method.ctx.model  # the fleet's extractor: frozen since the warm-up
        test_x, real_x = stem_features(model, test.x), stem_features(model, real_x)
    elif isinstance(method, GeFLDevice):
        level = "image"
        test_x, gen_x = test.x, method.from_gen_space(gen_x)
    else:
        return None
    scores = {}
    for name, (x, y) in (("synthetic", (gen_x, gen_y)), ("real", (real_x, real_y))):
        scores[name] = _probe_accuracy(x, y, test_x, test.y, level=level, arch=arch, epochs=epochs, seed=seed)
    return {"level": level, "arch": arch, "epochs": epochs, "samples": len(real_y),
            "acc_synthetic": scores["synthetic"], "acc_real": scores["real"],
            "ratio": scores["synthetic"] / scores["real"] if scores["real"] else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def _probe_accuracy(x: np.ndarray, y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, *, level: str,
                    arch: str, epochs: int, seed: int) -> float:
    """A fresh ``arch`` (seed ``seed``) trained on (x, y), its accuracy on (test_x, test_y); at the feature
    level only its head trains and both sets are stem features."""
    model = build_model(arch, seed=seed)
    rng = np.random.default_rng(seed)
    if level == "image":
        train_epochs(model, x, y, PROBE_TRAIN, rng, epochs=epochs)
        return accuracy(model, test_x, test_y)
    head = _Head(model)
    params = [p for n, p in model.named_parameters() if not n.startswith(EXTRACTOR)]

    def forward(zb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.from_stem(zb)
        return logits, logits

    train_epochs(model, x, y, PROBE_TRAIN, rng, epochs=epochs, params=params, forward=forward)
    return accuracy(head, test_x, test_y)


class _Head(torch.nn.Module):
    """A network from its stem's output on: what GeFL-F's head stage trains."""

    def __init__(self, model: FedgeNet) -> None:
        super().__init__()
        self.model = model

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model.from_stem(z)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, help="a table-1 row key (rows.py)")
    ap.add_argument("--quick", action="store_true", help="the row of table 1's --quick schedule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round", type=int, required=True, help="the kept checkpoint's round (ckpt/CELL@rROUND.pt)")
    args = ap.parse_args()
    from benchmarks.generative.runner import OUT  # runner imports this module for the per-cell figure

    torch.set_num_threads(1)
    m = table1_methods(False, args.quick)[args.method]
    cell = f"{m.key}{'-quick' if args.quick else ''}-s{args.seed}-r{m.rounds}"
    path = kept_path(checkpoint_dir(OUT / "table1" / f"{cell}.json"), args.round)
    if not path.is_file():
        raise SystemExit(f"{path}: no kept checkpoint of round {args.round} (rows that others fork from keep it)")
    cfg = build_config(m, args.seed)
    out = {"cell": cell, "round": args.round, "config": dict(cfg.method),
           "synthetic_accuracy": synthetic_accuracy(fleet_at(cfg, path), seed=args.seed)}
    dest = OUT / "quality" / f"{cell.rsplit('-r', 1)[0]}-r{args.round}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
