"""Aggregation throughput of shared-subscription workers: one worker against two, draining the same backlog.

Issue 29's target: "2 workers on a shared subscription: aggregation throughput >= 1.6x one worker's at N =
5,000 on the 2 cores". ``benchmarks.scaleout``'s workers part runs a whole fleet (5,000 Python device
connections, the broker, the coordinator and the workers on the same 2 cores), so it measures where the CPU goes,
not what the workers can aggregate. Here only the aggregation path runs while the clock runs:

1. one Mosquitto on loopback (``max_queued_messages 100000``); N retained hellos and a retained round descriptor
   (round 1, FedProto, as the coordinator publishes it) of a fleet of N FedProto-sized devices;
2. W ``fedge`` aggregation workers (:class:`fedge.scaleout.worker.AggregationWorker` with the real
   ``PartialAggregator`` and update gate, each in its own process) join the shared subscription, register the N
   hellos and read the descriptor, then are stopped (``SIGSTOP``);
3. the N updates (encoded beforehand) are published and acknowledged by the broker, which queues them for the
   stopped workers (a shared subscription hands each to one member);
4. the workers are continued (``SIGCONT``) at t0; each records when it admitted its last update. Drain time =
   the last admission of any worker - t0 (``CLOCK_MONOTONIC`` is one clock for every process here);
   throughput = N / drain time. The broker delivering the backlog is part of what is timed.

W = 1 and W = 2 alternate (``--repeat``); the ratio of the medians is the target's. Writes
``benchmarks/results/worker_throughput.json`` (or ``--out``) and prints a table.

    .venv/bin/python -m benchmarks.worker_throughput --n 5000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, child_command
from benchmarks.fleet_scale import CLASSES, _cpu, _device_info, _update_bytes, sizes
from benchmarks.scaleout import _broker
from fedge.common.messages import Message
from fedge.mqtt.client import new_paho_client
from fedge.mqtt.topics import FleetTopics

OUT = RESULTS / "worker_throughput.json"
MODULE = "benchmarks.worker_throughput"
TARGET = 1.6  # issue 29: 2 workers' aggregation throughput at least 1.6x one worker's


def _descriptor(fleet: str) -> bytes:
    return Message("round", "coordinator", 1, fleet, info={
        "round": {"round": 1, "phase": "train", "method": "fedproto", "deadline": 0.0, "config": {}},
        "run": "0" * 32, "globals": {}}).to_bytes()


def _publish_all(port: int, items: list[tuple[str, bytes, bool]], what: str) -> None:
    """Publish ``(topic, payload, retain)`` at QoS 1 and wait until the broker acknowledged every one."""
    c = new_paho_client(f"bench-pub-{os.getpid()}-{what}", clean_session=True)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        infos = [c.publish(topic, payload, qos=1, retain=retain) for topic, payload, retain in items]
        for info in infos:
            info.wait_for_publish(120)
            if not info.is_published():
                raise RuntimeError(f"{what}: the broker did not acknowledge a publication within 120 s")
    finally:
        c.loop_stop()
        c.disconnect()


def run_once(n: int, workers: int, work: Path, tag: str) -> dict[str, Any]:
    """One drain of ``n`` queued updates by ``workers`` worker processes."""
    broker = _broker()
    fleet = f"drain{workers}-{tag}"
    t = FleetTopics(fleet)
    ids = [f"dev-{i:05d}" for i in range(n)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _publish_all(broker.port, [(t.hello(d), Message("hello", d, 0, fleet, info={
            "device": _device_info(d).to_dict()}).to_bytes(), True) for d in ids] + [
            (t.round, _descriptor(fleet), True)], "hellos")
        updates = [(t.update(d), _update_bytes(fleet, d, 1, False, i), False) for i, d in enumerate(ids)]
        outs = [work / f"{fleet}-w{k + 1}" for k in range(workers)]
        procs = [subprocess.Popen([sys.executable, "-m", MODULE, "_worker", "--port", str(broker.port), "--fleet",
                                   fleet, "--name", f"worker-{k + 1}", "--n", str(n), "--out", str(out)])
                 for k, out in enumerate(outs)]
        _wait(lambda: all(Path(f"{o}.ready").exists() for o in outs), procs, 300, "workers registering the hellos")
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        _publish_all(broker.port, updates, "updates")  # queued by the broker for the stopped workers
        t0 = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGCONT)
        _wait(lambda: sum(_progress(o)[0] for o in outs) >= n, procs, 600, "workers draining the updates")
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"a worker exited with {p.returncode}")
        done = [json.loads(Path(f"{o}.json").read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        broker.close()
    drain = max(d["last_admit_t"] for d in done) - t0
    return {"workers": workers, "n": n, "drain_s": drain, "updates_per_s": n / drain,
            "admitted": [d["admitted"] for d in done], "accepted": [d["accepted"] for d in done],
            "cpu_s": [d["cpu_s"] for d in done], "load_average_after": os.getloadavg()}


def _progress(out: Path) -> tuple[int, float]:
    try:
        admitted, last = Path(f"{out}.progress").read_text().split()
        return int(admitted), float(last)
    except (OSError, ValueError):
        return 0, 0.0


def _wait(cond: Callable[[], bool], procs: list[subprocess.Popen[bytes]], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: a worker exited ({[p.returncode for p in procs]})")
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not done after {timeout_s:.0f} s")
        time.sleep(0.02)


def worker_main(args: argparse.Namespace) -> None:
    """A worker process: the real AggregationWorker, its admissions counted and timed."""
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.connection import BrokerSettings
    from fedge.scaleout.aggregator import PartialAggregator
    from fedge.scaleout.worker import AggregationWorker

    agg = PartialAggregator(FedProtoStrategy(num_classes=CLASSES, rounds=1),
                            EngineConfig(fleet=args.fleet, method="fedproto"), args.name)
    state = {"admitted": 0, "accepted": 0, "last": 0.0}
    admit = agg.admit

    def timed_admit(item: Any) -> bool:
        ok = admit(item)
        state["admitted"] += 1
        state["accepted"] += int(ok)
        state["last"] = time.monotonic()
        return ok

    agg.admit = timed_admit  # type: ignore[method-assign]
    w = AggregationWorker(BrokerSettings(port=args.port), args.fleet, agg).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    while len(agg.gate.devices) < args.n or agg.round != 1:  # every hello registered, the descriptor read
        if stop.wait(0.02):
            break
    Path(f"{args.out}.ready").write_text("ready\n")
    cpu0 = _cpu()
    while not stop.wait(0.02):
        Path(f"{args.out}.progress").write_text(f"{state['admitted']} {state['last']}\n")
    cpu = _cpu() - cpu0
    w.stop()
    Path(f"{args.out}.json").write_text(json.dumps({
        "admitted": state["admitted"], "accepted": state["accepted"], "last_admit_t": state["last"], "cpu_s": cpu}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role")
    child_command(sub, "_worker", ("--port", "--n"), ("--fleet", "--name", "--out"))
    p.add_argument("--n", type=int, default=5000, help="updates in the backlog, one per device (default 5000)")
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of 1 and 2 workers (default 3)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.role == "_worker":
        worker_main(args)
        return 0
    load_start = os.getloadavg()
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="fedge-drain-") as tmp:
        for rep in range(args.repeat):
            for w in ((1, 2) if rep % 2 == 0 else (2, 1)):  # alternated: neither always first
                r = run_once(args.n, w, Path(tmp), f"r{rep}")
                if sum(r["accepted"]) != args.n:
                    raise RuntimeError(f"{w} worker(s) accepted {sum(r['accepted'])} of {args.n} updates: {r}")
                runs[w].append(r)
                print(f"{w} worker(s), repeat {rep + 1}: {r['drain_s']:.3f} s, {r['updates_per_s']:.0f} updates/s, "
                      f"CPU {', '.join(f'{c:.2f}' for c in r['cpu_s'])} s, load {os.getloadavg()[0]:.1f}",
                      file=sys.stderr, flush=True)
    med = {w: statistics.median(r["updates_per_s"] for r in rs) for w, rs in runs.items()}
    given = argv if argv is not None else sys.argv[1:]
    doc = {"benchmark": "worker_throughput", "command": " ".join(["python -m benchmarks.worker_throughput", *given]),
           "n": args.n, "repeat": args.repeat, "message_bytes": sizes(), "target_ratio": TARGET,
           "updates_per_s_median": med, "ratio": med[2] / med[1], "runs": runs,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                       "load_average_at_start": load_start, "load_average_at_end": os.getloadavg()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{'workers':>7}  {'drain s (runs)':>30}  {'updates/s median':>16}  {'worker CPU s':>14}")
    for w, rs in runs.items():
        drains = ", ".join(f"{r['drain_s']:.3f}" for r in rs)
        print(f"{w:>7}  {drains:>30}  {med[w]:>16.0f}  {statistics.median(sum(r['cpu_s']) for r in rs):>14.2f}")
    print(f"\n2 workers / 1: {doc['ratio']:.2f} (target >= {TARGET}); load average {load_start[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, shared\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
