"""Asynchronous against synchronous FedAvg (or FedProto, GeFL-F) on one heterogeneous fleet, in virtual time (issue 27).

A fleet of ``--devices`` devices spread over five built-in profiles (Pi Zero 2 W, Pi 4, Jetson Nano, Pi 5,
x86 gateway; one model, tier-xs, so FedAvg within its one group), Fashion-MNIST partitioned Dirichlet(0.5), runs
in process on the virtual clock (``fedge simulate``'s engine and the speed model) twice per seed: synchronous
rounds, then ``[coordinator] mode = "async"`` until the synchronous run's virtual end time (its fast devices
make many more updates in that time than the synchronous rounds hold). The curve is the product's own
(results.json's ``time_to_accuracy``, ``eval_every = 1`` in both modes; issue 39): synchronous, the fleet's mean of
every device's evaluation at the start of each round; asynchronous, the whole fleet measured after every version
(its group's global model, or FedProto's and GeFL-F's own predictors, as a synchronous round evaluates), the devices
scoring the first ``--eval-images`` test images — the clock times each device's own evaluation over those images
in both modes. Reported side by side: the virtual time each mode needs to reach 95 % of the synchronous run's final
accuracy and the ratio, and the accuracy of each at the synchronous run's end time; beside it the same ratio on the
curve this script drew before issue 39 (each cell's ``curve_own``: the fleet's mean of each device's latest own
evaluation, taken when it starts a round or task), read from the same runs. ``--churn`` adds an asynchronous
run with devices online 70 % of the time (seeded on/off availability) against the same run without. ``--method
geflf``: GeFL-F's three stages (LG-FedAvg warm-up, feature-generator rounds, head rounds) by round counts,
``--geflf-stages W G`` (the rest of ``--rounds`` trains the heads); an asynchronous version holds K updates where a
round holds N, so its stages last W·N/K and G·N/K versions — as many device updates as the synchronous stages.

    python -m benchmarks.async_ [--devices 30] [--rounds 10] [--buffer 10] [--seeds 0 1] [--churn]

Writes benchmarks/results/async/<cell>-fc.json per run (resumable; ``--force`` recomputes; ``-fc``: measured
with the fleet curve, where the cells without it were measured by this script's own evaluation before issue 39) and
benchmarks/results/async-summary-<settings>.json, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, text_table

PROFILES = ("rpi-zero-2w", "rpi4-4gb", "jetson-nano", "rpi5-8gb", "x86-gateway")
OUT = RESULTS / "async"
TARGET = 0.95  # of the synchronous run's final accuracy


class _Enough(Exception):
    """The asynchronous run reached the virtual time it is compared at."""


def fleet_config(args: argparse.Namespace, seed: int, mode: str, churn: bool) -> dict[str, Any]:
    """The fleet of one run: ``mode`` "sync" or "async", ``churn``: devices online 70 % of the time."""
    per, extra = divmod(args.devices, len(PROFILES))
    groups = [{"profile": p, "count": per + (i < extra), "arch": "tier-xs"} for i, p in enumerate(PROFILES)]
    versions = 100 * args.rounds * args.devices // args.buffer  # an upper bound: the run stops at --until
    scale = 1 if mode == "sync" else -(-args.devices // args.buffer)  # versions per round's worth of updates
    cfg: dict[str, Any] = {
        "run": {"method": args.method, "dataset": "fmnist", "seed": seed,
                "eval_every": 1,  # a curve point per round / version
                "rounds": args.rounds if mode == "sync" else versions, "name": f"async-{mode}"},
        "partition": {"kind": "dirichlet", "alpha": 0.5, "fraction": args.fraction},
        "train": {"lr": 0.05, "batch_size": 16, "local_epochs": 1, "min_tail": 1, "val_fraction": 0.0,
                  "lr_schedule": "constant"},
        "devices": [g for g in groups if g["count"]],
    }
    if args.method == "geflf":
        warmup, gen = args.geflf_stages
        cfg["method"] = {"warmup_rounds": warmup * scale, "gen_rounds": gen * scale, "gen_epochs": args.gen_epochs}
    if churn:
        # 70 % online on average: on spells of 7 and off spells of 3 typical round times of a mid device
        cfg["clock"] = {"availability": "onoff", "online_mean_s": 7 * args.spell_s, "offline_mean_s": 3 * args.spell_s}
    if mode == "async":
        cfg["coordinator"] = {"mode": "async", "buffer_size": args.buffer, "max_staleness": args.max_staleness,
                              "staleness_weight": args.weight}
    return cfg


def run_cell(args: argparse.Namespace, seed: int, mode: str, churn: bool, until: float) -> dict[str, Any]:
    """One run and the product's own time-to-accuracy curve (results.json's ``time_to_accuracy``: synchronous, the
    devices' evaluations at each round's start; asynchronous, the whole fleet measured after every version), the
    devices scoring the first ``--eval-images`` test images (asynchronous: until virtual time ``until``)."""
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.devices import show_global_test
    from fedge.sim.inprocess import run_inprocess
    from fedge.sim.report import build_results
    from fedge.sim.simulate import SimResult, build_fleet, run_timed

    torch.set_num_threads(1)
    cfg = parse_fleet(fleet_config(args, seed, mode, churn), source="benchmarks/async_.py")
    t0 = time.perf_counter()
    fleet, strat = build_fleet(cfg)
    test = load_dataset("fmnist", train=False)
    shown = test.subset(np.arange(min(args.eval_images, len(test))))
    show_global_test(fleet, shown)  # the clock times each device's evaluation over those images (run_inprocess)
    holder: dict[str, Any] = {}

    def runner(c: Any, devices: Any) -> Any:
        coord, agents, cleanup = run_inprocess(c, devices)
        holder["coord"], holder["agents"] = coord, agents
        return coord, agents, cleanup

    def on_round(rep: Any) -> None:
        reports.append(rep)
        if rep.phase != "final":  # the curve before issue 39: each device's latest own evaluation, averaged
            latest.update({d: m["acc_global"] for d, m in rep.metrics.items() if "acc_global" in m})
            if latest:
                own.append((holder["coord"].clock.now, float(np.mean(list(latest.values())))))
        if mode == "async" and rep.phase != "final" and holder["coord"].clock.now >= until:
            raise _Enough

    reports: list[Any] = []
    latest: dict[str, float] = {}
    own: list[tuple[float, float]] = []
    with contextlib.suppress(_Enough):  # the asynchronous run stops at ``until``
        run_timed(cfg, fleet, strat, transport=runner, on_round=on_round)
    clock = holder["coord"].clock
    doc = build_results(SimResult(cfg, fleet, holder["agents"], reports, time.perf_counter() - t0, clock=clock))
    points = doc["time_to_accuracy"]
    curve = [(p["virtual_s"], p["mean_acc_global"]) for p in points]
    training = [r for r in reports if r.phase != "final"]
    stale = [s for r in training for s in r.staleness.values()]
    return {
        "seed": seed, "mode": mode, "churn": churn, "devices": args.devices, "rounds": cfg.run.rounds,
        "buffer": args.buffer if mode == "async" else args.devices, "fraction": args.fraction, "until": until,
        "updates": sum(len(r.accepted) for r in training),
        "rejected": sum(sum(r.rejected.values()) for r in training),
        "mean_staleness": float(np.mean(stale)) if stale else 0.0,
        "curve": curve, "devices_per_point": [p["devices"] for p in points], "final_acc": curve[-1][1],
        "curve_own": own,
        "virtual_s": clock.now, "wall_s": time.perf_counter() - t0,
    }


def cell(args: argparse.Namespace, seed: int, mode: str, churn: bool = False, until: float = 0.0) -> dict[str, Any]:
    """A run, from its JSON when it was saved with the same settings (``--force``: always run)."""
    method = _prefix(args)
    name = (f"{method}{mode}{'-churn' if churn else ''}-n{args.devices}-r{args.rounds}-k{args.buffer}-{args.weight}"
            f"-f{args.fraction}-s{seed}-fc.json")
    path = OUT / name
    if path.is_file() and not args.force:
        return json.loads(path.read_text())
    res = run_cell(args, seed, mode, churn, until)
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"  {name}: final {100 * res['final_acc']:.1f} %, {res['virtual_s']:.0f} virtual s, {res['wall_s']:.0f} s",
          flush=True)
    return res


def spread(args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Each profile's time for one round of its work on the virtual clock (no jitter): download and upload of
    its fp32 model, its training and, in a round that starts with one, its evaluation over the test images the
    run gives it (its local split and the same global images as in :func:`run_cell`, not the whole test set);
    from the clock's model alone, nothing trained."""
    from fedge.fleet.clock import fleet_clock, global_test_size
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.slots import checked_slots

    cfg = parse_fleet(fleet_config(args, seed, "sync", False), source="benchmarks/async_.py")
    slots = checked_slots(cfg)
    clock = fleet_clock(cfg, slots)
    shown = min(args.eval_images, global_test_size(cfg))  # as run_cell
    out: dict[str, list[float]] = {}
    for slot in slots:
        c = clock.devices[slot.device_id]
        c.work = dataclasses.replace(c.work, eval_samples=slot.num_test + shown)
        size = 4 * slot.spec.num_params()
        out.setdefault(slot.profile, []).append(c.timing(1, bytes_down=size, bytes_up=size, work=c.work).total_s)
    return {p: float(np.mean(v)) for p, v in out.items()}


