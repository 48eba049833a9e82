"""Selection that knows time and energy (issue 44): ``uniform`` against ``oort`` and ``energy`` at the same sample size.

One fleet of 56 devices of seven profiles (the built-ins but the Pi 4 2 GB, and a Pi Zero 2 W on a small battery,
8 each), on/off availability churn, FedAvg on tier-xs (one averaging group) on scikit-learn's digits with
Dirichlet label skew; every device the same model, so the profiles differ in speed, link and power only. Each
selection trains ``--rounds`` rounds of ``--sample`` devices on the virtual clock with the energy model
(docs/simulation.md). The target accuracy is a share (``--target``) of the uniform run's final fleet mean, the same
for the three; per run: virtual seconds and fleet joules (idling included) and task joules to it, each battery's
lowest charge against its floor.

Issue 44's targets, per seed: ``oort`` reaches the target >= 1.5x sooner in virtual time than ``uniform``;
``energy`` with >= 30 % fewer fleet joules at <= 1.2x the time, no battery device below its floor.

    python -m benchmarks.energy [--seeds 0 1] [--rounds 40] [--sample 10]

Writes benchmarks/results/energy-nN-rR-kK-sSEEDS.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, text_table

POLICIES = ("uniform", "oort", "energy")
PROFILES = ("rpi-zero-2w", "rpi3b", "rpi4-4gb", "rpi5-8gb", "jetson-nano", "x86-gateway")
# A Pi Zero 2 W on a small battery (a few hundred joules: a nearly flat pack), so that the floor can bind within a
# run of minutes of virtual time; its idle drain over the run stays above the floor.
LOW_BATTERY = ("zero-low-battery", 0.02, 0.004)  # name, battery_wh, floor_wh


def fedavg_digits(name: str, *, seed: int, rounds: int) -> str:
    """The fleet config's tables but the devices, clock and coordinator: FedAvg on tier-xs, digits with
    Dirichlet(0.5) label skew, 2 local epochs, one thread (the energy and thermal benchmarks share it)."""
    return f"""
[run]
name = "{name}"
method = "fedavg"
rounds = {rounds}
dataset = "digits"
seed = {seed}

[partition]
kind = "dirichlet"
alpha = 0.5
fraction = 1.0

[train]
lr = 0.1
lr_schedule = "constant"
batch_size = 16
local_epochs = 2
min_tail = 1
val_fraction = 0.0

[simulation]
threads = 1
"""


def fleet_config(policy: str, *, seed: int, rounds: int, sample: int, per_profile: int, work: Path) -> Path:
    """The fleet config of one run (and the low-battery profile beside it); returns its path."""
    from fedge.profiles import builtin_dir

    name, wh, floor = LOW_BATTERY
    zero = (builtin_dir() / "rpi-zero-2w.toml").read_text().replace('name = "rpi-zero-2w"', f'name = "{name}"')
    zero = zero.replace("battery_wh = 37.0\nfloor_wh = 3.7", f"battery_wh = {wh}\nfloor_wh = {floor}")
    (work / f"{name}.toml").write_text(zero)
    groups = "".join(f'\n[[devices]]\nprofile = "{p}"\ncount = {per_profile}\narch = "tier-xs"\n'
                     for p in (*PROFILES, f"{name}.toml"))
    text = fedavg_digits(f"energy-{policy}-s{seed}", seed=seed, rounds=rounds) + f"""
[clock]
availability = "onoff"
online_mean_s = 120
offline_mean_s = 40

[coordinator]
sample = {sample}
selection = "{policy}"
{groups}"""
    path = work / f"{policy}-s{seed}.toml"
    path.write_text(text)
    return path


def run(policy: str, *, seed: int, rounds: int, sample: int, per_profile: int) -> dict[str, Any]:
    """One simulation: its time-to-accuracy curve with joules, and each battery's lowest charge."""
    from fedge.fleet.config import load_fleet
    from fedge.fleet.energy import EnergyLedger
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    with tempfile.TemporaryDirectory() as tmp:
        path = fleet_config(policy, seed=seed, rounds=rounds, sample=sample, per_profile=per_profile, work=Path(tmp))
        t0 = time.perf_counter()
        res = simulate(load_fleet(path), out_dir=None)
        doc = build_results(res)
    assert res.clock is not None
    clock = res.clock
    ledger = EnergyLedger(clock)
    curve = [{**p, "task_j": ledger.task_j(p["virtual_s"])} for p in doc["time_to_accuracy"]]
    batteries = {d["id"]: {"min_j": d["battery_min_j"], "floor_j": d["battery_floor_j"], "left_j": d["battery_left_j"],
                           "tasks": sum(v is not None for v in d["virtual"])}
                 for d in doc["devices"] if "battery_floor_j" in d}
    tasks: dict[str, int] = {}
    for d in doc["devices"]:
        tasks[d["profile"]] = tasks.get(d["profile"], 0) + sum(v is not None for v in d["virtual"])
    return {"policy": policy, "seed": seed, "rounds": rounds, "sample": sample, "devices": len(doc["devices"]),
            "curve": curve, "final_acc": curve[-1]["mean_acc_global"], "virtual_s": clock.now,
            "energy": doc["clock"]["energy"], "batteries": batteries, "tasks_per_profile": tasks,
            "wall_s": time.perf_counter() - t0}


