"""Activity recognition on the synthetic UCI HAR set (issue 41): the federated methods against training alone and
a central ceiling, every device holding whole subjects, tested on subjects no device has seen.

The set: ``fedge.edge.data.har_synth.write_uci_har`` (clearly synthetic: per-subject cadence, stride amplitude,
phone orientation and noise; docs/sensors.md), ``--subjects`` of which ``--test-subjects`` are the test split,
written once into ``--data-dir``. The fleet: ``--devices`` per profile of four built-in profiles, ``[partition]
kind = "group"`` (each subject's windows on one device), the ``cnn1d`` tier of each device chosen by the planner.
Each method is one ``fedge simulate`` in process, one cell of JSON (resumable); the ceiling (``--central``) is
the largest tier the FedAvg fleet uses, trained on the pooled training shares for as many epochs.

    python -m benchmarks.sensors --seeds 0 1 --central
    python -m benchmarks.sensors --seeds 0 1 --devices 5 --central        # 20 devices: cells *-n20-r10e2
    python -m benchmarks.sensors --seeds 0 --devices 5 --rounds 20 --eval-every 4 --methods fedavg --central

Results: ``benchmarks/results/sensors/*.json``, a table on stdout, the figures in docs/sensors.md.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO, RESULTS, cached_cell
from benchmarks.kws import PROFILES, run_central, run_method

OUT = RESULTS / "sensors"
METHODS = ("fedavg", "lgfedavg", "fedproto", "local")
TIERS = ("xs", "s", "m", "l")


def fleet_table(method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The activity-recognition fleet of one method and seed."""
    return {
        "run": {"name": f"har-{method}", "method": method, "rounds": args.rounds, "dataset": "uci_har",
                "data_dir": str(args.data_dir), "seed": seed, "eval_every": args.eval_every},
        "model": {"family": "cnn1d"},
        "partition": {"kind": "group", "local_test_fraction": 0.2},
        "train": {"lr": args.lr, "momentum": 0.9, "local_epochs": args.local_epochs, "batch_size": args.batch_size},
        "devices": [{"profile": p, "count": args.devices} for p in PROFILES],
    }


def make_set(args: argparse.Namespace) -> None:
    """Write the synthetic set into ``--data-dir`` unless it holds this very set already (``settings.json``)."""
    from fedge.edge.data.har_synth import write_uci_har

    want = {"subjects": args.subjects, "test_subjects": args.test_subjects,
            "windows_per_activity": args.windows_per_activity, "seed": 0}
    stamp = args.data_dir / "settings.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return
    if args.data_dir.exists() and any(args.data_dir.iterdir()):
        raise SystemExit(f"{args.data_dir} holds something else than the set asked for; point --data-dir elsewhere")
    write_uci_har(args.data_dir, **want)
    stamp.write_text(json.dumps(want))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--devices", type=int, default=2, help="devices per profile (4 profiles)")
    ap.add_argument("--subjects", type=int, default=30, help="UCI HAR has 30")
    ap.add_argument("--test-subjects", type=int, default=9, help="UCI HAR's test split holds 9")
    ap.add_argument("--windows-per-activity", type=int, default=12)
    ap.add_argument("--data-dir", type=Path, default=REPO / "runs" / "har-synth" / "UCI HAR Dataset")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "sensors-bench")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--central", action="store_true", help="also train the ceiling")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    make_set(args)
    import torch

    torch.set_num_threads(args.threads)
    settings = {"rounds": args.rounds, "local_epochs": args.local_epochs, "batch_size": args.batch_size}
    tag = f"-n{4 * args.devices}-r{args.rounds}e{args.local_epochs}"
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    for seed in args.seeds:
        for method in args.methods:
            print(f"{method} seed {seed} ...", flush=True)
            cells[(method, seed)] = cached_cell(OUT / f"{method}-{seed}{tag}.json",
                                                partial(run_method, method, seed, args, fleet_table),
                                                force=args.force, expect=settings)
        if args.central and ("fedavg", seed) in cells:
            largest = max((d["arch"] for d in cells[("fedavg", seed)]["devices"]),
                          key=lambda a: TIERS.index(a.split("-")[1]))
            epochs = args.rounds * args.local_epochs
            print(f"central {largest} seed {seed} ...", flush=True)
            cells[("central", seed)] = cached_cell(OUT / f"central-{seed}{tag}.json",
                                                   partial(run_central, seed, largest, epochs, args,
                                                           table=fleet_table),
                                                   force=args.force, expect={"epochs": epochs})
    print(table(cells, args))
    return 0


def table(cells: dict[tuple[str, int], dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of every cell, then the best federated method against the ceiling per seed."""
    lines = [f"activity recognition, synthetic UCI HAR, {4 * args.devices} devices by subject, {args.rounds} rounds x "
             f"{args.local_epochs} epoch(s); accuracy % on unseen subjects",
             "| method | seed | mean device | lowest device | mean local | s | tiers |",
             "|---|---:|---:|---:|---:|---:|---|"]
    best: dict[int, tuple[float, str]] = {}
    for (method, seed), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if method == "central":
            lines.append(f"| central ({c['arch']}, {c['samples']} windows, ceiling) | {seed} | "
                         f"{100 * c['acc_global']:.1f} | | | {c['seconds']:.0f} | |")
            continue
        accs = [d["final_acc_global"] for d in c["devices"]]
        tiers = ", ".join(sorted({d["arch"] for d in c["devices"]}))
        lines.append(f"| {method} | {seed} | {100 * np.mean(accs):.1f} | {100 * min(accs):.1f} | "
                     f"{100 * c['summary']['mean_final_acc_local']:.1f} | {c['seconds']:.0f} | {tiers} |")
        if method != "local" and 100 * np.mean(accs) > best.get(seed, (-1.0, ""))[0]:
            best[seed] = (100 * float(np.mean(accs)), method)
    for seed, (acc, method) in sorted(best.items()):
        if ("central", seed) in cells:
            gap = 100 * cells[("central", seed)]["acc_global"] - acc
            lines.append(f"seed {seed}: best federated {method} {acc:.1f} %, {gap:+.1f} points below the ceiling "
                         f"(target: within 3)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