def time_to(curve: list[list[float]], level: float) -> float | None:
    """The first virtual time the curve reaches ``level`` (None: never)."""
    return next((t for t, a in curve if a >= level), None)


def acc_at(curve: list[list[float]], t: float) -> float:
    """The accuracy of the last evaluation at or before virtual time ``t``."""
    return [a for s, a in curve if s <= t + 1e-9][-1]


def mean_late(curve: list[list[float]], end: float) -> float:
    """The mean accuracy of every evaluation from ``end / 2`` to ``end``: a run's level, not one draw of its swings."""
    late = [a for t, a in curve if end / 2 <= t <= end + 1e-9]
    return float(np.mean(late))


def compare(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, Any]:
    """The targets for one seed: time to 95 % of sync's final accuracy, and accuracy at sync's end time."""
    level = TARGET * sync["final_acc"]
    ts, ta = time_to(sync["curve"], level), time_to(asyn["curve"], level)
    end = sync["virtual_s"]
    own = {}
    if "curve_own" in sync and "curve_own" in asyn:  # the same runs read as this script did before issue 39
        own_level = TARGET * sync["curve_own"][-1][1]
        os_, oa = time_to(sync["curve_own"], own_level), time_to(asyn["curve_own"], own_level)
        own = {"own_level": own_level, "own_t_sync": os_, "own_t_async": oa,
               "own_speedup": os_ / oa if os_ and oa else None}
    return {"seed": sync["seed"], "level": level, "t_sync": ts, "t_async": ta,
            "speedup": ts / ta if ts and ta else None, **own,
            "acc_sync_at_end": sync["final_acc"], "acc_async_at_sync_end": acc_at(asyn["curve"], end),
            "sync_virtual_s": end, "async_virtual_s": asyn["virtual_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.async_", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=30)
    ap.add_argument("--method", choices=("fedavg", "fedproto", "geflf"), default="fedavg")
    ap.add_argument("--geflf-stages", type=int, nargs=2, default=(2, 3), metavar=("W", "G"),
                    help="geflf: warm-up and generator rounds (the rest of --rounds trains the heads)")
    ap.add_argument("--gen-epochs", type=int, default=2, help="geflf: local generator epochs per generator round")
    ap.add_argument("--rounds", type=int, default=10, help="synchronous rounds (async: the same device updates)")
    ap.add_argument("--buffer", type=int, default=10, help="K: updates per version")
    ap.add_argument("--max-staleness", type=int, default=20)
    ap.add_argument("--weight", default="polynomial", help="staleness_weight")
    ap.add_argument("--fraction", type=float, default=0.1, help="share of Fashion-MNIST's training set used")
    ap.add_argument("--eval-images", type=int, default=2000, help="test images the global model is scored on")
    ap.add_argument("--spell-s", type=float, default=1.0, help="--churn: a typical device round, virtual seconds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--churn", action="store_true", help="also async with devices online 70 %% of the time")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)

    times = spread(args, args.seeds[0])
    print("one round of work per profile, virtual s:", ", ".join(f"{p} {t:.2f}" for p, t in times.items()),
          f"(slowest / fastest {max(times.values()) / min(times.values()):.1f}x)")
    rows, cmp_all, churn_all = [], [], []
    for seed in args.seeds:
        sync = cell(args, seed, "sync")
        asyn = cell(args, seed, "async", until=sync["virtual_s"])
        c = compare(sync, asyn)
        cmp_all.append(c)
        rows.append([str(seed), f"{100 * c['level']:.1f}", _s(c["t_sync"]), _s(c["t_async"]),
                     f"{c['speedup']:.2f}x" if c["speedup"] else "-", f"{100 * c['acc_sync_at_end']:.1f}",
                     f"{100 * c['acc_async_at_sync_end']:.1f}", f"{asyn['mean_staleness']:.2f}", str(asyn["rejected"]),
                     f"{c['own_speedup']:.2f}x" if c.get("own_speedup") else "-"])
        if args.churn:
            churned = cell(args, seed, "async", churn=True, until=sync["virtual_s"])
            end = sync["virtual_s"]  # both at the synchronous run's end time
            plain, churn = acc_at(asyn["curve"], end), acc_at(churned["curve"], end)
            late_plain, late_churn = mean_late(asyn["curve"], end), mean_late(churned["curve"], end)
            churn_all.append({"seed": seed, "at_virtual_s": end, "final_no_churn": plain, "final_churn": churn,
                              "loss_points": 100 * (plain - churn), "late_mean_no_churn": late_plain,
                              "late_mean_churn": late_churn, "late_loss_points": 100 * (late_plain - late_churn)})
    print(f"\n{args.method}, {args.devices} devices over {', '.join(PROFILES)} (tier-xs), Fashion-MNIST "
          "Dirichlet(0.5), "
          f"sync {args.rounds} rounds vs async K = {args.buffer} ({args.weight}) for as long in virtual time")
    print(text_table(["seed", "95 % level", "sync t (s)", "async t (s)", "sync/async", "sync acc @end",
                      "async acc @sync end", "async mean staleness", "async refused",
                      "sync/async, latest own evaluations"], rows))
    if churn_all:
        print("\nasync with churn (70 % online) against no churn, accuracy at the synchronous run's end time")
        print(text_table(["seed", "no churn", "churn", "loss (points)", "2nd-half mean: no churn", "churn", "loss"],
                         [[str(c["seed"]), f"{100 * c['final_no_churn']:.1f}", f"{100 * c['final_churn']:.1f}",
                           f"{c['loss_points']:+.1f}", f"{100 * c['late_mean_no_churn']:.1f}",
                           f"{100 * c['late_mean_churn']:.1f}", f"{c['late_loss_points']:+.1f}"] for c in churn_all]))
    summary = {"args": {k: v for k, v in vars(args).items() if k != "force"}, "round_s_by_profile": times,
               "compare": cmp_all, "churn": churn_all}
    method = _prefix(args)
    seeds = "-".join(str(x) for x in args.seeds)
    name = (f"async-summary-{method}n{args.devices}-r{args.rounds}-k{args.buffer}-{args.weight}-f{args.fraction}"
            f"{'-churn' if args.churn else ''}-s{seeds}-fc.json")
    (RESULTS / name).write_text(json.dumps(summary, indent=1))
    return 0


def _prefix(args: argparse.Namespace) -> str:
    """A run's file name starts with its method (none: FedAvg) and, for GeFL-F, its stages."""
    if args.method == "geflf":
        warmup, gen = args.geflf_stages
        return f"geflf-w{warmup}g{gen}e{args.gen_epochs}-"
    return "" if args.method == "fedavg" else f"{args.method}-"


def _s(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
