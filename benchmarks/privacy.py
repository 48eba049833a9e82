"""Privacy benchmark: memorization (MND) of each method's generators, and accuracy against ε.

Two parts, each resumable (one JSON cell per run under benchmarks/results/privacy/):

* ``mnd``: GeFL-CVAE, GeFL-F (CVAE-F) and FedVTC on a table-1-like fleet — CNN-1 ... CNN-10,
  one device each, IID — reduced to what two shared cores run: digits (about 134 training
  images per device) and short schedules. Each run is audited with ``fedge audit privacy``
  (the same code: :func:`fedge.audit.privacy.audit_run`).
* ``dp``: FedProto and FedVTC under ``[privacy] epsilon`` ∈ {1, 4, 16} and without ``[privacy]``
  (ε = ∞), at Dirichlet α = 0.1 and 1.0, on the 6-device digits fleet of examples/; and the same
  fleet under ``method = "local"`` (nothing shared) for as many rounds, the accuracy without federation.

    python -m benchmarks.privacy mnd
    python -m benchmarks.privacy dp
    python -m benchmarks.privacy report     # tables + docs/results.md section from the saved cells
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, cached_cell, markdown_table, text_table, write_docs_section

OUT = RESULTS / "privacy"
RUNS = OUT / "runs"
ARCHS = [f"cnn{k}" for k in range(1, 11)]
ARCHS_P64 = [f"cnn{k}-p64" for k in range(1, 11)]

MND_METHODS: dict[str, str] = {
    # name -> [run] + [method] tables (digits, 10 devices, IID)
    "gefl-cvae": 'method = "gefl"\nrounds = 20\n\n[method]\ngenerator = "cvae"\ngenerator_tier = "small"\n'
                 'gen_rounds = 15\n',
    "geflf-cvae": 'method = "geflf"\nrounds = 25\n\n[method]\ngenerator = "cvae"\ngenerator_tier = "small"\n'
                  'warmup_rounds = 5\ngen_rounds = 15\n',
    "fedvtc": 'method = "fedvtc"\nrounds = 15\n\n[method]\ngenerator_tier = "small"\n',
}
EPSILONS: tuple[float, ...] = (1.0, 4.0, 16.0, math.inf)
ALPHAS = (0.1, 1.0)
DP_ROUNDS = {"fedproto": 10, "fedproto-pi": 10, "fedvtc": 6}
# dp rows -> (the [run] method, its [method] table): FedProto classifies with each device's head by default (the
# global prototypes only enter training through λ‖g(x) − c_y‖²); "fedproto-pi" classifies by the nearest global
# prototype, as the paper does, so the noised prototypes are what its accuracy measures.
DP_METHODS = {"fedproto": ("fedproto", ""), "fedproto-pi": ("fedproto", '\n[method]\ninference = "prototype"\n'),
              "fedvtc": ("fedvtc", '\n[method]\ngenerator_tier = "tiny"\n'), "local": ("local", "")}


# mnd_config and dp_config begin with a comment naming this script by its old path: the text is part of
# each saved cell's config, which a run compares with the saved one, so changing it would recompute every cell.
def mnd_config(name: str) -> str:
    body = MND_METHODS[name]
    archs = ARCHS_P64 if name == "fedvtc" else ARCHS
    run, method = body.split("\n\n", 1)
    return f"""# benchmarks/privacy.py mnd: a table-1-like fleet on digits (CNN-1..10, IID), short schedule
[run]
name = "privacy-mnd-{name}"
{run}
dataset = "digits"
seed = 0
eval_every = 5

[partition]
kind = "iid"
local_test_fraction = 0.1

[train]
lr = 0.1
lr_schedule = "constant"
batch_size = 32
local_epochs = 2
min_tail = 1
val_fraction = 0.0

{method}
[[devices]]
profile = "x86-gateway"
count = 10
archs = [{", ".join(f'"{a}"' for a in archs)}]
id_prefix = "client"
"""


def dp_config(method: str, alpha: float, eps: float, rounds: int | None = None) -> str:
    """The dp fleet; ``method = "local"`` (no federation, ``rounds`` given) is the reference without sharing."""
    rounds = DP_ROUNDS[method] if rounds is None else rounds
    privacy = "" if math.isinf(eps) else f"\n[privacy]\nepsilon = {eps}\ndelta = 1e-5\nclip = 5.0\nsigma_clip = 1.0\n"
    base, extra = DP_METHODS[method]
    name = f"privacy-dp-{method}-a{alpha}-e{eps}" if method != "local" else f"privacy-dp-local{rounds}-a{alpha}"
    return f"""# benchmarks/privacy.py dp