def reach(r: dict[str, Any], level: float) -> dict[str, float | None]:
    """Virtual seconds, fleet joules and task joules at the first point of ``r``'s curve at ``level``."""
    p = next((p for p in r["curve"] if p["mean_acc_global"] >= level), None)
    return {k: (None if p is None else p[k]) for k in ("virtual_s", "fleet_j", "task_j")}


def summarise(runs: dict[str, dict[str, Any]], target: float) -> dict[str, Any]:
    """One seed: the target level, each policy at it, and issue 44's targets met or not."""
    level = target * runs["uniform"]["final_acc"]
    at = {p: reach(r, level) for p, r in runs.items()}
    u = at["uniform"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    oort_speedup = ratio(u["virtual_s"], at["oort"]["virtual_s"])
    e_time = ratio(at["energy"]["virtual_s"], u["virtual_s"])
    e_joules = ratio(at["energy"]["fleet_j"], u["fleet_j"])
    e_task = ratio(at["energy"]["task_j"], u["task_j"])
    floors_kept = all(b["min_j"] >= b["floor_j"] for b in runs["energy"]["batteries"].values())
    return {"level": level, "at": at, "oort_speedup": oort_speedup, "energy_time_ratio": e_time,
            "energy_fleet_j_ratio": e_joules, "energy_task_j_ratio": e_task, "energy_floors_kept": floors_kept,
            "oort_met": oort_speedup is not None and oort_speedup >= 1.5,
            "energy_met": (e_joules is not None and e_joules <= 0.7 and e_time is not None and e_time <= 1.2
                           and floors_kept)}


def print_table(res: dict[str, Any]) -> None:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    rows = []
    for seed, s in res["seeds"].items():
        for policy in POLICIES:
            r, a = res["runs"][seed][policy], s["at"][policy]
            low = min((b["min_j"] - b["floor_j"] for b in r["batteries"].values()), default=None)
            rows.append([seed, policy, f(100 * r["final_acc"], ".1f"), f(100 * s["level"], ".1f"),
                         f(a["virtual_s"], ".1f"), f(a["fleet_j"], ".0f"), f(a["task_j"], ".0f"),
                         f(r["virtual_s"], ".1f"), f(r["energy"]["fleet_j"], ".0f"), f(low, "+.1f")])
    print(text_table(["seed", "selection", "final acc %", "target %", "s to target", "fleet J to target",
                      "task J to target", "run s", "run fleet J", "battery min - floor J"], rows))
    for seed, s in res["seeds"].items():
        print(f"seed {seed}: oort {f(s['oort_speedup'], '.2f')}x sooner than uniform "
              f"({'met' if s['oort_met'] else 'NOT met'}: >= 1.5x); energy: fleet J "
              f"x{f(s['energy_fleet_j_ratio'], '.2f')}, task J x{f(s['energy_task_j_ratio'], '.2f')}, "
              f"time x{f(s['energy_time_ratio'], '.2f')}, "
              f"floors {'kept' if s['energy_floors_kept'] else 'BROKEN'} "
              f"({'met' if s['energy_met'] else 'NOT met'}: <= 0.7x fleet J at <= 1.2x time)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.energy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--sample", type=int, default=10)
    ap.add_argument("--per-profile", type=int, default=8, help="devices of each of the seven profiles")
    ap.add_argument("--target", type=float, default=0.95, help="share of uniform's final accuracy to reach")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"args": vars(args), "runs": {}, "seeds": {}}
    for seed in args.seeds:
        runs = {p: run(p, seed=seed, rounds=args.rounds, sample=args.sample, per_profile=args.per_profile)
                for p in POLICIES}
        res["runs"][str(seed)] = runs
        res["seeds"][str(seed)] = summarise(runs, args.target)
    n = args.per_profile * (len(PROFILES) + 1)
    out = Path(args.out) if args.out else RESULTS / (
        f"energy-n{n}-r{args.rounds}-k{args.sample}-s{''.join(map(str, args.seeds))}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print_table(res)
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
