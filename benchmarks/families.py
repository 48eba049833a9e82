"""Model families cost the published protocol nothing (issue 40): the demo fleet before and after, side by side.

Runs ``fedge simulate examples/demo.toml`` (FedProto, 6 devices, 3 profiles, digits, 8 rounds, in process)
with two source trees, interleaved ``--repeat`` times (A B A B ...), each in a child process at one torch
thread, and compares ``seconds_per_round`` (results.json) and the devices' accuracies: the *before* tree is
fedge as it was before the family interface (e.g. ``git archive 92ac8be | tar -x -C /tmp/before``), the
*after* tree this one. Each tree's best run counts, so a burst of load from other jobs on a shared machine
does not decide the ratio; every run stays in the JSON.

    git archive 92ac8be | tar -x -C /tmp/fedge-before
    python -m benchmarks.families --before /tmp/fedge-before --repeat 2 --rounds 3

Results: ``benchmarks/results/families/demo.json`` and the families section of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
OUT = HERE / "benchmarks" / "results" / "families" / "demo.json"


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(tree: Path, config: Path, rounds: int | None) -> dict[str, Any]:
    """One ``fedge simulate`` of ``config`` with ``tree`` first on the path; its timing and accuracies.

    ``cpu_s``: the child's CPU seconds (user + system), start-up included: on a machine shared with other
    jobs the wall clock measures their load as much as fedge, the CPU time far less."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    extra = ["--rounds", str(rounds)] if rounds else []
    with tempfile.TemporaryDirectory(prefix="fedge-families-") as out:
        t0, c0 = time.perf_counter(), _child_cpu()
        subprocess.run([sys.executable, "-m", "fedge", "simulate", str(config), "--out", out, "--no-progress",
                        *extra], env=env, check=True, capture_output=True, cwd=tree)
        wall, cpu = time.perf_counter() - t0, _child_cpu() - c0
        r = json.loads((Path(out) / "results.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "seconds": r["seconds"], "seconds_per_round": r["seconds_per_round"],
            "acc": {d["id"]: d.get("acc_global") for d in r["devices"]}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--before", type=Path, required=True, help="fedge's source tree before the family interface")
    ap.add_argument("--after", type=Path, default=HERE, help="the tree to compare (default: this one)")
    ap.add_argument("--config", type=Path, default=HERE / "examples" / "demo.toml")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, help="override [run] rounds (default: the config's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for _ in range(args.repeat):
        for name, tree in (("before", args.before), ("after", args.after)):
            runs[name].append(run_once(tree.resolve(), args.config.resolve(), args.rounds))
            last = runs[name][-1]
            print(f"{name}: {last['seconds_per_round']:.3f} s/round, {last['cpu_s']:.1f} CPU s", flush=True)
    best = {k: min(r["seconds_per_round"] for r in v) for k, v in runs.items()}
    cpu = {k: min(r["cpu_s"] for r in v) for k, v in runs.items()}
    same_acc = all(a["acc"] == runs["before"][0]["acc"] for a in runs["after"])
    result = {"config": str(args.config.relative_to(HERE)) if args.config.is_relative_to(HERE) else str(args.config),
              "repeat": args.repeat, "runs": runs, "best_seconds_per_round": best,
              "ratio_after_before": best["after"] / best["before"], "best_cpu_s": cpu,
              "cpu_ratio_after_before": cpu["after"] / cpu["before"], "accuracies_identical": same_acc,
              "command": "python -m benchmarks.families " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| tree | best s/round | best CPU s (whole run) | runs (s/round) |\n|---|---:|---:|---|")
    for k, v in runs.items():
        each = ", ".join(f"{r['seconds_per_round']:.3f}" for r in v)
        print(f"| {k} | {best[k]:.3f} | {cpu[k]:.1f} | {each} |")
    print(f"\nafter / before: {result['ratio_after_before']:.3f} (s/round), {result['cpu_ratio_after_before']:.3f} "
          f"(CPU s); every device's accuracy identical: {same_acc}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
