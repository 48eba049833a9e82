"""Coordinator CPU per accepted update, synchronous rounds against asynchronous versions (issue 27's cost target).

Target: "coordinator CPU per update in async mode <= 1.2x sync's at N = 1,000". Both modes run on
:mod:`benchmarks.fleet_scale`'s fleet — N protocol-level devices (one selector thread, fedge's own messages,
topics, codec and framing) through one Mosquitto on loopback, against the real coordinator (``RoundEngine`` +
``FedProtoStrategy`` + ``MqttCoordinatorTransport``, checkpointing, in its own process):

* **sync**: ``rounds`` synchronous rounds of N updates each;
* **async, K**: ``[coordinator] mode = "async"``, ``buffer_size = K``, every device training at once, polynomial
  staleness weights, ``max_staleness = max(10, 2 N / K)``; ``rounds x N / K`` versions, so each mode takes the
  same number of updates. A device answers each task a descriptor's ``round.assigned`` gives it, at once
  (statistics-only devices, no training), so a version's K updates are the next K in the broker's queue.

The runs are interleaved (sync, async K1, async K2, ... then the next repeat in a rotated order, so that the
machine's load drift does not favour one mode) and repeated. Per run: the coordinator's CPU seconds (user +
sys, from the end of registration to the end of the last training round or version, checkpoints included)
divided by the updates it accepted in that time. Reported per mode: the median and the best of the runs, and
the ratio async / sync of each; the load average at start and end (the machine is shared). Writes
``benchmarks/results/async_cost.json`` (or ``--out``); ``--profile DIR`` also writes each coordinator's cProfile.

    .venv/bin/python -m benchmarks.async_cost --sizes 100 --rounds 2 --repeat 1        # smoke, ~1 min
    .venv/bin/python -m benchmarks.async_cost --sizes 1000 --rounds 3 --repeat 2       # the target
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import fleet_scale
from benchmarks.common import RESULTS
from fedge.mqtt.broker import MosquittoProcess, loopback_config

OUT = RESULTS / "async_cost.json"
TARGET = 1.2  # issue 27: async CPU per update at most 1.2x sync's


def configs(n: int, fractions: list[float], mode: str, state: str = "on") -> list[tuple[str, int, bool]]:
    """(label, buffer size, checkpoints) per configuration run at ``n`` devices (buffer 0: synchronous rounds;
    ``state`` "off" or "both": also without a state directory, labelled "no state")."""
    modes: list[tuple[str, int]] = [("sync", 0)] if mode in ("sync", "both") else []
    if mode in ("async", "both"):
        for f in fractions:
            k = max(1, min(n, round(n * f)))
            modes.append((f"async K={k}", k))
    out = [(label, k, True) for label, k in modes] if state in ("on", "both") else []
    out += [(f"{label}, no state", k, False) for label, k in modes] if state in ("off", "both") else []
    return out


def per_update(run: dict[str, Any]) -> float:
    """One run's coordinator CPU seconds per accepted update, over its training rounds or versions."""
    return sum(run["cpu_seconds_per_round"]) / sum(run["accepted_per_round"])


