"""Generative knowledge transfer on Fashion-MNIST: GeFL, GeFL-F and FedVTC (issue 3).

Three tables, each cell (method × setting × seed) saved as JSON under
``benchmarks/results/generative/`` as soon as it finishes, so an interrupted run
resumes where it stopped; the tables are printed, plotted and written to the
generative section of ``docs/results.md``.

1. ``table1``: the GeFL protocol — K = 10, IID 10 % of the training set, CNN-1 … CNN-10
   with BN, SGD lr 0.1, batch 64, T_r = 5 — FedAvg within group, LG-FedAvg, GeFL-CVAE,
   GeFL-DCGAN, GeFL-F (CVAE-F) and FedVTC (which shares features, so its CNNs end in a
   64-d embedding: ``cnnK-p64``). Metric: mean over the ten models of each one's best
   accuracy on the 10k test set; uplink bytes per device per round; wall time.
2. ``table2``: label skew — 20 devices (CNN-1 … CNN-10 with p = 64, twice), Dirichlet
   α = 0.1 and 1.0 over 20 % of the training set: Local, FedProto, GeFL-F, FedVTC and its
   ablations (no DM, head-only fine-tuning, no KL); global-test and local-split accuracy.
   fedge's FedVTC variants (``fedvtc-local``, ``fedvtc-rn``, ``fedvtc-small``) run only when
   named with ``--methods``.
3. ``table3``: uplink bytes per device per round and final accuracy of every method at
   fp32 / fp16 / int8 upload precision (the table-1 fleet, shortened schedules). With
   ``--long``: table 1's schedule and metric instead, Δ paired by seed; the fp32 column is
   table 1's own cells (the planner uploads fp32 on that fleet), so only fp16 / int8 run
   (``--precisions`` picks which, to split a run over two processes).

Budget schedule (default; see ``table1_methods``): image generators at the "tiny" tier, the
feature generator at "small", 30 generator rounds of 10 local epochs, FedVTC's decoder at "tiny"
trained once per round. ``--published`` uses the published round counts and the "small" image
tier; ``--quick`` 10 generator / 5 warm-up / 20 training rounds. Cell wall times measured with
seed 0 while 2-3 cells shared the 2 cores (so upper bounds): FedAvg 7.2 min, LG-FedAvg 7.0,
GeFL-CVAE 18.8, GeFL-CVAE without extractor averaging 28.3 (three processes), GeFL-F 24.0,
FedVTC 15.8. Generator rounds cost no evaluation (the model is unchanged; evaluation is cached).

    python -m benchmarks.generative table1                  # all methods, seeds 0 1 2
    python -m benchmarks.generative table1 --seeds 0 --methods gefl-cvae fedvtc
    python -m benchmarks.generative table3 --long --methods lgfedavg --precisions int8
    python -m benchmarks.generative all --no-docs

The parts: ``rows.py`` (what each table runs), ``runner.py`` (running and caching cells),
``targets.py`` (the targets, as data), ``render.py`` (tables, checks against the targets, plots) and
``personal.py`` (issue 17's blocks); this module picks the cells of each table and writes the docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from benchmarks.common import write_docs_section
from benchmarks.generative import render
from benchmarks.generative.rows import (
    TABLE1_EXTRAS,
    TABLE2_VARIANTS,
    Method,
    build_config,
    protocol_precision,
    table1_methods,
    table2_methods,
    table3_methods,
)
from benchmarks.generative.runner import BEFORE_MARK, BEFORE_SHARED_START, OUT, Make, collect
from fedge.fleet.config import FleetConfig


def _collect(table: str, methods: dict[str, Method], keys: list[str], args: argparse.Namespace, make: Make,
             tag: str = "") -> render.Cells:
    cells = collect(table, methods, keys, args.seeds, make, tag=tag, force=args.force, report_only=args.report_only)
    for key, cs in cells.items():  # rows shown from cells measured before issue 25 say so in their label
        if any(c.get(BEFORE_SHARED_START) for c in cs) and not methods[key].label.endswith(BEFORE_MARK):
            methods[key] = dataclasses.replace(methods[key], label=methods[key].label + BEFORE_MARK)
    return cells


def table1(args: argparse.Namespace) -> render.Rendered:
    """The GeFL protocol, each row as ``build_config`` makes it, at the planner's upload precision."""
    methods = table1_methods(args.published, args.quick)
    keys = args.methods or list(methods)
    tag = "-published" if args.published else ("-quick" if args.quick else "")

    def protocol(m: Method, s: int) -> tuple[FleetConfig, str | None]:
        return build_config(m, s), None

    cells = _collect("table1", methods, keys, args, protocol, tag)
    if not cells:
        return render.Rendered("", "")
    return render.table1(cells, methods, seeds=args.seeds, published=args.published, quick=args.quick,
                         plot=OUT / f"table1{tag}.png")


