"""The speed model's size curve and the sampling target of issue 27 (figures for docs/results.md, not tests).

``curve``: how much of a core's GEMM rate training the zoo's tiers reaches, per SIMD width. One thread of
this host trains each tier at each batch (training MACs per CPU second, as ``fedge emulate`` calibrates,
:func:`fedge.emulate.calibrate.host_mac_rate`) and multiplies two 512 x 512 fp32 matrices; the ratio is
the fraction of the GEMM rate the tier reaches. Each SIMD width is measured in a child process whose
oneDNN, MKL and ATen kernels are limited to that width (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``,
``ATEN_CPU_CAPABILITY``): 4 fp32 lanes (SSE4.1, the width of ARM's 128-bit NEON) and 8 (AVX2). The
median over ``--repeats`` runs is what :data:`fedge.profiles.speed.SIZE_CURVE` holds.

``sampling``: 10 % of a 200-device fleet per round against full participation at equal device compute
(the same number of device-rounds of training), accuracy and bytes per round.

    python -m benchmarks.clock curve [--repeats 3]
    python -m benchmarks.clock sampling [--devices 200] [--sample 0.1] [--rounds 30]

Writes benchmarks/results/clock-curve.json / clock-sampling.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import RESULTS, text_table

# SIMD width (fp32 lanes) -> the environment that limits torch's kernels to it.
ISA_ENV: dict[int, dict[str, str]] = {
    4: {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
    8: {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
BATCHES = (8, 16, 32, 64)


def gemm_rate(n: int = 512, seconds: float = 1.5) -> float:
    """fp32 multiply-accumulates per CPU second of one thread multiplying n x n matrices."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    steps, t0 = 0, time.process_time()
    while (elapsed := time.process_time() - t0) < seconds or steps < 3:
        a @ b
        steps += 1
    return n**3 * steps / elapsed


def measure_once(seconds: float) -> dict[str, Any]:
    """One run in this process: the GEMM rate and every tier's training rate at every batch."""
    from fedge.common.archs import TIERS
    from fedge.emulate.calibrate import host_mac_rate

    gemm = gemm_rate(seconds=seconds)
    rates = {f"tier-{t}@{b}": host_mac_rate(f"tier-{t}", b, seconds=seconds) for t in TIERS for b in BATCHES}
    gemm = (gemm + gemm_rate(seconds=seconds)) / 2  # before and after: the host's load drifts
    return {"gemm_mac_s": gemm, "train_mac_s": rates, "fraction": {k: r / gemm for k, r in rates.items()}}


def curve(repeats: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": repeats, "seconds": seconds, "widths": {}}
    for lanes, env in ISA_ENV.items():
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-m", "benchmarks.clock", "_once", "--seconds", str(seconds)],
                                  env={**os.environ, **env}, capture_output=True, text=True, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        keys = runs[0]["fraction"]
        out["widths"][str(lanes)] = {
            "env": env,
            "gemm_gmac_s": [r["gemm_mac_s"] / 1e9 for r in runs],
            "fraction": {k: round(statistics.median(r["fraction"][k] for r in runs), 3) for k in keys},
        }
    return out


def print_curve(res: dict[str, Any]) -> None:
    from fedge.common.archs import TIERS

    for lanes, w in res["widths"].items():
        gemm = ", ".join(f"{g:.1f}" for g in w["gemm_gmac_s"])
        print(f"\n{lanes} fp32 lanes ({w['env']['ONEDNN_MAX_CPU_ISA']}); GEMM {gemm} GMAC/s per core")
        rows = [[f"tier-{t}", *(f"{w['fraction'][f'tier-{t}@{b}']:.3f}" for b in BATCHES)] for t in TIERS]
        print(text_table(["model", *(f"batch {b}" for b in BATCHES)], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.clock", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("curve", help="the size curve of the speed model")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--seconds", type=float, default=1.5)
    o = sub.add_parser("_once", help=argparse.SUPPRESS)
    o.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args(argv)
    if args.what == "_once":
        print(json.dumps(measure_once(args.seconds)))
        return 0
    if args.what == "curve":
        res = curve(args.repeats, args.seconds)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "clock-curve.json").write_text(json.dumps(res, indent=1))
        print_curve(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