[run]
name = "{name}"
method = "{base}"
rounds = {rounds}
dataset = "digits"
seed = 0
eval_every = {rounds}

[partition]
kind = "dirichlet"
alpha = {alpha}

[train]
lr = 0.05
lr_schedule = "constant"
local_epochs = 2
min_tail = 1
val_fraction = 0.0
{extra}{privacy}
[[devices]]
profile = "rpi4-2gb"
count = 3

[[devices]]
profile = "rpi5-8gb"
count = 3
"""


def simulate_dir(run_dir: Path, toml: str, *, samples: bool) -> dict[str, Any]:
    """Write the config into ``run_dir`` and run it as ``fedge simulate CONFIG --out RUN_DIR [--samples]``."""
    from fedge.edge.generators.grid import write_sample_grids
    from fedge.fleet.config import load_fleet
    from fedge.sim.report import build_results, write_results
    from fedge.sim.simulate import simulate

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(toml)
    res = simulate(load_fleet(cfg_path), out_dir=run_dir)
    results = build_results(res)
    write_results(results, run_dir)
    if samples:
        write_sample_grids([d.method for d in res.devices], run_dir)
    return results


def mnd_cell(name: str) -> dict[str, Any]:
    from fedge.audit.privacy import audit_run

    run_dir = RUNS / f"mnd-{name}"
    t0 = time.perf_counter()
    results = simulate_dir(run_dir, mnd_config(name), samples=True)
    t1 = time.perf_counter()
    report = audit_run(run_dir)
    return {"method": name, "config": mnd_config(name), "sim_seconds": t1 - t0,
            "audit_seconds": time.perf_counter() - t1, "acc": results["summary"]["mean_best_acc_global"],
            **audit_summary(report)}


def reaudit(name: str) -> dict[str, Any]:
    """Audit a saved cell's run again with the current audit code (the run itself is not repeated)."""
    from fedge.audit.privacy import audit_run

    f = OUT / f"mnd-{name}.json"
    c = json.loads(f.read_text())
    t0 = time.perf_counter()
    c.update(audit_summary(audit_run(RUNS / f"mnd-{name}")), audit_seconds=time.perf_counter() - t0)
    f.write_text(json.dumps(c, indent=1))
    return c


