"""Robust aggregation against poisoning devices: FedProto on digits, 10 devices, 0 / 1 / 2 of them poisoning.

A poisoning device holds a valid credential and trains like the others, but
uploads its prototypes sign-flipped and scaled by ``--scale`` (with its true
class counts, which the gate bounds by its sample count: since issue 12 no
device can outweigh its data). Devices classify with the nearest global
prototype (``[method] inference = "prototype"``), so the global prototypes are
what the accuracy measures. Each cell runs the real engine in-process with
plain averaging (``mean``), with the robust aggregator (``--rule``: a trimmed
mean that cuts ``ceil(trim x N)`` devices at each end of every coordinate, or
the weighted coordinate-wise median; optional norm clipping first), and as an
``oracle`` whose poisoning devices' updates count for nothing (the best any
rule can do). Reported: the honest devices' mean final accuracy on the global
test set, per seed and averaged, and the clean run's accuracy over the same
honest devices (devices differ in accuracy, so that is the fair reference).

    .venv/bin/python -m benchmarks.robustness                 # seed 0, 10 rounds, 0 / 10 / 20 %
    .venv/bin/python -m benchmarks.robustness --seeds 0,1 --rule median

Writes ``benchmarks/results/robustness.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS
from fedge.common.rounds import RoundInfo
from fedge.coordinator.accumulators import Aggregation
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.edge.methods.fedproto import FedProtoDevice
from fedge.fleet.config import parse_fleet
from fedge.fleet.devices import build_devices, load_fleet_data
from fedge.fleet.registry import method_entry
from fedge.sim.inprocess import connect_inprocess

OUT = RESULTS / "robustness.json"


class PoisoningFedProto(FedProtoDevice):
    """FedProto's device half, but its uploaded prototypes are ``-scale`` times the true ones."""

    scale = 10.0

    def train_round(self, info: RoundInfo) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, extra = super().train_round(info)
        arrays["protos"] = (-self.scale * arrays["protos"]).astype(np.float32)
        return arrays, extra


class SilentFedProto(FedProtoDevice):
    """The ``oracle`` row: a poisoning device whose update counts for nothing (all class counts 0), as if
    an aggregator had told it from the honest ones perfectly. The best any rule can do."""

    def train_round(self, info: RoundInfo) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, extra = super().train_round(info)
        arrays["counts"] = np.zeros_like(arrays["counts"])
        return arrays, extra


def fleet_config(seed: int, rounds: int, devices: int) -> Any:
    return parse_fleet({
        "run": {"method": "fedproto", "rounds": rounds, "dataset": "digits", "seed": seed, "fleet": "robust"},
        "partition": {"kind": "dirichlet", "alpha": 1.0},
        # the figures were measured before issue 45 changed the defaults: pinned
        "train": {"lr_schedule": "constant", "lr": 0.1, "min_tail": 1, "val_fraction": 0.0},
        "devices": [{"profile": "rpi4-2gb", "count": devices, "arch": "tier-xs"}],
        "method": {"inference": "prototype"},
    }, source="<robustness>")


