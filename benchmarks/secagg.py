"""What secure aggregation costs (issue 42): per-device CPU, bytes up, coordinator CPU, dropouts.

One group of ``--devices`` devices (100 by default) sums a ``tier-m`` model's state dict (its float tensors,
61,614 values with the batch-norm statistics) FedAvg-style: each device's weight w and w · x, clipped to
[-8, 8], over the field :func:`fedge.secagg.fixedpoint.plan_field` chooses (32 bits for 100 devices), with the
default neighbours (8 ⌈log2 n⌉) and threshold (a majority of each neighbourhood). Side by side in one run:

* ``plain``: each device encodes its update as fedge's fp32 ``update`` message; the coordinator decodes every
  message and folds it into a :class:`~fedge.coordinator.aggregate.WeightedMean` (what a round does today);
* ``secure``: the four stages of :mod:`fedge.secagg` run in this process (``fedge.secagg.inprocess``); a
  device's CPU is the time in its four stage calls (keys, shares, fixed-point encoding, masking, unmask
  answers), the coordinator's the time in its state machine (validating, routing, the running sum,
  reconstructing seeds and keys, removing masks, decoding);
* ``secure, 30 % lost after masking``: 30 % of the devices send their masked input and then never answer the
  unmask request (their inputs count; their seeds come from their neighbours' shares);
* ``secure, 30 % lost after sharing``: 30 % share their keys and vanish before masking (the coordinator
  reconstructs each one's mask key and removes its pairwise masks: the expensive dropout).

CPU is ``time.process_time`` of this single-threaded process (run it niced, ``OMP_NUM_THREADS=1``). Bytes up
are the messages a device sends (the masked vector is a bare safetensors payload; the protocol envelope it
would travel in over MQTT adds the same few hundred bytes as a plain update's).

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.secagg            # writes results/secagg.json
    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.secagg --devices 1000 --docs
    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.secagg --accuracy   # results/secagg-accuracy.json

``--accuracy`` trains FedAvg and FedProto with and without ``[privacy] secure_aggregation`` on a small
digits fleet (6 tier-xs devices, IID, 8 rounds of 2 local epochs at lr 0.05, momentum 0.9, no validation
hold-out), seeds 0 and 1, in-process, and compares the mean final accuracy on the global test set.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, markdown_table, text_table, write_docs_section
from fedge.common.archs import tier_arch
from fedge.common.messages import Message
from fedge.common.tensorcodec import decode
from fedge.coordinator.aggregate import WeightedMean
from fedge.secagg import graph
from fedge.secagg.fixedpoint import Segment, plan_field
from fedge.secagg.inprocess import run_group
from fedge.secagg.messages import RoundSetup
from fedge.secagg.server import SecAggServer

CLIP = 8.0
DEVICE_CALLS = ("advertise", "share_keys", "masked_input", "unmask")
SERVER_CALLS = ("receive", "close_keys", "close_shares", "close_masked", "close_unmask")


def timed(obj: Any, names: tuple[str, ...], into: dict[str, float], key: str) -> None:
    """Wrap ``obj``'s methods ``names`` so that their CPU time adds up in ``into[key]``."""
    for name in names:
        real = getattr(obj, name)

        def call(*args: Any, _real: Callable[..., Any] = real) -> Any:
            t0 = time.process_time()
            try:
                return _real(*args)
            finally:
                into[key] += time.process_time() - t0

        setattr(obj, name, call)


def model(seed: int, n: int) -> tuple[dict[str, tuple[int, ...]], dict[str, dict[str, np.ndarray]]]:
    """tier-m's float tensors, and ``n`` devices' updates of them (weights in (0, 1], as w · x sums them)."""
    shapes = {k: v for k, v in tier_arch("m").param_shapes().items() if not k.endswith("num_batches_tracked")}
    rng = np.random.default_rng(seed)
    updates = {}
    for i in range(n):
        up = {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in shapes.items()}
        up["weight"] = np.array([rng.uniform(0.2, 1.0)])
        updates[f"dev-{i:04d}"] = up
    return shapes, updates