def audit_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The MND figures of a cell: means and minima over devices (and GeFL-F's inversion round trip)."""
    audits = report["audits"]
    rt = [a["roundtrip"] for a in audits if "roundtrip" in a]
    return {
        **({"roundtrip_pixel_ratio": statistics.fmean(r["pixel"]["ratio"] for r in rt),
            "roundtrip_feature_ratio": statistics.fmean(r["features"]["ratio"] for r in rt)} if rt else {}),
        "pixel_ratio": statistics.fmean(a["pixel"]["ratio"] for a in audits),
        "pixel_ratio_min": min(a["pixel"]["ratio"] for a in audits),
        "feature_ratio": statistics.fmean(a["features"]["ratio"] for a in audits),
        "feature_ratio_min": min(a["features"]["ratio"] for a in audits),
        "n_train": statistics.fmean(a["n_train"] for a in audits),
        "n_val": statistics.fmean(a["n_val"] for a in audits),
        "devices": len(audits), "feature_net_acc": report["feature_network"]["train_accuracy"],
        "audit": report,
    }


def dp_file(method: str, alpha: float, eps: float, draw: int = 1) -> Path:
    """A dp cell's file; draws 2, 3, ... repeat a cell with fresh noise (the noise is never seeded)."""
    return OUT / (f"dp-{method}-a{alpha}-e{eps}" + (f"-d{draw}" if draw > 1 else "") + ".json")


def dp_cell(method: str, alpha: float, eps: float, rounds: int | None = None, draw: int = 1) -> dict[str, Any]:
    run_dir = RUNS / (dp_file(method, alpha, eps, draw).stem if rounds is None else f"dp-local{rounds}-a{alpha}")
    t0 = time.perf_counter()
    results = simulate_dir(run_dir, dp_config(method, alpha, eps, rounds), samples=False)
    p = results.get("privacy") or {}
    return {"method": method, "alpha": alpha, "epsilon_target": None if math.isinf(eps) else eps,
            "config": dp_config(method, alpha, eps, rounds), "seconds": time.perf_counter() - t0,
            "acc_global": results["summary"]["mean_final_acc_global"],
            "acc_local": results["summary"]["mean_final_acc_local"],
            "epsilon_spent": p.get("epsilon"), "noise_multiplier": p.get("noise_multiplier")}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def report() -> str:
    parts = []
    mnd_rows = []
    for name in MND_METHODS:
        f = OUT / f"mnd-{name}.json"
        if f.is_file():
            c = json.loads(f.read_text())
            fig = Path(c["audit"]["audits"][0]["figure"])
            if fig.is_file():  # the first device's figure is kept beside the cells (the runs are not committed)
                shutil.copyfile(fig, OUT / f"closest-{name}.png")
            rt = (f"{c['roundtrip_pixel_ratio']:.3f} / {c['roundtrip_feature_ratio']:.3f}"
                  if "roundtrip_pixel_ratio" in c else "-")
            mnd_rows.append([name, f"{c['pixel_ratio']:.3f} (min {c['pixel_ratio_min']:.3f})",
                             f"{c['feature_ratio']:.3f} (min {c['feature_ratio_min']:.3f})", rt,
                             f"{c['n_train']:.0f} / {c['n_val']:.0f}", _pct(c["acc"]),
                             f"{c['sim_seconds']:.0f} + {c['audit_seconds']:.0f}"])
    mnd_header = ["method", "MND ratio, pixels (mean over devices)", "MND ratio, features",
                  "inverted held-out: ratio px / feat", "train / held-out",
                  "best acc %", "s (run + audit)"]
    dp_rows = []
    for method in DP_ROUNDS:
        for alpha in ALPHAS:
            row = [method, str(alpha)]
            for eps in EPSILONS:
                files = [dp_file(method, alpha, eps, d) for d in range(1, 10)]
                cells = [json.loads(f.read_text()) for f in files if f.is_file()]
                if cells:
                    z = cells[0]["noise_multiplier"]
                    row.append("; ".join(f"{_pct(c['acc_global'])} / {_pct(c['acc_local'])}" for c in cells)
                               + (f" (z {z:.2g})" if z else ""))
                else:
                    row.append("-")
            dp_rows.append(row)
    for rounds in sorted(set(DP_ROUNDS.values()), reverse=True):  # the reference: no sharing at all
        for alpha in ALPHAS:
            f = OUT / f"dp-local{rounds}-a{alpha}.json"
            if f.is_file():
                c = json.loads(f.read_text())
                dp_rows.append([f"local ({rounds} rounds, nothing shared)", str(alpha),
                                *(["-"] * (len(EPSILONS) - 1)), f"{_pct(c['acc_global'])} / {_pct(c['acc_local'])}"])
    dp_header = ["method", "α", *[("ε = ∞" if math.isinf(e) else f"ε = {e:g}") for e in EPSILONS]]
    print(text_table(mnd_header, mnd_rows))
    print()
    print(text_table(dp_header, dp_rows))
    parts.append("Memorization (`python -m benchmarks.privacy mnd`): digits, 10 devices CNN-1..10 (FedVTC: "
                 "cnnK-p64), IID, seed 0, 121 training images per device; each run audited by `fedge audit privacy` "
                 "(held-out: half of the digits test split, 225 images; as many synthetic samples, same labels; "
                 "features: CNN-5 trained on the other half). MND ratio < 1: synthetic samples sit "
                 "closer to the device's training images than fresh images of the same classes do. Inverted "
                 "held-out (GeFL-F only): the held-out images through the device's extractor and the audit's "
                 "inverter, measured like the samples (about 1: the inverter itself neither pulls towards nor "
                 "pushes away from the training images).\n")
    parts.append(markdown_table(mnd_header, mnd_rows))
    figs = [n for n in MND_METHODS if (OUT / f"closest-{n}.png").is_file()]
    if figs:
        parts.append("\nThe closest synthetic samples of the first device (top) above their nearest training images: "
                     + ", ".join(f"[{n}](../benchmarks/results/privacy/closest-{n}.png)" for n in figs) + ".\n")
    parts.append("\nAccuracy against ε (`python -m benchmarks.privacy dp`): digits, 6 devices (3 rpi4-2gb, "
                 "3 rpi5-8gb), Dirichlet α, seed 0, one run per cell; FedProto 10 rounds (`fedproto`: each device's "
                 "head classifies, the default; `fedproto-pi`: `inference = \"prototype\"`, the nearest global "
                 "prototype classifies), FedVTC 6 rounds (tiny decoder); `local`: the same fleet with nothing "
                 "shared. `[privacy] epsilon = ε, delta = 1e-5, clip = 5, sigma_clip = 1` (device-level: each "
                 "prototype and σ is one clipped contribution); ε = ∞: no `[privacy]` table (no clipping either). "
                 "Cells: mean final global / local test accuracy % (several: repeated draws of the noise, "
                 "`--draw 2`), z the calibrated noise multiplier.\n")
    parts.append(markdown_table(dp_header, dp_rows))
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("mnd", "dp", "report"))
    ap.add_argument("--only", help="run one cell: a method name (mnd), method:alpha:eps or localR:alpha (dp)")
    ap.add_argument("--method", choices=(*DP_ROUNDS, "local"), help="dp: only this row (fedproto-pi: prototype "
                    "inference)")
    ap.add_argument("--force", action="store_true", help="recompute saved cells")
    ap.add_argument("--draw", type=int, default=1, help="dp: repeat the finite-ε cells as draw N (fresh noise)")
    ap.add_argument("--reaudit", action="store_true", help="mnd: audit the saved runs again (current audit code)")
    ap.add_argument("--docs", action="store_true", help="also write the docs/results.md section")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.part == "mnd":
        for name in MND_METHODS:
            if args.only and args.only != name:
                continue
            if args.reaudit and (OUT / f"mnd-{name}.json").is_file() and (RUNS / f"mnd-{name}").is_dir():
                c = reaudit(name)
            else:
                c = cached_cell(OUT / f"mnd-{name}.json", lambda n=name: mnd_cell(n),  # type: ignore[misc]
                                force=args.force, expect={"config": mnd_config(name)})
            print(f"{name}: pixel ratio {c['pixel_ratio']:.3f}, feature ratio {c['feature_ratio']:.3f}, "
                  f"acc {_pct(c['acc'])}", flush=True)
    elif args.part == "dp":
        for method in DP_ROUNDS:
            if args.method and args.method != method:
                continue
            for alpha in ALPHAS:
                for eps in EPSILONS:
                    if args.only and args.only != f"{method}:{alpha}:{eps}":
                        continue
                    if args.draw > 1 and math.isinf(eps):
                        continue  # without [privacy] nothing is random beyond the run's seed
                    c = cached_cell(dp_file(method, alpha, eps, args.draw),
                                    lambda m=method, a=alpha, e=eps: dp_cell(m, a, e, draw=args.draw),  # type: ignore[misc]
                                    force=args.force, expect={"config": dp_config(method, alpha, eps)})
                    print(f"{method} α {alpha} ε {eps}: acc {_pct(c['acc_global'])} / {_pct(c['acc_local'])}, "
                          f"{c['seconds']:.0f} s", flush=True)
        for rounds in sorted(set(DP_ROUNDS.values()), reverse=True):
            for alpha in ALPHAS:
                if (args.method and args.method != "local") or (args.only and args.only != f"local{rounds}:{alpha}"):
                    continue
                c = cached_cell(OUT / f"dp-local{rounds}-a{alpha}.json",
                                lambda a=alpha, r=rounds: dp_cell("local", a, math.inf, r),  # type: ignore[misc]
                                force=args.force, expect={"config": dp_config("local", alpha, math.inf, rounds)})
                print(f"local {rounds} rounds α {alpha}: acc {_pct(c['acc_global'])} / {_pct(c['acc_local'])}, "
                      f"{c['seconds']:.0f} s", flush=True)
    body = report()
    if args.docs:
        write_docs_section("privacy", body)


if __name__ == "__main__":
    main()
