"""What secure aggregation costs (issue 42): per-device CPU, bytes up, coordinator CPU, dropouts.

One group of ``--devices`` devices (100 by default) sums a ``tier-m`` model's state dict (its float tensors,
61,614 values with the batch-norm statistics) FedAvg-style: each device's weight w and w · x, clipped to
[-8, 8], over the field :func:`fedge.secagg.fixedpoint.plan_field` chooses (32 bits for 100 devices), with the
default neighbours (8 ⌈log2 n⌉) and threshold (a majority of each neighbourhood). Side by side in one run:

* ``plain``: each device encodes its update as fedge's fp32 ``update`` message; the coordinator decodes every
  message and folds it into a :class:`~fedge.coordinator.accumulators.WeightedMean` (what a round does today);
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
    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.secagg --accuracy   # results/secagg-accuracy-fmnist.json

``--accuracy`` trains FedAvg and FedProto with and without ``[privacy] secure_aggregation`` on Fashion-MNIST (8
tier-xs devices on an IID 30 % of the training set, 6 rounds of one local epoch at lr 0.05 with momentum 0.9,
no validation hold-out), seeds 0 and 1, in-process, beside a control: the plain run with its published global
state moved by ±1 ulp every round (what float summation order alone changes). It compares the devices' mean
final accuracy on 10,000 test images and the largest gap of the global state after round 1.
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
from fedge.coordinator.accumulators import WeightedMean
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


ACC_METHODS = ("fedavg", "fedproto")
ACC_VARIANTS = ("plain", "secure", "plain ±1 ulp")


def accuracy_config(args: argparse.Namespace, method: str, seed: int, secure: bool) -> dict[str, Any]:
    """The fleet of one accuracy run: ``--acc-devices`` tier-xs devices on an IID ``--fraction`` of the dataset."""
    # momentum and no validation hold-out: no discrete choice of the shipped model (the best on a small fold) or
    # undone round (the divergence guard) that a 1e-8 difference in the global state could flip
    doc: dict[str, Any] = {"run": {"method": method, "rounds": args.rounds, "dataset": args.dataset, "seed": seed,
                                   "eval_every": args.rounds, "name": f"secagg-acc-{method}"},
                           "partition": {"kind": "iid", "fraction": args.fraction},
                           "train": {"local_epochs": 1, "lr": 0.05, "momentum": 0.9, "batch_size": 32,
                                     "val_fraction": 0.0, "lr_schedule": "constant"},
                           "devices": [{"profile": "rpi4-2gb", "count": args.acc_devices, "arch": "tier-xs"}]}
    if secure:
        doc["privacy"] = {"secure_aggregation": True, **({"clipping_range": args.clip} if args.clip else {})}
    return doc


def perturb_ulp(artifacts: dict[str, dict[str, np.ndarray]], rng: np.random.Generator) -> None:
    """Move every float value of ``artifacts`` one ulp up or down (a random sign each), in place: the size of
    change a different summation order makes to a plain mean."""
    for name in sorted(artifacts):  # sorted: a strategy may build its dicts from sets, whose order varies
        arrays = artifacts[name]
        for k in sorted(arrays):
            v = arrays[k]
            if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating) and v.size:
                toward = np.where(rng.random(v.shape) < 0.5, -np.inf, np.inf).astype(v.dtype)
                arrays[k] = np.nextafter(v, toward)


def accuracy_run(args: argparse.Namespace, method: str, seed: int, variant: str, test: Any) -> dict[str, Any]:
    """One run: the devices' mean final accuracy (%) on ``test`` and the global state published after round 1."""
    import torch

    from fedge.fleet.config import parse_fleet
    from fedge.fleet.devices import show_global_test
    from fedge.sim.simulate import build_fleet, run_timed

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = parse_fleet(accuracy_config(args, method, seed, variant == "secure"), source="benchmarks/secagg.py")
    fleet, strat = build_fleet(cfg)
    show_global_test(fleet, test)
    first: dict[str, dict[str, np.ndarray]] = {}
    finish, rng = strat.finish_round, np.random.default_rng(1000 + seed)

    def finish_round(rnd: int) -> dict[str, Any]:
        out = finish(rnd)
        if variant == "plain ±1 ulp":
            perturb_ulp(out, rng)
        if rnd == 1:
            first.update({a: {k: np.array(v, dtype=np.float64) for k, v in arrays.items()
                              if np.issubdtype(np.asarray(v).dtype, np.floating)} for a, arrays in out.items()})
        return out

    strat.finish_round = finish_round  # type: ignore[method-assign]
    _, reports, _ = run_timed(cfg, fleet, strat)
    final = reports[-1]
    accs = [m["acc_global"] for m in final.metrics.values() if "acc_global" in m]
    if len(accs) != args.acc_devices:
        raise RuntimeError(f"{method} seed {seed} {variant}: {len(accs)} final evaluations of {args.acc_devices}")
    return {"acc": 100 * float(np.mean(accs)), "round1": first, "wall_s": time.perf_counter() - t0}


