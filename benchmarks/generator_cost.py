"""What one local generator epoch costs per tier (issue 43): the time a generator round takes before running it.

For each generator (kind, output shape) and tier: parameters, CPU and wall seconds of one training epoch over
600 samples (one device's share on the GeFL protocol; batch 64, the published optimizer) and of drawing 600
samples, on one torch thread. A generator round of the GeFL protocol is ``gen_epochs`` (5) such epochs on each of
the 10 devices, one after another in a sequential simulation. The data are random (cost does not depend on it).

    python -m benchmarks.generator_cost                       # CVAE-F, CVAE and DCGAN at small and paper
    python -m benchmarks.generator_cost --tiers tiny small paper --kinds cvae-f

Writes ``results/generator_cost.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.common import RESULTS, markdown_table
from fedge.common.generators import GeneratorSpec
from fedge.edge.generators.modules import build_generator
from fedge.edge.generators.train import GeneratorTrainer, sample_dataset

KINDS = {"cvae-f": ("cvae", (3, 16, 16)), "cvae": ("cvae", (1, 32, 32)), "dcgan": ("dcgan", (1, 32, 32)),
         "dcgan-f": ("dcgan", (3, 16, 16)), "ddpm-f": ("ddpm", (3, 16, 16))}


def measure(kind: str, shape: tuple[int, int, int], tier: str, samples: int = 600) -> dict[str, object]:
    """One epoch of training over ``samples`` random samples and one draw of as many, timed."""
    spec = GeneratorSpec(kind, shape, tier=tier, num_classes=10)
    gen = build_generator(spec, seed=0)
    trainer = GeneratorTrainer(gen)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples)
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.fit(x, y, epochs=1, batch_size=64, rng=rng, gen=torch.Generator().manual_seed(0))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    draw = time.process_time()
    sample_dataset(gen, samples, np.arange(10), torch.Generator().manual_seed(0))
    return {"kind": kind, "shape": list(shape), "tier": tier, "params": spec.num_params(), "samples": samples,
            "epoch_cpu_s": round(cpu, 2), "epoch_wall_s": round(wall, 2),
            "sample_cpu_s": round(time.process_time() - draw, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["cvae-f", "cvae", "dcgan"])
    ap.add_argument("--tiers", nargs="+", default=["small", "paper"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.kinds:
        kind, shape = KINDS[name]
        for tier in args.tiers:
            rows.append({"generator": name, **measure(kind, shape, tier)})
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "generator_cost.json").write_text(json.dumps({"rows": rows, "threads": 1}, indent=1))
    print(markdown_table(["generator", "tier", "params", "epoch CPU s (600)", "round CPU s (10 x 5 epochs)"],
                         [[str(r["generator"]), str(r["tier"]), f"{r['params']:,}", str(r["epoch_cpu_s"]),
                           f"{50 * float(str(r['epoch_cpu_s'])):.0f}"] for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
