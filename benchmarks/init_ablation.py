"""Where the models start, and what it does to a method: one shared start against per-device seeds (issue 25).

Issue 25 made every averaged part of a model start from one seed (``fedge.common.initseeds``):
the group's network and the fleet's extractor. This benchmark runs table 1's rows (the GeFL
protocol, ``benchmarks.generative``) both ways on the same code, side by side, so a change in a
row's figure after the fix can be told apart from everything else that changed since its old
cell was measured: ``shared`` is the method as shipped, ``per-device`` the same fleet with every
device built from its own seed (``run_seed * 1000 + index``), as before the fix.

    python -m benchmarks.init_ablation                                   # GeFL-F, quick schedule, seeds 0 1
    python -m benchmarks.init_ablation --methods geflf-cvae lgfedavg --seeds 0 1 2
    python -m benchmarks.init_ablation --report-only

Cells are saved under ``benchmarks/results/init_ablation/`` as they finish (an interrupted run
resumes); the table prints mean best / final accuracy per start and the paired difference.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from unittest import mock

from benchmarks.common import RESULTS, cached_cell, load_cell, mean_std, text_table
from benchmarks.generative.rows import Method, build_config, table1_methods
from benchmarks.generative.runner import init_of, run_cell
from fedge.common.initseeds import PER_DEVICE

OUT = RESULTS / "init_ablation"
STARTS = ("shared", "per-device")


@contextlib.contextmanager
def started(start: str, m: Method, seed: int) -> Iterator[None]:
    """Within the block, devices of ``m``'s fleet are built from the shipped start or from their own seeds."""
    settings = type(build_config(m, seed).method_config)
    if start == "shared":
        yield
        return
    # The benchmark's only lever: the method's descriptor says which parts start shared.
    with mock.patch.object(settings, "shared_start", lambda self: PER_DEVICE):
        yield


def cell(m: Method, seed: int, start: str, schedule: str, *, force: bool, report_only: bool) -> dict | None:
    path = OUT / f"{m.key}-{schedule}-{start}-s{seed}-r{m.rounds}.json"
    with started(start, m, seed):
        init = init_of(build_config(m, seed))  # what the cell must have recorded: the lever took effect
    expect = {"config": dict(m.config), "rounds": m.rounds, "init": init}
    if report_only:
        return load_cell(path, expect)

    def compute() -> dict:
        with started(start, m, seed):
            out = run_cell(build_config(m, seed))
        return {**out, "start": start, "schedule": schedule}

    return cached_cell(path, compute, force=force, expect=expect)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["geflf-cvae"], help="table 1 row keys (default geflf-cvae)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--full", action="store_true", help="table 1's budget schedule (default: its quick schedule)")
    ap.add_argument("--force", action="store_true", help="re-run saved cells")
    ap.add_argument("--report-only", action="store_true", help="only the table from saved cells")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as benchmarks.generative: these small nets train fastest on one thread
    schedule = "full" if args.full else "quick"
    methods = table1_methods(False, quick=not args.full)
    unknown = sorted(set(args.methods) - set(methods))
    if unknown:
        ap.error(f"unknown row(s) {unknown}; table 1's rows: {sorted(methods)}")
    rows = []
    for key in args.methods:
        m = methods[key]
        got: dict[str, dict[int, dict]] = {s: {} for s in STARTS}
        for seed in args.seeds:  # both starts of a seed back to back: the machine's load is alike for both
            for start in STARTS:
                if (c := cell(m, seed, start, schedule, force=args.force, report_only=args.report_only)) is not None:
                    got[start][seed] = c
        paired = sorted(set(got["shared"]) & set(got["per-device"]))
        for metric in ("mean_best_acc", "mean_final_acc"):
            row = [key, schedule, metric.removeprefix("mean_").removesuffix("_acc")]
            for start in STARTS:
                mu, sd = mean_std([100 * got[start][s][metric] for s in paired]) if paired else (float("nan"), 0.0)
                row.append(f"{mu:.2f} ± {sd:.2f}")
            diffs = [100 * (got["shared"][s][metric] - got["per-device"][s][metric]) for s in paired]
            row += [" ".join(f"{d:+.2f}" for d in diffs), str(paired)]
            rows.append(row)
    print(text_table(["row", "schedule", "accuracy", "shared start", "per-device", "shared − per-device by seed",
                      "seeds"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