def plain_round(updates: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Today's round: fp32 update messages, decoded and averaged by the coordinator."""
    device_s, up = [], []
    wires = []
    for dev, u in updates.items():
        t0 = time.process_time()
        data = Message("update", dev, 1, "bench", tensors={k: v for k, v in u.items() if k != "weight"},
                       info={"num_samples": 100}).to_bytes("fp32")
        device_s.append(time.process_time() - t0)
        up.append(len(data))
        wires.append((data, float(u["weight"][0])))
    t0 = time.process_time()
    acc = WeightedMean()
    for data, w in wires:
        acc.add(decode(data).tensors, w)
    acc.result()
    coord = time.process_time() - t0
    return {"device_ms": 1e3 * float(np.mean(device_s)), "bytes_up": float(np.mean(up)), "coordinator_ms": 1e3 * coord}


def secure_round(updates: dict[str, dict[str, np.ndarray]], shapes: dict[str, tuple[int, ...]],
                 lost: dict[str, set[str]], rnd: int) -> dict[str, Any]:
    """One secure round over ``updates`` with ``lost`` devices; CPU per device and of the coordinator."""
    members = tuple(sorted(updates))
    n = len(members)
    segments = [Segment("weight", (1,), 1.0), *(Segment(k, s, CLIP) for k, s in shapes.items())]
    plan = plan_field(n, segments)
    degree = graph.default_degree(n)
    setup = RoundSetup(rnd, "tier-m", members, degree, graph.default_threshold(degree), plan, b"bench-%d" % rnd)
    terms = {d: {"weight": u["weight"], **{k: np.float32(u["weight"][0]) * v for k, v in u.items() if k != "weight"}}
             for d, u in updates.items()}
    device_s: dict[str, float] = defaultdict(float)
    coord: dict[str, float] = defaultdict(float)
    server = SecAggServer(setup)
    timed(server, SERVER_CALLS, coord, "server")
    result = run_group(setup, terms, lost=lost, server=server,
                       on_device=lambda m, d: timed(d, DEVICE_CALLS, device_s, m))
    t0 = time.process_time()
    weight = result.sums["weight"][0]
    means = {k: (v / weight).astype(np.float32) for k, v in result.sums.items() if k != "weight"}
    coord["server"] += time.process_time() - t0
    total_w = sum(float(updates[d]["weight"][0]) for d in result.survivors)
    error = max(float(np.abs(means[k] - sum(float(updates[d]["weight"][0]) * updates[d][k].astype(np.float64)
                                            for d in result.survivors) / total_w).max()) for k in shapes)
    finished = [d for d in members if d not in set().union(*lost.values())]
    return {"device_ms": 1e3 * float(np.mean([device_s[d] for d in finished])),
            "device_ms_max": 1e3 * float(np.max([device_s[d] for d in finished])),
            "bytes_up": float(np.mean([result.bytes_up[d] for d in finished])),
            "bytes_down": float(np.mean([result.bytes_down[d] for d in finished])),
            "coordinator_ms": 1e3 * coord["server"], "survivors": len(result.survivors),
            "max_abs_error": error,
            "field_bits": plan.bits, "degree": degree, "threshold": setup.threshold, "length": plan.length}


def accuracy_cell(method: str, seed: int, secure: bool) -> float:
    """Mean final global-test accuracy (%) over the devices of one small in-process run."""
    from fedge.fleet.config import parse_fleet
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    # momentum and no validation hold-out: a schedule that converges (89 % for FedAvg), and no discrete choice of
    # the shipped model (the best on a 10 % fold) or undone round (the divergence guard) that a 1e-8 difference
    # in the global state could flip
    doc: dict[str, Any] = {"run": {"method": method, "rounds": 8, "dataset": "digits", "seed": seed},
                           "partition": {"kind": "iid"},
                           "train": {"local_epochs": 2, "lr": 0.05, "momentum": 0.9, "val_fraction": 0.0,
                                     "lr_schedule": "constant"},
                           "devices": [{"profile": "rpi4-2gb", "count": 6, "arch": "tier-xs"}]}
    if secure:
        doc["privacy"] = {"secure_aggregation": True}
    devices = build_results(simulate(parse_fleet(doc)))["devices"]
    return 100 * float(np.mean([d["final_acc_global"] for d in devices]))


def accuracy() -> None:
    """FedAvg and FedProto with and without secure aggregation, two seeds (issue 42's accuracy target)."""
    cells, rows = {}, []
    for method in ("fedavg", "fedproto"):
        for seed in (0, 1):
            plain, secure = accuracy_cell(method, seed, False), accuracy_cell(method, seed, True)
            cells[f"{method}-s{seed}"] = {"plain": plain, "secure": secure}
            rows.append([method, str(seed), f"{plain:.2f}", f"{secure:.2f}", f"{secure - plain:+.2f}"])
    out = RESULTS / "secagg-accuracy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cells, indent=1))
    print(text_table(["method", "seed", "plain %", "secure %", "secure - plain"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", action="store_true", help="write the table into docs/results.md")
    ap.add_argument("--accuracy", action="store_true", help="accuracy with and without secure aggregation instead")
    args = ap.parse_args()
    if args.accuracy:
        accuracy()
        return
    shapes, updates = model(args.seed, args.devices)
    members = sorted(updates)
    rng = np.random.default_rng(args.seed + 1)
    lost30 = set(rng.choice(members, size=int(0.3 * len(members)), replace=False).tolist())
    cells = {"plain": plain_round(updates),
             "secure": secure_round(updates, shapes, {}, 1),
             "secure, 30 % lost after masking": secure_round(updates, shapes, {"unmask": lost30}, 2),
             "secure, 30 % lost after sharing": secure_round(updates, shapes, {"masked": lost30}, 3)}
    plain, secure = cells["plain"], cells["secure"]
    rows = []
    for name, c in cells.items():
        rows.append([name, f"{c['device_ms']:.1f}", f"{c['bytes_up'] / 1e3:.1f}",
                     f"{c['bytes_up'] / plain['bytes_up']:.3f}", f"{c['coordinator_ms']:.0f}",
                     f"{c['coordinator_ms'] / plain['coordinator_ms']:.2f}",
                     f"{c['coordinator_ms'] / secure['coordinator_ms']:.2f}",
                     f"{c.get('max_abs_error', 0.0):.1e}"])
    header = ["round", "device CPU ms", "kB up / device", "bytes vs plain", "coordinator CPU ms",
              "coordinator vs plain", "vs secure, no loss", "max |error| of the mean"]
    out = RESULTS / ("secagg.json" if args.devices == 100 else f"secagg-{args.devices}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"devices": args.devices, "seed": args.seed, "machine": platform.processor() or
                               platform.machine(), "cells": cells}, indent=1))
    print(text_table(header, rows))
    print(f"field {secure['field_bits']} bits, {secure['length']} words, {secure['degree']} neighbours, threshold "
          f"{secure['threshold']}; secure device CPU max {secure['device_ms_max']:.1f} ms; written {out}")
    if args.docs:
        write_docs_section(f"secagg-{args.devices}", markdown_table(header, rows))


if __name__ == "__main__":
    main()
