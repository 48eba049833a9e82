"""The planner's tier choice on issue 48's held-out fleet: the old rule, the new one, and the largest tier memory holds.

The fleet (``benchmarks/fleets/issue48.toml``): Fashion-MNIST, 12 devices — 4 Pi Zero 2 W, 4 Pi 4 2 GB, 4 x86
gateways — Dirichlet 0.5 over 10 % of the training set, FedProto with personalisation, 8 rounds, evaluated in the
last round. Variants, each ``fedge simulate`` of the same fleet and seed with the tiers pinned per device:

* ``old`` — the rule before issue 48: the largest tier whose 5 epochs fit the profile's round budget (the planner's
  rule without accuracy curves, ``RunBudget(task=None)``);
* ``new`` — the planner's choice (the most expected accuracy within the run's time budget, from the curves);
* ``largest`` — the largest tier each device's memory holds, for the per-device comparison.

Reported per device: its tier and final local accuracy in each variant, and the run's virtual time and time to
the target (``--target``, mean local accuracy; from results.json's clock). ``--mode async`` runs the fleet with
``[coordinator] mode = "async"``.

    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.planner_trade --seeds 0 1 --variants old new largest

Writes benchmarks/results/planner_trade/<variant>-<mode>-s<seed>.json (resumable; ``--force`` recomputes) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, RESULTS, text_table

FLEET = REPO / "benchmarks" / "fleets" / "issue48.toml"
OUT = RESULTS / "planner_trade"
VARIANTS = ("old", "new", "largest")


def pinned_groups(doc: dict[str, Any], variant: str) -> list[dict[str, Any]]:
    """The ``[[devices]]`` of ``doc`` with each device's tier pinned as ``variant`` chooses it."""
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.slots import device_profile, device_slots
    from fedge.profiles import RunBudget, plan

    cfg = parse_fleet(doc, source=str(FLEET))
    if variant == "new":
        return list(doc["devices"])
    slots = device_slots(cfg)
    groups = []
    for gi, g in enumerate(doc["devices"]):
        mine = [s for s in slots if s.group == gi]
        if variant == "old":
            old = RunBudget(rounds=cfg.run.rounds, task=None)
            tiers = [plan(device_profile(cfg, gi), samples=s.num_samples, embed_dim=cfg.run.embed_dim, run=old).arch
                     for s in mine]
        else:
            tiers = [f"tier-{s.plan.trade['largest']['tier']}" for s in mine]
        groups.append({**g, "archs": tiers})
    return groups


def run_cell(variant: str, mode: str, seed: int, force: bool) -> dict[str, Any]:
    path = OUT / f"{variant}-{mode}-s{seed}.json"
    if path.is_file() and not force:
        return dict(json.loads(path.read_text()))
    doc = tomllib.loads(FLEET.read_text())
    doc["run"]["seed"] = seed
    if mode == "async":
        doc["coordinator"] = {"mode": "async"}
    doc["devices"] = pinned_groups(doc, variant)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "fleet.toml"
        cfg_path.write_text(_toml(doc))
        out = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "fedge", "simulate", str(cfg_path), "--out", str(out), "--no-progress"],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        res = json.loads((out / "results.json").read_text())
    cell = {"variant": variant, "mode": mode, "seed": seed, "summary": res["summary"], "clock": res.get("clock"),
            "seconds": res["seconds"], "tier_trades": res.get("tier_trades"),
            "devices": [{"id": d["id"], "arch": d["arch"], "num_train": d["num_train"],
                         "final_acc_local": d["final_acc_local"]} for d in res["devices"]]}
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell, indent=1))
    return cell


def _toml(doc: dict[str, Any]) -> str:
    """A fleet document as TOML (tables of scalars and lists, and [[devices]])."""
    def val(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = []
    for key, table in doc.items():
        if key == "devices":
            continue
        lines.append(f"[{key}]")
        lines += [f"{k} = {val(v)}" for k, v in table.items()]
    for g in doc["devices"]:
        lines.append("[[devices]]")
        lines += [f"{k} = {val(v)}" for k, v in g.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--mode", default="sync", choices=("sync", "async"))
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    cells = {(v, s): run_cell(v, args.mode, s, args.force) for s in args.seeds for v in args.variants}
    for s in args.seeds:
        have = [v for v in args.variants if (v, s) in cells]
        header = ["device", "samples", *[f"{v} tier" for v in have], *[f"{v} local %" for v in have]]
        rows = []
        for i, d in enumerate(cells[(have[0], s)]["devices"]):
            devs = [cells[(v, s)]["devices"][i] for v in have]
            rows.append([d["id"], str(d["num_train"]), *[x["arch"] for x in devs],
                         *[f"{100 * x['final_acc_local']:.1f}" for x in devs]])
        rows.append(["mean", "", *[""] * len(have),
                     *[f"{100 * cells[(v, s)]['summary']['mean_final_acc_local']:.1f}" for v in have]])
        print(f"\nseed {s}, {args.mode}:")
        print(text_table(header, rows))
        for v in have:
            ck = cells[(v, s)].get("clock") or {}
            print(f"  {v}: virtual {ck.get('virtual_s', float('nan')):.1f} s, mean global "
                  f"{100 * cells[(v, s)]['summary']['mean_final_acc_global']:.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
