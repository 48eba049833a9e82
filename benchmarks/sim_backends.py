"""Simulation backends side by side (issue 30): sequential vs worker processes vs Ray, one job, one machine.

The job is a row of table 1's ``--quick`` schedule (``benchmarks.generative.rows.table1_methods``,
``quick=True``, built as ``python -m benchmarks.generative table1 --quick`` builds it: K = 10,
CNN-1 … CNN-10, Fashion-MNIST IID 10 %, SGD lr 0.1, batch 64, 5 local epochs, evaluation every 5
rounds); FedAvg within group by default.
``--rounds`` / ``--devices`` shrink it (the job is then *not* the quick schedule, and the JSON and
table say so).

Every backend runs in a child process of its own (so Ray's start-up is measured from nothing and
each process's peak memory is its own): ``sequential`` at one torch thread (the reference every
other backend must equal bit for bit), ``process`` with ``--workers`` worker processes and ``ray``
with as many single-CPU actors on a local Ray started with ``num_cpus = --workers``;
``sequential-t2`` (two intra-op threads, what a plain ``fedge simulate`` picks on a 2-core machine)
only when named in ``--backends``: on a 2-core machine shared with other jobs its threads spin
against each other (measured 225 s per round against 17.9 s at one thread), which says nothing
about the backends. ``--repeat N`` runs the backends N times, interleaved (A B C A B C), and
reports each one's best run, so a burst of load from other jobs on a shared machine does not
decide a ratio; every run's figures stay in the JSON.

Reported per backend: wall time (whole run, start-up included), the CPU seconds of its process
tree, its ratio to each sequential run, seconds per training round, start-up (workers spawned and
devices built; Ray: ``ray.init`` and the actors apart), the driver's per-round overhead (dispatch,
transfer, (de)serialisation: round wall time minus the slowest worker's own time), how evenly the
workers were loaded, peak RSS of the driver and of each worker, how many of the 2 cores other jobs
took meanwhile (machine busy time minus the run's own CPU time, over its wall time), and whether
every device's accuracies and bytes equal the reference's.

    python -m benchmarks.sim_backends                           # FedAvg, quick schedule: 20 rounds
    python -m benchmarks.sim_backends --repeat 2                # the same, each backend twice (best of 2)
    python -m benchmarks.sim_backends --method gefl-cvae        # another table-1 row
    python -m benchmarks.sim_backends --rounds 3 --repeat 2     # 3 rounds of it, each backend twice
    python -m benchmarks.sim_backends --rounds 1 --devices 4 --no-docs   # a smoke run
    python -m benchmarks.sim_backends --rounds 3 --repeat 2 --report-only   # the table again from its JSON

Results: ``benchmarks/results/sim_backends/<job>.json`` and the ``sim-backends`` section of docs/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

from benchmarks.common import REPO, RESULTS, markdown_table, run_sampled, text_table, write_docs_section

OUT = RESULTS / "sim_backends"
BACKENDS = ("sequential", "sequential-t2", "process", "ray")
TARGETS = {"process": 0.6, "ray": 0.7}  # wall time ≤ this × the sequential run's (issue 30)
QUIET_CORES = 0.2  # other jobs' mean CPU use (cores) above this while a backend ran: no speed comparison


def job_config(method: str, seed: int, rounds: int | None, devices: int | None, backend: str, workers: int) -> Any:
    """The fleet config of the job on ``backend``."""
    from benchmarks.generative.rows import build_config, table1_methods
    from fedge.fleet.sim_sections import SimulationSection

    m = table1_methods(published=False, quick=True)[method]
    if rounds is not None:
        m = dataclasses.replace(m, rounds=rounds)
    cfg = build_config(m, seed, devices=10 if devices is None else devices)
    sim = {"sequential": SimulationSection(threads=1),
           "sequential-t2": SimulationSection(threads=2),
           "process": SimulationSection(backend="process", workers=workers, threads=1),
           "ray": SimulationSection(backend="ray", workers=workers, threads=1)}[backend]
    return dataclasses.replace(cfg, simulation=sim)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One backend's run (in its own process): what the table reports."""
    from fedge.sim.worker import peak_rss_bytes

    t0 = time.perf_counter()
    if args.child == "ray":
        import ray

        ray.init(num_cpus=args.workers, include_dashboard=False, logging_level=logging.WARNING)
    ray_init = time.perf_counter() - t0
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    cfg = job_config(args.method, args.seed, args.rounds, args.devices, args.child, args.workers)
    res = build_results(simulate(cfg))
    wall = time.perf_counter() - t0
    sim = res["simulation"]
    return {
        "backend": args.child, "wall_s": wall, "seconds_per_round": res["seconds_per_round"],
        "rounds": res["rounds"], "ray_init_s": ray_init if args.child == "ray" else None,
        "driver_peak_rss_bytes": peak_rss_bytes(),
        "simulation": sim, "mean_best_acc_global": res["summary"]["mean_best_acc_global"],
        "mean_final_acc_global": res["summary"]["mean_final_acc_global"],
        "devices": {d["id"]: {"acc_global": d["acc_global"], "acc_local": d["acc_local"],
                              "bytes_up": d["bytes_up"], "bytes_down": d["bytes_down"]} for d in res["devices"]},
    }


