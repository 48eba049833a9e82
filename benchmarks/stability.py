"""Final against best accuracy with the defaults (issue 45): does a fleet with nothing set keep what it learned?

For each fleet, method and mode, the fleet config is run with its ``[train]`` and ``[method]`` tables removed (the
defaults: the plan's learning rate and last-batch rule, the 10 % validation fold) and every device's global
accuracy recorded at every evaluation. Reported per cell: the mean final accuracy, the mean best (each device's
best round, which only hindsight on the test set knows), the mean *shipped* accuracy (the round each device's
validation fold chose: what ``fedge export`` ships) and the largest final-below-best drop of any device.

Fleets: the demo fleet (``examples/demo.toml``) and two held-out-style fleets under ``benchmarks/fleets/``
(issue 45's six-device fleet, and five different profiles). Methods: FedAvg, FedProto, FedVTC, GeFL-F; modes:
synchronous rounds and asynchronous versions (``[coordinator] mode = "async"``, K = half the fleet).

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.stability --seeds 0 1 \\
        --fleets six-fedproto-defaults --methods fedproto --modes sync --out benchmarks/results/stability.json

``--margins M ...`` runs the chosen fleets, methods, modes and seeds with the defaults and ``[train]
divergence_margin = M`` (0: the divergence guard off), and reports the rounds each device undid (issue 45's
divergence guard, :mod:`fedge.edge.divergence`):

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.stability --seeds 0 1 --fleets six-fedproto-defaults \
        --methods fedproto --modes sync --margins 0 10 --out benchmarks/results/stability.json

``--changes "SCHEDULE LR" ...`` runs each cell with ``[train] lr_schedule = SCHEDULE`` and ``lr = LR`` (the other
defaults untouched), the variants side by side (issue 45's learning-rate schedule, :mod:`fedge.common.lrschedule`),
and prints a summary per variant over the cells every variant finished:

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.stability --seeds 0 1 \
        --fleets demo six-fedproto-defaults --methods fedproto fedavg --modes sync async \
        --changes "constant 0.05" "cosine 0.05" "cosine 0.1" --out benchmarks/results/stability-schedule.json

``--ablate`` instead runs issue 45's six-device fleet with one setting changed at a time against the defaults
before issue 45 (lr 0.1, every last batch alone): the learning rate, the last-batch rule, the prototype pull,
the upload precision.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FLEETS = {
    "demo": REPO / "examples" / "demo.toml",
    "six-fedproto-defaults": REPO / "benchmarks" / "fleets" / "six-fedproto-defaults.toml",
    "five-profiles": REPO / "benchmarks" / "fleets" / "five-profiles.toml",
}
METHODS = ("fedavg", "fedproto", "fedvtc", "geflf")
MODES = ("sync", "async")
# issue 45's ablation: each changes one thing against the old defaults (lr 0.1 constant, min_tail 1)
OLD = {"lr": 0.1, "lr_schedule": "constant", "min_tail": 1}
ABLATIONS: dict[str, dict[str, Any]] = {
    "old defaults": {"train": OLD},
    "lr 0.05": {"train": {**OLD, "lr": 0.05}},
    "min_tail 8": {"train": {**OLD, "min_tail": 8}},
    "lambda 0.1": {"train": OLD, "method": {"lambda": 0.1}},
    "fp32 uploads": {"train": OLD, "upload_precision": "fp32"},
    "new defaults": {},
}


def margin_change(margin: float) -> str:
    """The change label of a run with ``[train] divergence_margin = margin``."""
    return f"margin {margin:g}"


def schedule_change(text: str) -> str:
    """The change label of a ``--changes`` pair ``"SCHEDULE LR"`` (checked: a known schedule, a positive rate)."""
    from fedge.common.lrschedule import check_schedule
    from fedge.errors import ConfigError

    parts = text.split()
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a schedule and a learning rate, e.g. 'cosine 0.1'")
    try:
        check_schedule(parts[0])
    except ConfigError as exc:  # names the closest schedule
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.message} ({exc.hint})") from exc
    try:
        lr = float(parts[1])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {parts[1]!r} is not a learning rate") from exc
    if not lr > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the learning rate must be > 0")
    return f"{parts[0]} {lr:g}"


def change_of(label: str) -> dict[str, Any]:
    """The ``[train]`` table of a :func:`margin_change` or :func:`schedule_change` label (the other defaults
    untouched)."""
    if label.startswith("margin "):
        return {"train": {"divergence_margin": float(label.removeprefix("margin "))}}
    schedule, lr = label.split()
    return {"train": {"lr_schedule": schedule, "lr": float(lr)}}


def drops(row: dict[str, Any], points: float) -> int:
    """Devices of a finished cell whose final accuracy is more than ``points`` below their best."""
    return sum(1 for d in row["devices"] if 100 * (d["best"] - d["final"]) > points)


def summary(rows: list[dict[str, Any]], changes: list[str]) -> str:
    """Per change: the means over the cells (fleet, method, mode, seed) every change finished, the cells whose mean
    final is more than 1 point below their mean best, the devices more than 5 points below their best, and the
    largest drop of a device."""
    ok = [r for r in rows if "error" not in r and r["change"] in changes]
    by_change = {c: {(r["fleet"], r["method"], r["mode"], r["seed"]): r for r in ok if r["change"] == c}
                 for c in changes}
    common = set.intersection(*(set(v) for v in by_change.values())) if by_change else set()
    head = f"{'change':16s} {'cells':>5s} {'final':>6s} {'best':>6s} {'cells >1pt':>10s} {'devices >5pt':>12s} " \
           f"{'largest drop':>12s}"
    lines = [f"over the {len(common)} cells every change finished", head, "-" * len(head)]
    for c in changes:
        cells = [by_change[c][k] for k in sorted(common)]
        if not cells:
            continue
        n = len(cells)
        lines.append(f"{c:16s} {n:5d} {sum(r['mean_final'] for r in cells) / n:6.1f} "
                     f"{sum(r['mean_best'] for r in cells) / n:6.1f} "
                     f"{sum(1 for r in cells if r['mean_best'] - r['mean_final'] > 1):10d} "
                     f"{sum(drops(r, 5) for r in cells):12d} {max(r['max_drop'] for r in cells):12.1f}")
    return "\n".join(lines)


def fleet_table(fleet: str, method: str, mode: str, seed: int, change: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fleet's TOML with ``[train]`` and ``[method]`` removed (the defaults), then ``change`` applied."""
    raw = tomllib.loads(FLEETS[fleet].read_text())
    raw.pop("train", None)
    raw.pop("method", None)
    raw["run"].update(method=method, seed=seed, name=f"stability-{fleet}-{method}-{mode}")
    change = change or {}
    for key in ("train", "method"):
        if key in change:
            raw[key] = dict(change[key])
    if "upload_precision" in change:
        for g in raw["devices"]:
            g["upload_precision"] = change["upload_precision"]
    if mode == "async":
        n = sum(g.get("count", 1) for g in raw["devices"])
        raw["coordinator"] = {"mode": "async", "buffer_size": max(1, n // 2)}
        # as many updates as the synchronous rounds: rounds x devices / K versions
        raw["run"]["rounds"] = raw["run"]["rounds"] * n // max(1, n // 2)
    return raw


def run_cell(raw: dict[str, Any], source: str) -> dict[str, Any]:
    from fedge.fleet.config import parse_fleet
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    cfg = parse_fleet(raw, source=source)
    t0 = time.perf_counter()
    res = build_results(simulate(cfg))
    devices = []
    for d in res["devices"]:
        seen = [a for a in d["acc_global"] if a is not None]
        devices.append({"id": d["id"], "acc_global": d["acc_global"], "acc_val": d["acc_val"],
                        "final": seen[-1], "best": max(seen), "shipped": d["shipped"],
                        **({"rolled_back": d["rolled_back"]} if "rolled_back" in d else {})})
    n = len(devices)

    def mean(xs: list[float]) -> float:
        return 100 * sum(xs) / n

    shipped = [d["shipped"]["acc_global"] if d["shipped"] and d["shipped"]["acc_global"] is not None
               else d["final"] for d in devices]
    return {"mean_final": mean([d["final"] for d in devices]), "mean_best": mean([d["best"] for d in devices]),
            "mean_shipped": mean(shipped), "max_drop": 100 * max(d["best"] - d["final"] for d in devices),
            "rollbacks": sum(len(d.get("rolled_back", [])) for d in devices),
            "seconds": time.perf_counter() - t0, "devices": devices}


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'fleet':24s} {'method':9s} {'mode':6s} {'change':14s} {'seed':>4s} {'final':>6s} {'best':>6s} " \
           f"{'shipped':>7s} {'max drop':>8s} {'undone':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['fleet']:24s} {r['method']:9s} {r['mode']:6s} {r['change']:14s} {r['seed']:4d} "
                         f"error: {r['error'][:60]}")
            continue
        lines.append(f"{r['fleet']:24s} {r['method']:9s} {r['mode']:6s} {r['change']:14s} {r['seed']:4d} "
                     f"{r['mean_final']:6.1f} {r['mean_best']:6.1f} {r['mean_shipped']:7.1f} {r['max_drop']:8.1f} "
                     f"{r.get('rollbacks', 0):6d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from fedge.errors import FedgeError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", nargs="+", default=list(FLEETS), choices=list(FLEETS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--ablate", nargs="*", metavar="CHANGE", choices=list(ABLATIONS),
                    help="issue 45's ablation on the six-device FedProto fleet (all changes when none is named)")
    ap.add_argument("--margins", nargs="+", type=float, metavar="M",
                    help="run each cell with [train] divergence_margin = M (0: the divergence guard off)")
    ap.add_argument("--changes", nargs="+", type=schedule_change, metavar="'SCHEDULE LR'",
                    help="run each cell with [train] lr_schedule = SCHEDULE and lr = LR, e.g. 'cosine 0.1'")
    ap.add_argument("--out", default="benchmarks/results/stability.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    done = {(r["fleet"], r["method"], r["mode"], r["change"], r["seed"]) for r in doc["rows"]}
    if args.ablate is not None:
        cells = [("six-fedproto-defaults", "fedproto", "sync", c, s) for c in (args.ablate or ABLATIONS)
                 for s in args.seeds]
    else:
        changes = ([margin_change(m) for m in args.margins] if args.margins else
                   list(args.changes) if args.changes else ["new defaults"])
        # seed outermost, the changes innermost: whatever finishes, finishes with every change side by side
        cells = [(f, m, mo, c, s) for s in args.seeds for f in args.fleets for m in args.methods for mo in args.modes
                 for c in changes]
    for fleet, method, mode, change, seed in cells:
        if (fleet, method, mode, change, seed) in done:
            continue
        raw = fleet_table(fleet, method, mode, seed, ABLATIONS[change] if change in ABLATIONS else change_of(change))
        row = {"fleet": fleet, "method": method, "mode": mode, "change": change, "seed": seed}
        try:
            row.update(run_cell(raw, f"benchmarks/stability.py ({fleet})"))
        except FedgeError as exc:  # e.g. a method this fleet's devices cannot run: recorded, not fatal
            row["error"] = exc.message
            print(f"{fleet} {method} {mode} seed {seed}: {exc.message}", flush=True)
        doc["rows"].append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        if "error" not in row:
            print(table([row]).splitlines()[-1], flush=True)
    print(table(doc["rows"]))
    if args.changes:
        print(summary(doc["rows"], list(args.changes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