def max_gap(a: dict[str, dict[str, np.ndarray]], b: dict[str, dict[str, np.ndarray]]) -> float:
    """The largest absolute difference between two published global states (same artifacts and tensors)."""
    if sorted(a) != sorted(b):
        raise RuntimeError(f"the runs published different artifacts: {sorted(a)} vs {sorted(b)}")
    return max(float(np.abs(a[n][k] - b[n][k]).max()) for n in a for k in a[n])


def accuracy(args: argparse.Namespace) -> None:
    """FedAvg and FedProto with and without secure aggregation, and the plain run perturbed by ±1 ulp, two seeds
    (issue 42's accuracy target, and the size of the training's own sensitivity beside it)."""
    from fedge.edge.data.datasets import load_dataset

    test_set = load_dataset(args.dataset, train=False)
    test = test_set.subset(np.arange(min(args.test_images, len(test_set))))
    cells: dict[str, Any] = {}
    rows = []
    for method in ACC_METHODS:
        for seed in args.seeds:
            runs = {v: accuracy_run(args, method, seed, v, test) for v in ACC_VARIANTS}
            plain, secure, ulp = (runs[v]["acc"] for v in ACC_VARIANTS)
            gap_secure = max_gap(runs["plain"]["round1"], runs["secure"]["round1"])
            gap_ulp = max_gap(runs["plain"]["round1"], runs["plain ±1 ulp"]["round1"])
            cells[f"{method}-s{seed}"] = {"plain": plain, "secure": secure, "plain_ulp": ulp,
                                         "round1_gap_secure": gap_secure, "round1_gap_ulp": gap_ulp,
                                         "wall_s": {v: r["wall_s"] for v, r in runs.items()}}
            rows.append([method, str(seed), f"{plain:.2f}", f"{secure:.2f}", f"{secure - plain:+.2f}",
                         f"{ulp:.2f}", f"{ulp - plain:+.2f}", f"{gap_secure:.1e}", f"{gap_ulp:.1e}"])
            print(f"{method} seed {seed}: plain {plain:.2f} secure {secure:.2f} ±1 ulp {ulp:.2f}", flush=True)
    header = ["method", "seed", "plain %", "secure %", "secure − plain", "±1 ulp %", "±1 ulp − plain",
              "round-1 gap secure", "round-1 gap ±1 ulp"]
    tag = f"-clip{args.clip:g}" if args.clip else ""
    out = RESULTS / f"secagg-accuracy-{args.dataset}{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dataset": args.dataset, "clip": args.clip or None, "devices": args.acc_devices,
                               "fraction": args.fraction,
                               "rounds": args.rounds, "test_images": len(test), "seeds": args.seeds,
                               "cells": cells}, indent=1))
    print(text_table(header, rows))
    print(f"written {out}")
    if args.docs:
        write_docs_section(f"secagg-accuracy-{args.dataset}{tag}", markdown_table(header, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", action="store_true", help="write the table into docs/results.md")
    ap.add_argument("--accuracy", action="store_true", help="accuracy with and without secure aggregation instead")
    ap.add_argument("--dataset", default="fmnist", help="--accuracy: the dataset (default fmnist)")
    ap.add_argument("--acc-devices", type=int, default=8, help="--accuracy: tier-xs devices (default 8)")
    ap.add_argument("--fraction", type=float, default=0.3, help="--accuracy: share of the training set (0.3)")
    ap.add_argument("--rounds", type=int, default=6, help="--accuracy: training rounds (default 6)")
    ap.add_argument("--test-images", type=int, default=10_000, help="--accuracy: test images scored (10,000)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="--accuracy: seeds (default 0 1)")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="--accuracy: [privacy] clipping_range of the secure runs (default: fedge's, 8)")
    args = ap.parse_args()
    if args.accuracy:
        accuracy(args)
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
