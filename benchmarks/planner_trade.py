"""Issue 48's targets: the planner's tier choice against the old rule and the largest tier memory holds.

The fleet (``benchmarks/fleets/issue48.toml``): Fashion-MNIST, 12 devices — 4 Pi Zero 2 W, 4 Pi 4 2 GB, 4 x86
gateways — Dirichlet 0.5 over 10 % of the training set, FedProto with personalisation, 8 rounds, evaluated in the
last round. It runs synchronous and asynchronous (``[coordinator] mode = "async"``) side by side, per seed, each
``fedge simulate`` of the same fleet and seed with every device's tier pinned as a variant chooses it:

* ``old`` — today's planner before issue 48: the largest tier whose 5 epochs fit the profile's round budget (the
  planner's rule without accuracy curves, ``RunBudget(task=None)``, synchronous whatever the mode);
* ``new`` — the planner's choice (the most expected accuracy within the run's time budget, from the curves, in the
  fleet's mode);
* ``largest`` — the largest tier each device's memory holds, on the schedule the planner gives that tier within
  the same time budget (a pin: in synchronous rounds as many epochs as fit the device's round share, at least 1).

Variants that pin the same tiers are the same configuration and run once (the simulation is deterministic in its
seed); the cell says ``same_run_as``.

The targets, per mode and seed:

* **per device**: its local accuracy under ``new`` is at most 2 points below the same device's under ``largest``
  in the same virtual time. Runs evaluate in their last round only (an evaluation in a synchronous round costs
  virtual time: 10,000 global test images on a Pi Zero), so "the same time" is the end of each run: exact when the
  ``largest`` run ended no later than ``new``'s; when it ran longer, its final figure had more time than ``new``
  and the comparison is the stricter one (the table says which).
* **fleet**: ``new``'s time to the target accuracy (``--target``: a mean local accuracy in percent; default 95 % of
  ``old``'s final mean local accuracy) is no later than ``old``'s. With one evaluation per run, a run reaches the
  target at its end or not at all.

    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.planner_trade --seeds 0 1 --modes sync async
    python -m benchmarks.planner_trade --plans-only   # no training: the tiers and expected accuracies

Writes each run to benchmarks/results/planner_trade/<variant>-<mode>-s<seed>.json (resumable; ``--force``
recomputes) and the verdicts to benchmarks/results/planner_trade.json, and prints the tables.
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

from benchmarks.common import REPO, RESULTS, cached_cell, text_table

FLEET = REPO / "benchmarks" / "fleets" / "issue48.toml"
OUT = RESULTS / "planner_trade"
SUMMARY = RESULTS / "planner_trade.json"
PLANS = RESULTS / "planner_trade-plans.json"
VARIANTS = ("old", "new", "largest")
MODES = ("sync", "async")
PROMISE_POINTS = 2.0  # issue 48: no device more than this below the largest tier its memory holds
TARGET_SHARE = 0.95  # the default target: this share of the old planner's final mean local accuracy


def fleet_doc(mode: str, seed: int) -> dict[str, Any]:
    """The fleet document of ``mode`` and ``seed``."""
    doc = tomllib.loads(FLEET.read_text())
    doc["run"]["seed"] = seed
    if mode == "async":
        doc["coordinator"] = {"mode": "async"}
    return doc


def variant_archs(doc: dict[str, Any], variant: str) -> list[list[str]]:
    """Per ``[[devices]]`` group of ``doc``, each device's tier as ``variant`` chooses it."""
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.slots import device_profile, device_slots
    from fedge.profiles import RunBudget, plan

    cfg = parse_fleet(doc, source=str(FLEET))
    slots = device_slots(cfg)
    old = RunBudget(rounds=cfg.run.rounds, task=None)
    out = []
    for gi in range(len(doc["devices"])):
        mine = [s for s in slots if s.group == gi]
        if variant == "new":
            out.append([s.plan.arch for s in mine])
        elif variant == "old":
            out.append([plan(device_profile(cfg, gi), samples=s.num_samples, embed_dim=cfg.run.embed_dim,
                             run=old).arch for s in mine])
        else:
            out.append([f"tier-{s.plan.trade['largest']['tier']}" for s in mine])
    return out


def pinned_doc(doc: dict[str, Any], archs: list[list[str]]) -> dict[str, Any]:
    """``doc`` with each device's tier pinned (``archs``: per group, as :func:`variant_archs` gives them)."""
    return {**doc, "devices": [{**g, "archs": a} for g, a in zip(doc["devices"], archs, strict=True)]}


