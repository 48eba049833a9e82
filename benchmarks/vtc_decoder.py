"""Do FedVTC's decoded images differ within a class? A minutes-long look at one device's decoder.

FedVTC fine-tunes each model on images its decoder ψ_k decodes from v = c^y + σ ⊙ ε. If ψ_k
ignores where in the class v lies, every sample of a class is the same template and the
fine-tuning pass sees ~C distinct images, however many it draws. This script takes one device
of table 2's fleet (``benchmarks.generative``: 20 devices, Dirichlet α over 20 % of
Fashion-MNIST, CNN-K with p = 64) — the real device half, built by ``fedge.fleet.devices`` from the
same config — and:

1. trains its model alone for ``--model-epochs`` (SGD, table 2's settings) and freezes it;
2. for each reconstruction noise s in ``--noise`` (``[method] recon_noise``; the paper's s = 1)
   trains a fresh decoder of ``--tier`` with fedge's own decoder epoch (reconstruction only: no
   global statistics exist in this setting, so no DM), from the same initial weights;
3. after epochs 1, 5, 10, 20, 40, … reports the reconstruction error ‖ψ(g(x)) − x‖² (summed over
   pixels, mean over images) and the *diversity ratio*: for each class with ≥ 20 samples, the
   per-pixel standard deviation over decodes of c_k^y + σ_k ⊙ ε (the device's own statistics,
   ``fedge.edge.methods.fedvtc.local_statistics``)
   divided by the same over its real images, averaged over pixels and classes (1 = as varied as
   the data, 0 = one template per class).

    python -m benchmarks.vtc_decoder --alpha 0.1 --seed 0 --device 18 --noise 1.0 0.1 --epochs 40

Writes ``benchmarks/results/vtc_decoder/a<alpha>-s<seed>-d<device>-<tier>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, text_table
from benchmarks.generative.rows import build_config, table2_methods
from fedge.edge.methods.fedvtc import FedVTCDevice
from fedge.edge.training import train_epochs
from fedge.fleet.devices import build_device, load_fleet_data

OUT = RESULTS / "vtc_decoder"
MIN_CLASS = 20  # classes with fewer samples are left out of the diversity ratio


def diversity(m: FedVTCDevice, z: torch.Tensor, stats: tuple[np.ndarray, np.ndarray, np.ndarray],
              gen: torch.Generator) -> tuple[float, float]:
    """(reconstruction error, diversity ratio) of the device's decoder, as the module docstring defines.

    ``z``: the frozen model's features of the device's training images; ``stats``: its per-class
    means, σ_k and class counts (``local_statistics``).
    """
    protos, sigma, counts = stats
    y = m.ctx.train.y
    m.decoder.eval()
    with torch.no_grad():
        recon = m.decoder(z).numpy()
        v = torch.from_numpy(protos[y]) + torch.from_numpy(sigma) * torch.randn(z.shape, generator=gen)
        samples = m.decoder(v).numpy()
    real = m.x01.numpy()
    err = float(((recon - real) ** 2).reshape(len(real), -1).sum(1).mean())
    ratios = []
    for c in np.flatnonzero(counts >= MIN_CLASS):
        sel = y == c
        ratios.append(samples[sel].std(0).mean() / max(float(real[sel].std(0).mean()), 1e-8))
    return err, float(np.mean(ratios)) if ratios else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    base = build_config(table2_methods(20)["fedvtc"], args.seed, devices=20, alpha=args.alpha, fraction=0.2)
    data = load_fleet_data(base)
    idx = args.device - 1  # client-N is the fleet's N-th device
    checkpoints = {e for e in (1, 5, 10, 20, 40, 80, 160) if e <= args.epochs} | {args.epochs}
    out: dict[str, Any] = {"alpha": args.alpha, "seed": args.seed, "device": f"client-{args.device}",
                           "tier": args.tier, "model_epochs": args.model_epochs, "runs": {}}
    for s in args.noise:
        cfg = dataclasses.replace(base, method={"generator_tier": args.tier, "recon_noise": s})
        m = build_device(cfg, data, idx).method
        assert isinstance(m, FedVTCDevice)
        ctx = m.ctx
        out["model"] = ctx.model.spec.name
        out["class_counts"] = np.bincount(ctx.train.y, minlength=ctx.num_classes).tolist()
        t0 = time.perf_counter()
        train_epochs(ctx.model, ctx.train.x, ctx.train.y, ctx.train_cfg, ctx.rng, epochs=args.model_epochs)
        stats = m._refresh_local_sigma()  # σ_k of the frozen model, as the last alternation of a round sets it
        ctx.model.eval()
        with torch.no_grad():
            z = ctx.model.features(torch.from_numpy(ctx.train.x))  # the model stays frozen from here on
        gen = torch.Generator().manual_seed(args.seed)
        curve = []
        for ep in range(1, args.epochs + 1):
            m._decoder_epoch()
            if ep in checkpoints:
                err, ratio = diversity(m, z, stats, gen)
                curve.append({"epoch": ep, "recon_error": err, "diversity": ratio})
                print(f"s = {s}: epoch {ep:3d}  recon error {err:6.1f}  diversity {ratio:.2f}", flush=True)
        out["runs"][str(s)] = {"curve": curve, "seconds": time.perf_counter() - t0}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=int, default=18, help="client-N of table 2's fleet (1-20)")
    p.add_argument("--tier", default="tiny", choices=("tiny", "small", "paper"))
    p.add_argument("--noise", type=float, nargs="+", default=[1.0, 0.1], help="recon_noise values")
    p.add_argument("--model-epochs", type=int, default=20)
    p.add_argument("--epochs", type=int, default=40, help="decoder epochs")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if not 1 <= args.device <= 20:
        p.error(f"--device must be 1-20 (table 2 has 20 devices), got {args.device}")
    out = run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"a{args.alpha}-s{args.seed}-d{args.device}-{args.tier}.json"
    path.write_text(json.dumps(out, indent=1))
    header = ["recon_noise", *[f"ep {c['epoch']}" for c in next(iter(out["runs"].values()))["curve"]]]
    rows = [[s, *[f"{c['recon_error']:.1f} / {c['diversity']:.2f}" for c in r["curve"]]]
            for s, r in out["runs"].items()]
    print(f"\n{out['device']} ({out['model']}, classes {out['class_counts']}): recon error / diversity ratio")
    print(text_table(header, rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