def _busy_ticks() -> int:
    """Clock ticks every CPU of the machine spent busy since boot (/proc/stat; idle and iowait left out)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def _tree_ticks(root: int) -> dict[int, int]:
    """CPU ticks (user + system) of ``root`` and every live descendant (Ray's raylet and workers included)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # the fields after the command name
        parent[int(d)] = int(rest[1])
        ticks[int(d)] = int(rest[11]) + int(rest[12])
    tree, todo = {root}, [root]
    while todo:
        pid = todo.pop()
        kids = [c for c, p in parent.items() if p == pid and c not in tree]
        tree.update(kids)
        todo += kids
    return {pid: ticks[pid] for pid in tree if pid in ticks}


def run_child(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """One backend's run in a child process (``python -m benchmarks.sim_backends --child BACKEND``).

    While it runs, the CPU time the rest of the machine used is sampled: the machine's busy time
    (/proc/stat) minus the CPU time of the child's process tree (sampled each second, so a process
    that lives under a second is partly counted as the rest's). ``other_cores``: that, over the
    run's wall time — how many of the 2 cores other jobs took, which decides whether 2 workers could
    have 2 cores at all."""
    cmd = [sys.executable, "-m", "benchmarks.sim_backends", "--child", backend, "--method", args.method,
           "--seed", str(args.seed), "--workers", str(args.workers)]
    cmd += ["--rounds", str(args.rounds)] if args.rounds is not None else []
    cmd += ["--devices", str(args.devices)] if args.devices is not None else []
    print(f"running {backend} ...", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # fedge and the benchmarks from this tree
    hz = os.sysconf("SC_CLK_TCK")
    own: dict[int, int] = {}

    def sample(pid: int) -> None:
        for p, t in _tree_ticks(pid).items():
            own[p] = max(own.get(p, 0), t)

    busy0, t0 = _busy_ticks(), time.perf_counter()
    done = run_sampled(cmd, sample, every=1.0, env=env, cwd=REPO)
    wall, busy = time.perf_counter() - t0, _busy_ticks() - busy0
    if done.returncode != 0:
        raise SystemExit(f"{backend} failed (exit {done.returncode})")
    out = done.stdout
    other = max(0.0, (busy - sum(own.values())) / hz / wall)
    return {**json.loads(out.strip().splitlines()[-1]), "other_cores": other,
            "own_cores": sum(own.values()) / hz / wall}


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def render(cell: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, notes) of the table."""
    runs = cell["runs"]
    ref = runs.get("sequential")
    t2 = runs.get("sequential-t2")
    header = ["backend", "workers", "wall s (best)", "CPU s", "× seq (1 thr)", "× seq (2 thr)", "s / round",
              "start-up s", "overhead s / round", "worker balance", "driver RSS MiB", "worker peak RSS MiB",
              "others' cores", "identical to seq"]
    rows = []
    for name in BACKENDS:
        r = runs.get(name)
        if r is None:
            continue
        sim = r["simulation"]
        workers = [w for w in sim["workers"] if "peak_rss_bytes" in w]
        start = sim.get("start_s")
        if name == "ray":
            start_txt = f"{r['ray_init_s']:.1f} + {start:.1f}"  # ray.init + actors (devices built)
        else:
            start_txt = "-" if start is None else f"{start:.1f}"
        over = sim.get("mean_round_overhead_s")
        rows.append([
            name, str(len(sim["workers"])), f"{r['wall_s']:.1f}",
            "-" if r.get("own_cores") is None else f"{r['own_cores'] * r['wall_s']:.0f}",
            f"{r['wall_s'] / ref['wall_s']:.2f}" if ref else "-", f"{r['wall_s'] / t2['wall_s']:.2f}" if t2 else "-",
            f"{r['seconds_per_round']:.2f}", start_txt, "-" if over is None else f"{over:.3f}", balance(sim),
            mib(r["driver_peak_rss_bytes"]),
            " / ".join(mib(w["peak_rss_bytes"]) for w in workers) if name not in ("sequential", "sequential-t2")
            else "(the driver)",
            "-" if r.get("other_cores") is None else f"{r['other_cores']:.2f}",
            "reference" if name == "sequential" else ("yes" if r["identical"] else "NO"),
        ])
    notes = []
    for name, target in TARGETS.items():
        if name in runs and ref:
            ratio = runs[name]["wall_s"] / ref["wall_s"]
            notes.append(f"{name}: {ratio:.2f}× the sequential wall time (target ≤ {target}) — "
                         + ("met" if ratio <= target else "NOT met"))
    others = [r["other_cores"] for r in runs.values() if r.get("other_cores") is not None]
    if others and max(others) > QUIET_CORES:
        notes.append(f"other jobs took up to {max(others):.2f} of the 2 cores while a backend ran: the ratios say "
                     "as much about them as about the backends — run it again on a quiet machine")
    elif not others:
        notes.append("what other jobs took of the cores was not recorded for these runs (measured before that column)")
    return header, rows, notes


def balance(sim: dict[str, Any]) -> str:
    """Mean over rounds of (work done) / (workers × the busiest worker's time): 1.00 = perfectly even."""
    shares = [sum(w) / (len(w) * max(w)) for w in sim.get("round_worker_s", [])
              if w and None not in w and max(w) > 0]
    return f"{sum(shares) / len(shares):.2f}" if shares else "-"


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["devices"] == b["devices"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="fedavg", help="a table-1 row key (benchmarks.generative.rows.table1_methods)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, help="shorten the job (default: the quick schedule's rounds)")
    ap.add_argument("--devices", type=int, help="fewer devices (default: table 1's 10)")
    ap.add_argument("--workers", type=int, default=2, help="process workers / Ray actors (and Ray's num_cpus)")
    ap.add_argument("--backends", nargs="+", default=["sequential", "process", "ray"], choices=BACKENDS)
    ap.add_argument("--repeat", type=int, default=1, help="runs per backend, interleaved; the best is reported")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/results.md")
    ap.add_argument("--report-only", action="store_true", help="the table (and docs) from the saved JSON")
    ap.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    quick = args.rounds is None and args.devices is None
    job = f"{args.method}-{'quick' if quick else f'r{args.rounds}-d{args.devices or 10}'}-s{args.seed}-w{args.workers}"
    if args.report_only:
        cell = json.loads((OUT / f"{job}.json").read_text())
        report(cell, args)
        return
    every: dict[str, list[dict[str, Any]]] = {b: [] for b in args.backends}
    for _ in range(args.repeat):
        for b in args.backends:
            every[b].append(run_child(b, args))
    runs = {b: min(rs, key=lambda r: r["wall_s"]) for b, rs in every.items()}
    ref = runs.get("sequential")
    for b, r in runs.items():
        r["identical"] = all(identical(x, ref) for x in every[b]) if ref else None
        r["all_wall_s"] = [x["wall_s"] for x in every[b]]
    command = "python -m benchmarks.sim_backends " + " ".join(sys.argv[1:])
    cell = {"job": job, "method": args.method, "quick_schedule": quick, "seed": args.seed, "workers": args.workers,
            "repeat": args.repeat, "command": command.strip(), "runs": runs}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{job}.json").write_text(json.dumps(cell, indent=1))
    report(cell, args)


def report(cell: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table; unless ``--no-docs``, write it into docs/results.md."""
    header, rows, notes = render(cell)
    print()
    print(text_table(header, rows))
    for n in notes:
        print(n)
    if not args.no_docs:
        job = ("table 1's quick schedule" if cell["quick_schedule"] else
               f"table 1's quick schedule cut to {args.rounds or 'its'} rounds and {args.devices or 10} devices")
        body = (f"**Simulation backends** (issue 30): `{cell['command']}` — {cell['method']}, {job}, "
                f"seed {cell['seed']}, best of {cell.get('repeat', 1)} interleaved run(s) each, on this 2-core "
                "machine (others' cores: the CPU other jobs used while that backend ran, in cores).\n\n"
                + markdown_table(header, rows)
                + "\n\n" + "\n".join(f"* {n}" for n in notes))
        write_docs_section("sim-backends", body)


if __name__ == "__main__":
    main()