def wall_per_update(run: dict[str, Any]) -> float:
    """One run's wall seconds per accepted update (round ends to round ends, checkpoints included)."""
    return sum(run["round_seconds"]) / sum(run["accepted_per_round"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000", help="fleet sizes N (comma-separated; default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="synchronous rounds per sync run; async runs take as "
                                                         "many updates (rounds x N / K versions)")
    p.add_argument("--buffers", default="0.1,1", help="async buffer sizes as fractions of N (default 0.1,1)")
    p.add_argument("--mode", choices=("sync", "async", "both"), default="both",
                   help="which modes to run (both: side by side, interleaved; the ratio needs both)")
    p.add_argument("--state", choices=("on", "off", "both"), default="on",
                   help="the coordinator's state directory (checkpoints, async mode's update log): on (as "
                        "deployed), off, or both side by side (what durability costs each mode)")
    p.add_argument("--repeat", type=int, default=2, help="interleaved runs per configuration (median and best)")
    p.add_argument("--profile", metavar="DIR", help="write each coordinator's cProfile of its rounds to DIR")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    fractions = [float(x) for x in args.buffers.split(",")]
    if args.profile:
        fleet_scale.PROFILE_DIR = Path(args.profile)
        fleet_scale.PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))  # 1000 sockets + the broker's
    load_start = os.getloadavg()
    started = time.time()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fedge-async-cost-") as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            cfgs = configs(n, fractions, args.mode, args.state)
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in cfgs}
            broker = MosquittoProcess(port=None, max_message_bytes=1 << 20)
            broker.config_path.write_text(loopback_config(broker.port, max_message_bytes=1 << 20))
            broker.start()
            try:
                for rep in range(args.repeat):
                    order = cfgs[rep % len(cfgs):] + cfgs[:rep % len(cfgs)]  # rotated: no mode always first
                    for label, k, state in order:
                        rounds = args.rounds if not k else args.rounds * n // k
                        run = fleet_scale.run_fedge(broker.port, n, rounds, Path(tmp) / f"n{n}-r{rep}", buffer=k,
                                                    max_staleness=max(10, 2 * n // k) if k else 10, state=state)
                        run["load_average_after"] = os.getloadavg()
                        runs[label].append(run)
                        main = run["main_thread_cpu_seconds"] / sum(run["accepted_per_round"])
                        print(f"N={n} {label} (repeat {rep + 1}): {per_update(run) * 1e3:.3f} ms CPU/update "
                              f"({main * 1e3:.3f} in the engine's thread), "
                              f"{wall_per_update(run) * 1e3:.3f} ms wall/update, load {os.getloadavg()[0]:.1f}",
                              file=sys.stderr, flush=True)
            finally:
                broker.close()
            for label, k, state in cfgs:
                cpu = [per_update(r) for r in runs[label]]
                wall = [wall_per_update(r) for r in runs[label]]
                rows.append({
                    "n": n, "mode": "async" if k else "sync", "label": label, "buffer_size": k, "state": state,
                    "rounds": args.rounds if not k else args.rounds * n // k,
                    "updates_per_run": sum(runs[label][0]["accepted_per_round"]),
                    "cpu_ms_per_update_median": statistics.median(cpu) * 1e3,
                    "cpu_ms_per_update_best": min(cpu) * 1e3,
                    "cpu_ms_per_update_runs": [c * 1e3 for c in cpu],
                    "wall_ms_per_update_median": statistics.median(wall) * 1e3,
                    "main_thread_cpu_ms_per_update_median": statistics.median(
                        r["main_thread_cpu_seconds"] / sum(r["accepted_per_round"]) for r in runs[label]) * 1e3,
                    "staleness_mean": statistics.mean(r["staleness_mean"] for r in runs[label]),
                    "rejected": sum(r["rejected"] for r in runs[label]),
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in runs[label]),
                    "runs": runs[label],
                })
    for row in rows:
        sync = next((r for r in rows if r["n"] == row["n"] and r["mode"] == "sync" and r["state"] == row["state"]),
                    None)  # each against sync with the same durability
        if sync is not None:
            row["ratio_median"] = row["cpu_ms_per_update_median"] / sync["cpu_ms_per_update_median"]
            row["ratio_best"] = row["cpu_ms_per_update_best"] / sync["cpu_ms_per_update_best"]
    load_end = os.getloadavg()
    doc = {
        "benchmark": "async_cost",
        "command": " ".join(["python -m benchmarks.async_cost", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "rounds": args.rounds, "repeat": args.repeat, "buffers": fractions, "target_ratio": TARGET,
        "message_bytes": fleet_scale.sizes(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "paho": importlib.metadata.version("paho-mqtt"), "platform": platform.platform(),
                    "load_average_at_start": load_start, "load_average_at_end": load_end},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(rows))
    print(f"\nload average (1, 5, 15 min) at start {' '.join(f'{x:.1f}' for x in load_start)}, "
          f"at end {' '.join(f'{x:.1f}' for x in load_end)}; {os.cpu_count()} cores, shared")
    print(f"wrote {args.out}")
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as aligned text: CPU per update (median, best), its ratio to sync's, wall per update."""
    head = ["N", "mode", "updates/run", "CPU ms/update median", "best", "async/sync median", "best",
            "wall ms/update", "staleness mean", "rejected"]
    lines = [head]
    for r in rows:
        ratio = (f"{r['ratio_median']:.2f}", f"{r['ratio_best']:.2f}") if "ratio_median" in r else ("-", "-")
        lines.append([str(r["n"]), r["label"], str(r["updates_per_run"]), f"{r['cpu_ms_per_update_median']:.3f}",
                      f"{r['cpu_ms_per_update_best']:.3f}", *ratio, f"{r['wall_ms_per_update_median']:.3f}",
                      f"{r['staleness_mean']:.2f}", str(r["rejected"])])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines)


if __name__ == "__main__":
    raise SystemExit(main())