def planned(mode: str, seed: int, variants: list[str]) -> dict[str, Any]:
    """Without training: each variant's tier per device and what the planner expects of it (the trade's chosen
    side: epochs of work within the budget, seconds, local accuracy % from the curves)."""
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.slots import device_slots

    doc = fleet_doc(mode, seed)
    out: dict[str, Any] = {"mode": mode, "seed": seed, "variants": {}}
    for v in variants:
        slots = device_slots(parse_fleet(pinned_doc(doc, variant_archs(doc, v)), source=str(FLEET)))
        out["variants"][v] = [{"id": s.device_id, "samples": s.num_samples, "tier": s.plan.arch,
                               "local_epochs": s.plan.local_epochs,
                               "work_epochs": s.plan.trade["chosen"]["work_epochs"],
                               "expected_s": s.plan.trade["chosen"]["time_s"],
                               "expected_acc": s.plan.trade["chosen"]["acc"]} for s in slots]
    if {"old", "new"} <= set(variants):
        out["old_is_new"] = [d["tier"] for d in out["variants"]["old"]] == \
            [d["tier"] for d in out["variants"]["new"]]
    return out


def print_plans(p: dict[str, Any]) -> None:
    have = list(p["variants"])
    rows = [[d["id"], str(d["samples"]),
             *[f"{p['variants'][v][i]['tier'].removeprefix('tier-')} x{p['variants'][v][i]['local_epochs']} "
               f"{p['variants'][v][i]['expected_acc'] or 0:.1f} %" for v in have]]
            for i, d in enumerate(p["variants"][have[0]])]
    print(f"\nplans, seed {p['seed']}, {p['mode']} (tier x epochs per round, expected local accuracy):")
    print(text_table(["device", "samples", *have], rows))


def simulate(doc: dict[str, Any]) -> dict[str, Any]:
    """``fedge simulate`` of ``doc`` in a child process (one torch thread): its results.json."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "fleet.toml"
        cfg_path.write_text(_toml(doc))
        out = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "fedge", "simulate", str(cfg_path), "--out", str(out), "--no-progress"],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        return dict(json.loads((out / "results.json").read_text()))


def cell_of(res: dict[str, Any], variant: str, mode: str, seed: int, archs: list[list[str]]) -> dict[str, Any]:
    """What the benchmark keeps of a run's results.json."""
    trades = {t["id"]: t for t in res.get("tier_trades") or []}
    return {"variant": variant, "mode": mode, "seed": seed, "archs": archs, "summary": res["summary"],
            "virtual_s": (res.get("clock") or {}).get("virtual_s"), "seconds": res["seconds"],
            "devices": [{"id": d["id"], "arch": d["arch"], "num_train": d["num_train"],
                         "local_epochs": (d.get("plan") or {}).get("local_epochs"),
                         "expected_acc": (trades.get(d["id"]) or {}).get("chosen_acc"),
                         "final_acc_local": d["final_acc_local"],
                         "final_acc_local_generic": d.get("final_acc_local_generic")} for d in res["devices"]]}


def measure(mode: str, seed: int, variants: list[str], force: bool, workers: int = 0) -> dict[str, dict[str, Any]]:
    """Every variant's cell of ``mode`` and ``seed``; a variant pinning the same tiers as one before it reuses
    that run. ``workers``: synchronous runs train in that many worker processes (the same results, issue 30)."""
    doc = fleet_doc(mode, seed)
    if workers and mode == "sync":
        doc["simulation"] = {"backend": "process", "workers": workers}
    cells: dict[str, dict[str, Any]] = {}
    for v in variants:
        archs = variant_archs(doc, v)
        twin = next((w for w, c in cells.items() if c["archs"] == archs), None)
        if twin is not None:
            cells[v] = {**cells[twin], "variant": v, "same_run_as": twin}
            continue
        pinned = pinned_doc(doc, archs)
        print(f"  {v} {mode} seed {seed}: {sum(map(len, archs))} devices, tiers {archs}", flush=True)
        def run(pinned: dict[str, Any] = pinned, v: str = v, archs: list[list[str]] = archs) -> dict[str, Any]:
            return cell_of(simulate(pinned), v, mode, seed, archs)

        cells[v] = cached_cell(OUT / f"{v}-{mode}-s{seed}.json", run, force=force, expect={"archs": archs})
    return cells