def run_cell(seed: int, rounds: int, devices: int, poisoners: int, aggregation: Aggregation,
             scale: float, *, oracle: bool = False) -> dict[str, Any]:
    cfg = fleet_config(seed, rounds, devices)
    data = load_fleet_data(cfg)
    sims = build_devices(cfg, data)
    bad = {s.info.device_id for s in sims[:poisoners]}
    pairs = []
    for s in sims:
        method = s.method
        if s.info.device_id in bad and oracle:
            method = SilentFedProto(s.method.ctx)
        elif s.info.device_id in bad:
            method = PoisoningFedProto(s.method.ctx)
            method.scale = scale
        pairs.append((method, s.info))
    _, coord, _ = connect_inprocess(pairs, fleet=cfg.run.fleet)
    strat = method_entry("fedproto").build_strategy(cfg.method_config, num_classes=data.train.num_classes,
                                                    rounds=rounds)
    t0 = time.perf_counter()
    engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method="fedproto", aggregation=aggregation))
    reports = engine.run()
    final = reports[-1]
    honest = [d for d in final.metrics if d not in bad]
    accs = [final.metrics[d]["acc_global"] for d in honest]
    return {"seed": seed, "poisoners": poisoners, "aggregation": aggregation.rule, "clip": aggregation.clip,
            "acc_global": statistics.fmean(accs), "honest": len(honest), "seconds": time.perf_counter() - t0,
            "poisoning": sorted(bad), "per_device": {d: final.metrics[d]["acc_global"] for d in sorted(final.metrics)}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--scale", type=float, default=10.0, help="poisoned prototypes = -scale x the true ones")
    ap.add_argument("--rule", choices=("trimmed", "median"), default="trimmed", help="the robust rule")
    ap.add_argument("--trim", type=float, default=0.2, help="trimmed: devices cut at each end (default 0.2)")
    ap.add_argument("--clip", type=float, default=0.0, help="robust: clip factor (x the median distance; 0: off)")
    ap.add_argument("--fractions", default="0,0.1,0.2", help="poisoning fractions (default 0,0.1,0.2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    rules = {"mean": Aggregation(), "robust": Aggregation(args.rule, trim=args.trim, clip=args.clip),
             "oracle": Aggregation()}
    fractions = [float(f) for f in args.fractions.split(",")]
    cells = []
    for frac in fractions:
        k = round(frac * args.devices)
        for name, agg in rules.items():
            if name == "oracle" and k == 0:
                continue  # without poisoners the oracle is the mean row
            for seed in seeds:
                cell = run_cell(seed, args.rounds, args.devices, k, agg, args.scale, oracle=name == "oracle")
                cell["fraction"], cell["rule"] = frac, name
                cells.append(cell)
                print(f"  {100 * frac:>3.0f}% poisoning, {name:<6} seed {seed}: acc {100 * cell['acc_global']:.2f}% "
                      f"({cell['seconds']:.0f} s)", flush=True)

    def clean_over(seed: int, honest: set[str]) -> float:
        """The clean (0 %, mean) run's accuracy over the devices that are honest in another cell."""
        c = next(c for c in cells if c["fraction"] == 0 and c["rule"] == "mean" and c["seed"] == seed)
        return statistics.fmean(a for d, a in c["per_device"].items() if d in honest)

    rows = []
    for frac in fractions:
        row: dict[str, Any] = {"fraction": frac}
        for name in rules:
            mine = [c for c in cells if c["fraction"] == frac and c["rule"] == name]
            if mine:
                row[name] = statistics.fmean(c["acc_global"] for c in mine)
        ref = [c for c in cells if c["fraction"] == frac and c["rule"] == "robust"]
        if 0 in fractions and ref:
            # the same honest devices in the clean run: the fair reference (devices differ in accuracy)
            row["clean_same_devices"] = statistics.fmean(
                clean_over(c["seed"], set(c["per_device"]) - set(c["poisoning"])) for c in ref)
        rows.append(row)
    clean = rows[0]["mean"] if fractions[0] == 0 else float("nan")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.robustness" + ("" if argv is None else " " + " ".join(argv))
    OUT.write_text(json.dumps({"command": command, "settings": {**vars(args), "seeds": seeds},
                                   "clean": clean, "rows": rows, "cells": cells}, indent=1))
    print(f"\n| poisoning devices | mean | robust ({args.rule}, trim {args.trim:g}, clip {args.clip:g}) "
          "| oracle (poisoners dropped) | clean run, same honest devices |")
    print("|---|---|---|---|---|")
    for row in rows:
        cells_ = [row.get(k) for k in ("mean", "robust", "oracle", "clean_same_devices")]
        print(f"| {100 * row['fraction']:.0f} % | " + " | ".join("-" if v is None else f"{100 * v:.2f} %"
                                                                for v in cells_) + " |")
    last = rows[-1]
    print(f"\nrobust at {100 * fractions[-1]:.0f} %: {100 * (last['robust'] - clean):+.2f} points vs the clean run "
          f"({100 * clean:.2f} %), {100 * (last['robust'] - last.get('clean_same_devices', clean)):+.2f} vs the clean "
          f"run over the same honest devices")


if __name__ == "__main__":
    main()