def table2(args: argparse.Namespace) -> render.Rendered:
    """Label skew: 20 devices, Dirichlet α over 20 % of the training set, final accuracy only."""
    methods = table2_methods(args.t2_rounds)
    # fedge's variants run only when named (``--methods``); a report shows those that have cells.
    keys = args.methods or [k for k in methods if args.report_only or k not in TABLE2_VARIANTS]
    by_alpha: dict[float, render.Cells] = {}
    for alpha in args.alphas:
        def skewed(m: Method, s: int, a: float = alpha) -> tuple[FleetConfig, str | None]:
            # Final accuracy is the metric: evaluate once, after the last round (20 devices × 10k images
            # per evaluation would otherwise cost as much as the training).
            return build_config(m, s, devices=20, alpha=a, fraction=0.2, eval_every=m.rounds), None

        by_alpha[alpha] = _collect("table2", methods, keys, args, skewed, tag=f"-a{alpha}")
    return render.table2(by_alpha, methods, rounds=args.t2_rounds, seeds=args.seeds)


def table3(args: argparse.Namespace) -> render.Rendered:
    """Uplink bytes per precision and its accuracy cost.

    Short schedules (default): every precision is its own cell, final accuracy, one evaluation.
    ``--long``: table 1's budget schedule and metric (mean best accuracy, evaluated every 5 rounds)
    with paired seeds; the fp32 column *is* table 1's cells when the planner uploads at fp32 (checked),
    so only fp16 and int8 are computed.
    """
    long = args.long
    methods = table1_methods(False) if long else table3_methods()
    keys = args.methods or [k for k in methods if k not in TABLE1_EXTRAS]
    reuse_table1 = long and protocol_precision() == "fp32"
    by: dict[str, dict[str, list[dict]]] = {}
    for prec in ("fp32", *[p for p in args.precisions if p != "fp32"]):  # fp32 is every Δ's reference
        def at_precision(m: Method, s: int, p: str = prec) -> tuple[FleetConfig, str | None]:
            if long:
                return build_config(m, s), (None if reuse_table1 and p == "fp32" else p)
            return build_config(m, s, eval_every=m.rounds), p  # final accuracy only

        table, tag = ("table1", "") if reuse_table1 and prec == "fp32" else (
            "table3-long" if long else "table3", f"-{prec}")
        for key, cs in _collect(table, methods, keys, args, at_precision, tag=tag).items():
            by.setdefault(key, {})[prec] = cs
    if not by:
        return render.Rendered("", "")
    return render.table3(by, methods, long=long, reuse_table1=reuse_table1, seeds=args.seeds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+", choices=["table1", "table2", "table3", "all"])
    ap.add_argument("--methods", nargs="+", help="row keys (default: every row of the table)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--published", action="store_true", help="table 1 with the published round counts")
    ap.add_argument("--quick", action="store_true",
                    help="table 1 with 10 generator / 5 warm-up / 20 training rounds (a shared-machine smoke run)")
    ap.add_argument("--long", action="store_true",
                    help="table 3 on table 1's schedule and seeds (fp32 = table 1's cells) instead of short runs")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "fp16", "int8"], default=["fp32", "fp16", "int8"],
                    help="table 3 upload precisions to compute (fp32, the reference, is always included)")
    ap.add_argument("--t2-rounds", type=int, default=20, help="table 2 training rounds")
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.1, 1.0], help="table 2 Dirichlet α values")
    ap.add_argument("--force", action="store_true", help="recompute cells that already have results")
    ap.add_argument("--report-only", action="store_true",
                    help="tabulate the saved cells (and write the docs) without computing missing ones")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/results.md")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: these small nets train ~10x faster single-threaded on a "
                         "busy 2-core machine; run two processes with different --methods to use both cores)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    tables = ["table1", "table2", "table3"] if "all" in args.tables else args.tables
    # A --quick or --published table 1 is its own section, so it never stands in for the budget run.
    suffix = "-published" if args.published else ("-quick" if args.quick else "")
    # Likewise table 3 on table 1's schedule (--long) next to the short one.
    suffixes = {"table1": suffix, "table3": "-long" if args.long else ""}
    runners = {"table1": table1, "table2": table2, "table3": table3}
    sections = {}
    for t in tables:
        rendered = runners[t](args)
        if rendered.text:
            print(rendered.text)
        sections[t + suffixes.get(t, "")] = rendered.section
    summary = OUT / "sections.json"
    known = json.loads(summary.read_text()) if summary.is_file() else {}
    known.update({k: v for k, v in sections.items() if v})  # a table with no finished cell stays "not run"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps(known, indent=1))
    if not args.no_docs:
        write_docs_section("generative", render.docs_body(known))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