def verdict(cells: dict[str, dict[str, Any]], target: float | None) -> dict[str, Any]:
    """The targets of one mode and seed (needs the ``old``, ``new`` and ``largest`` cells)."""
    new, big, old = cells["new"], cells["largest"], cells["old"]
    same_time = big["virtual_s"] <= new["virtual_s"] * 1.001
    gaps = []
    for n, b in zip(new["devices"], big["devices"], strict=True):
        gap = 100 * (b["final_acc_local"] - n["final_acc_local"])
        gaps.append({"id": n["id"], "tier": n["arch"], "largest_tier": b["arch"], "samples": n["num_train"],
                     "new_local": round(100 * n["final_acc_local"], 2),
                     "largest_local": round(100 * b["final_acc_local"], 2),
                     "points_below_largest": round(gap, 2), "met": gap <= PROMISE_POINTS})
    level = target if target is not None else 100 * TARGET_SHARE * old["summary"]["mean_final_acc_local"]

    def reached(c: dict[str, Any]) -> float | None:  # one evaluation per run: at its end, or never
        return c["virtual_s"] if 100 * c["summary"]["mean_final_acc_local"] >= level else None

    t_old, t_new = reached(old), reached(new)
    return {"devices": gaps, "per_device_met": all(g["met"] for g in gaps),
            "largest_ran_no_longer": same_time, "target_local": round(level, 2),
            "time_to_target_old_s": t_old, "time_to_target_new_s": t_new,
            "fleet_met": t_old is None or (t_new is not None and t_new <= t_old * 1.001)}


def print_tables(cells: dict[str, dict[str, Any]], mode: str, seed: int, v: dict[str, Any] | None) -> None:
    have = [k for k in VARIANTS if k in cells]
    header = ["device", "samples", *[f"{k} tier" for k in have], *[f"{k} local %" for k in have]]
    rows = []
    for i, d in enumerate(cells[have[0]]["devices"]):
        devs = [cells[k]["devices"][i] for k in have]
        rows.append([d["id"], str(d["num_train"]), *[x["arch"].removeprefix("tier-") for x in devs],
                     *[f"{100 * x['final_acc_local']:.1f}" for x in devs]])
    rows.append(["mean", "", *[""] * len(have),
                 *[f"{100 * cells[k]['summary']['mean_final_acc_local']:.1f}" for k in have]])
    print(f"\nseed {seed}, {mode}:")
    print(text_table(header, rows))
    for k in have:
        c = cells[k]
        same = f" (the same run as {c['same_run_as']})" if c.get("same_run_as") else ""
        print(f"  {k}: virtual {c['virtual_s']:.1f} s, mean local {100 * c['summary']['mean_final_acc_local']:.1f} %,"
              f" mean global {100 * c['summary']['mean_final_acc_global']:.1f} %, {c['seconds']:.0f} s wall{same}")
    if v is not None:
        worst = max(v["devices"], key=lambda g: g["points_below_largest"])
        print(f"  per device (new within {PROMISE_POINTS:g} points of largest): "
              f"{'met' if v['per_device_met'] else 'MISSED'}; worst {worst['id']} {worst['tier']} "
              f"{worst['new_local']:.1f} % vs {worst['largest_tier']} {worst['largest_local']:.1f} % "
              f"({'same time' if v['largest_ran_no_longer'] else 'largest ran longer'})")
        print(f"  fleet time to {v['target_local']:.1f} % mean local: old {v['time_to_target_old_s']}, new "
              f"{v['time_to_target_new_s']}: {'met' if v['fleet_met'] else 'MISSED'}")


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
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--target", type=float, default=None,
                    help="mean local accuracy (%%) the fleet's time is read at (default: 95 %% of old's final)")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--workers", type=int, default=0,
                    help="synchronous runs in this many worker processes ([simulation] backend = \"process\")")
    ap.add_argument("--plans-only", action="store_true",
                    help=f"no training: each variant's tiers and expected accuracy, to {PLANS.relative_to(REPO)}")
    args = ap.parse_args(argv)
    if args.plans_only:
        plans = [planned(mode, seed, args.variants) for seed in args.seeds for mode in args.modes]
        for p in plans:
            print_plans(p)
        PLANS.write_text(json.dumps(plans, indent=1) + "\n")
        return 0
    summary: dict[str, Any] = {"fleet": str(FLEET.relative_to(REPO)), "promise_points": PROMISE_POINTS, "cells": []}
    for seed in args.seeds:
        for mode in args.modes:
            cells = measure(mode, seed, args.variants, args.force, args.workers)
            v = verdict(cells, args.target) if set(VARIANTS) <= set(cells) else None
            print_tables(cells, mode, seed, v)
            summary["cells"].append({"mode": mode, "seed": seed, "verdict": v,
                                     "runs": {k: {"archs": c["archs"], "virtual_s": c["virtual_s"],
                                                  "mean_final_acc_local": c["summary"]["mean_final_acc_local"],
                                                  "mean_final_acc_global": c["summary"]["mean_final_acc_global"],
                                                  "same_run_as": c.get("same_run_as")} for k, c in cells.items()}})
    SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
