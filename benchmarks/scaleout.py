"""Scale-out: the root coordinator's CPU per update with 0 and 2 aggregation workers, and the bytes through
the root broker for a flat fleet and for 2 shards with relays.

Built on ``benchmarks.fleet_scale``'s machinery: N protocol devices (``Swarm``, one selector thread) sending
FedProto-sized updates (2992 bytes) to the real coordinator process (``RoundEngine`` + ``FedProtoStrategy`` +
the MQTT transport, checkpointing), through Mosquitto on loopback.

* **workers**: the same fleet with the coordinator reading every update (flat), then with 2 ``fedge
  coordinator worker`` processes on an MQTT 5 shared subscription and the coordinator merging their
  partials (``--workers-mode``). Reported: round wall time, the root coordinator's CPU per round and
  per update, and the workers' CPU per update.
* **shards**: the fleet on one broker, then split over 2 shard brokers with a relay each (in this
  driver process) and the coordinator on a root broker; bytes in + out of the root broker per round from
  Mosquitto's ``$SYS/broker/bytes/*`` counters (``sys_interval 1``), registration excluded.

The machine has 2 cores shared with other work: every process here (devices, brokers, coordinator,
workers, relays) competes for them, so this measures *where the CPU goes*, not the throughput of 2
machines.

    .venv/bin/python -m benchmarks.scaleout --n 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from benchmarks.common import RESULTS
from benchmarks.fleet_scale import MODULE as FLEET_SCALE
from benchmarks.fleet_scale import SAMPLES, Swarm, _cpu, _update_bytes, sizes
from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT
from fedge.common.tensorcodec import read_header
from fedge.mqtt.broker import LOOPBACK, MosquittoProcess, loopback_config
from fedge.mqtt.chunking import DEFAULT_CHUNK_BYTES, split
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics

OUT = RESULTS / "scaleout.json"
MODULE = "benchmarks.scaleout"


def _broker() -> MosquittoProcess:
    b = MosquittoProcess(port=None, max_message_bytes=1 << 22)
    b.config_path.write_text(loopback_config(b.port, max_message_bytes=1 << 22, extra="sys_interval 1"))
    return b.start()


def _devices(ports: list[int], fleet: str, n: int, rounds: int) -> list[Swarm]:
    """N protocol devices spread over the brokers on ``ports`` (contiguous blocks), answering every round."""
    from benchmarks.fleet_scale import _device_info

    t = FleetTopics(fleet)
    ids = [f"dev-{i:04d}" for i in range(n)]
    updates = [{r: split(_update_bytes(fleet, dev, r, r > rounds, seed=i * 100 + r), DEFAULT_CHUNK_BYTES)
                for r in range(1, rounds + 2)} for i, dev in enumerate(ids)]
    swarms = []
    per = -(-n // len(ports))
    for k, port in enumerate(ports):
        block = ids[k * per:(k + 1) * per]
        offset = k * per
        answered: dict[int, str] = {}

        def on_connect(i: int, c: paho.Client, block: list[str] = block) -> None:
            dev = block[i]
            c.publish(t.status(dev), STATUS_ONLINE, qos=1, retain=True)
            c.publish(t.hello(dev), Message("hello", dev, 0, fleet, info={"device": _device_info(dev).to_dict()})
                      .to_bytes(), qos=1, retain=True)

        def on_message(i: int, c: paho.Client, msg: paho.MQTTMessage, block: list[str] = block, offset: int = offset,
                       answered: dict[int, str] = answered) -> None:
            if msg.topic != t.round or not msg.payload:
                return
            meta = read_header(bytes(msg.payload))[1]
            if answered.get(i) == meta["msg_id"]:
                return
            answered[i] = meta["msg_id"]
            for frame in updates[offset + i].get(int(meta["round"]), []):
                c.publish(t.update(block[i]), frame, qos=1)

        swarms.append(Swarm(port, block, on_message, subscribe=[t.round, t.global_filter(PROTOTYPES_ARTIFACT)],
                            will=lambda d: (t.status(d), STATUS_OFFLINE), on_connect=on_connect))
    for s in swarms:
        s.wait_connected()
    return swarms


def _close(swarms: list[Swarm], fleet: str) -> None:
    t = FleetTopics(fleet)
    for s in swarms:
        s.close(final=lambda d: (t.status(d), STATUS_OFFLINE))


class SysBytes:
    """Mosquitto's ``$SYS/broker/bytes/{received,sent}`` on one broker, refreshed every second."""

    def __init__(self, port: int) -> None:
        self.values: dict[str, int] = {}
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2) if hasattr(paho, "CallbackAPIVersion") else paho.Client()
        self.c.on_message = lambda c, u, m: self.values.__setitem__(m.topic.rsplit("/", 1)[-1], int(m.payload))
        self.c.connect(LOOPBACK, port)
        self.c.subscribe("$SYS/broker/bytes/+")
        self.c.loop_start()

    def total(self) -> int:
        time.sleep(2.2)  # two $SYS intervals: the counters include everything so far
        return self.values.get("received", 0) + self.values.get("sent", 0)

    def split(self) -> tuple[int, int]:
        """(received, sent) as of the last :meth:`total`."""
        return self.values.get("received", 0), self.values.get("sent", 0)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _coordinator(port: int, n: int, rounds: int, fleet: str, work: Path, *, workers_mode: bool) -> dict[str, Any]:
    out = work / f"coord-{fleet}.json"
    cmd = [sys.executable, "-m", FLEET_SCALE, "_coordinator", "--port", str(port), "--n", str(n), "--rounds",
           str(rounds), "--fleet", fleet, "--state-dir", str(work / f"state-{fleet}"), "--out", str(out)]
    subprocess.run(cmd + (["--workers-mode"] if workers_mode else []), check=True, timeout=1800)
    return json.loads(out.read_text())


def run_workers(n: int, rounds: int, workers: int, work: Path) -> dict[str, Any]:
    broker = _broker()
    fleet = f"w{workers}-{n}"
    procs = [subprocess.Popen([sys.executable, "-m", MODULE, "_worker", "--port", str(broker.port), "--fleet", fleet,
                               "--name", f"worker-{k + 1}", "--rounds", str(rounds),
                               "--out", str(work / f"{fleet}-worker-{k + 1}.json")]) for k in range(workers)]
    swarms = _devices([broker.port], fleet, n, rounds)
    try:
        time.sleep(1.0 if workers else 0)
        res = _coordinator(broker.port, n, rounds, fleet, work, workers_mode=workers > 0)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
        _close(swarms, fleet)
        broker.close()
    res["worker_cpu_s"] = [json.loads((work / f"{fleet}-worker-{k + 1}.json").read_text())["cpu_s"]
                           for k in range(workers)]
    res["worker_updates"] = [json.loads((work / f"{fleet}-worker-{k + 1}.json").read_text())["updates"]
                             for k in range(workers)]
    return res


def worker_main(args: argparse.Namespace) -> None:
    from benchmarks.fleet_scale import CLASSES
    from fedge.coordinator.aggregator import PartialAggregator
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.client import BrokerSettings
    from fedge.mqtt.worker import AggregationWorker

    agg = PartialAggregator(FedProtoStrategy(num_classes=CLASSES, rounds=args.rounds),
                            EngineConfig(fleet=args.fleet, method="fedproto"), args.name)
    w = AggregationWorker(BrokerSettings(port=args.port), args.fleet, agg).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    cpu0 = _cpu()
    stop.wait(3600)
    w.stop()
    Path(args.out).write_text(json.dumps({"cpu_s": _cpu() - cpu0, "updates": w.updates_in}))


def run_shards(n: int, rounds: int, shards: int, work: Path, *, detail: bool = False,
               exact: bool = True) -> dict[str, Any]:
    """Bytes through the root broker per training round: flat (shards=0) or with ``shards`` relays (``detail``:
    their partials carry one entry per device, as before compact partials)."""
    from benchmarks.fleet_scale import CLASSES
    from fedge.coordinator.aggregator import PartialAggregator
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.relay import Relay

    root = _broker()
    leaves = [_broker() for _ in range(shards)]
    fleet = f"s{shards}{'d' if detail else ''}{'' if exact else 'f'}-{n}"
    relays = [Relay(b.settings(), root.settings(), fleet,
                    PartialAggregator(FedProtoStrategy(num_classes=CLASSES, rounds=rounds),
                                      EngineConfig(fleet=fleet, method="fedproto"), f"relay-{k + 1}", detail=detail,
                                      exact=exact),
                    hold_s=5.0).start() for k, b in enumerate(leaves)]
    meter = SysBytes(root.port)
    swarms = _devices([b.port for b in leaves] or [root.port], fleet, n, rounds)
    try:
        # registration (hellos, statuses, and the coordinator reading them) is not a round's: the meter is read
        # once the coordinator has registered every device, before it announces round 1
        ready = work / f"ready-{fleet}"
        out = work / f"coord-{fleet}.json"
        proc = subprocess.Popen([sys.executable, "-m", FLEET_SCALE, "_coordinator", "--port", str(root.port), "--n",
                                 str(n), "--rounds", str(rounds), "--fleet", fleet, "--state-dir",
                                 str(work / f"state-{fleet}"), "--out", str(out), "--ready-file", str(ready)])
        deadline = time.monotonic() + 600
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        before = meter.total()
        in0, out0 = meter.split()
        Path(str(ready) + ".go").touch()
        t0 = time.perf_counter()
        if proc.wait(1800) != 0:
            raise RuntimeError(f"the coordinator of {fleet} failed ({proc.returncode})")
        res = json.loads(out.read_text())
        wall = time.perf_counter() - t0
        after = meter.total()
        in1, out1 = meter.split()
    finally:
        meter.close()
        for r in relays:
            r.stop()
        _close(swarms, fleet)
        for b in (root, *leaves):
            b.close()
    res["root_bytes_per_round"] = (after - before) / (rounds + 1)  # training rounds + the final one
    res["root_bytes_in_per_round"] = (in1 - in0) / (rounds + 1)  # into the root broker (publishes)
    res["root_bytes_out_per_round"] = (out1 - out0) / (rounds + 1)  # out of it (deliveries)
    res["wall_s"] = wall
    return res


def run_merge(n: int, per: int) -> dict[str, Any]:
    """In one process, no broker: what the root coordinator spends on N devices reported by N / ``per`` compact
    partials — registering the N hellos, admitting each partial as the engine does (the set of devices already
    counted kept in step with the report), finishing the round — and what an aggregator spends per update."""
    from dataclasses import asdict

    from benchmarks.fleet_scale import CLASSES, _device_info
    from fedge.common.transport import Inbound
    from fedge.coordinator.aggregator import PartialAggregator
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.gate import UpdateGate
    from fedge.coordinator.merge import PartialMerger, merged_into
    from fedge.coordinator.report import RoundReport
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy

    fleet = "merge"
    cfg = EngineConfig(fleet=fleet, method="fedproto")
    ids = [f"dev-{i + 1}" for i in range(n)]
    hellos = [Inbound(Message("hello", d, 0, fleet, info={"device": _device_info(d).to_dict()}).to_bytes(), d)
              for d in ids]
    partials: list[tuple[str, bytes]] = []
    agg_cpu = 0.0
    for k in range(n // per):
        name = f"relay-{k + 1}"
        agg = PartialAggregator(FedProtoStrategy(num_classes=CLASSES, rounds=3), cfg, name)
        agg.register(hellos[k * per:(k + 1) * per])
        agg.begin(1, final=False, descriptor="x" * 32)
        updates = [Inbound(_update_bytes(fleet, ids[i], 1, False, i), ids[i]) for i in range(k * per, (k + 1) * per)]
        c0 = _cpu()
        for u in updates:
            agg.admit(u)
        data = agg.flush()
        agg_cpu += _cpu() - c0
        assert data is not None
        partials.append((name, data))
    strat = FedProtoStrategy(num_classes=CLASSES, rounds=3)
    gate = UpdateGate(strat, cfg)
    c0 = _cpu()
    gate.register(hellos)
    register_s = _cpu() - c0
    strat.begin_round(1)
    gate.begin_round(1, final=False)
    merger = PartialMerger(strat, gate, fleet=fleet, max_bytes=cfg.max_update_bytes)
    merger.begin_round(1, final=False)
    report = RoundReport(round=1, phase="train")
    counted: set[str] = set()
    c0 = _cpu()
    for name, data in partials:
        before = len(report.accepted)
        assert merger.admit(Inbound(data, name, kind="partial"), counted, merged_into(report, name))
        counted.update(report.accepted[before:])
    merge_s = _cpu() - c0
    c0 = _cpu()
    strat.finish_round(1)
    finish_s = _cpu() - c0
    return {"n": n, "devices_per_partial": per, "partials": len(partials),
            "partial_bytes": statistics.mean(len(d) for _, d in partials),
            "root_register_ms_per_device": 1000 * register_s / n, "root_merge_ms_per_partial": 1000 * merge_s /
            len(partials), "root_merge_us_per_device": 1e6 * merge_s / n, "root_finish_ms": 1000 * finish_s,
            "aggregator_ms_per_update": 1000 * agg_cpu / n, "report_json_bytes": len(json.dumps(asdict(report)))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role")
    wk = sub.add_parser("_worker")
    for a in ("--port", "--rounds"):
        wk.add_argument(a, type=int, required=True)
    for a in ("--fleet", "--name", "--out"):
        wk.add_argument(a, required=True)
    p.add_argument("--n", type=int, default=1000, help="devices (default 1000)")
    p.add_argument("--shard-n", type=int, default=200, help="devices of the bytes comparison (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="training rounds per run (default 3)")
    p.add_argument("--only", choices=("workers", "shards", "merge"),
                   help="run one part: the workers' or the shards' comparison, or the root's merge costs")
    p.add_argument("--merge-n", type=int, default=20000, help="devices of the merge measurement (default 20000)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.role == "_worker":
        worker_main(args)
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    rows: dict[str, Any] = {}
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fedge-scaleout-") as tmp:
        for workers in () if args.only in ("shards", "merge") else (0, 2):
            r = run_workers(args.n, args.rounds, workers, Path(tmp))
            cpu = statistics.median(r["cpu_seconds_per_round"])
            rows[f"workers={workers}"] = {
                "round_s": statistics.median(r["round_seconds"]), "root_cpu_s_per_round": cpu,
                "root_cpu_ms_per_update": 1000 * cpu / args.n,
                "worker_cpu_ms_per_update": (1000 * sum(r["worker_cpu_s"]) / max(sum(r["worker_updates"]), 1)
                                             if workers else None),
                "worker_updates": r["worker_updates"], "root_peak_rss_mb": r["peak_rss_mb"], "raw": r}
            print(f"workers={workers}: {rows[f'workers={workers}']['round_s']:.3f} s/round, root CPU "
                  f"{1000 * cpu / args.n:.3f} ms/update", file=sys.stderr, flush=True)
        for per in (5000, 1000) if args.only in (None, "merge") else ():
            rows[f"merge per={per}"] = m = run_merge(args.merge_n, per)
            print(f"merge: {m}", file=sys.stderr, flush=True)
        for shards, detail, exact in () if args.only in ("workers", "merge") else (
                (0, False, True), (2, True, True), (2, False, True), (2, False, False)):
            r = run_shards(args.shard_n, args.rounds, shards, Path(tmp), detail=detail, exact=exact)
            key = f"shards={shards}" + (" detail" if detail else "") + ("" if exact else " fp32")
            rows[key] = {k: r[k] for k in ("root_bytes_per_round", "root_bytes_in_per_round",
                                           "root_bytes_out_per_round")}
            rows[key].update(round_s=statistics.median(r["round_seconds"]), raw=r)
            print(f"{key}: {r['root_bytes_per_round']:.0f} B/round through the root broker",
                  file=sys.stderr, flush=True)
    sz = sizes()
    doc = {"benchmark": "scaleout", "command": " ".join(["python -m benchmarks.scaleout", *(argv or sys.argv[1:])]),
           "n": args.n, "shard_n": args.shard_n,
           "merge_n": args.merge_n, "rounds": args.rounds, "message_bytes": sz, "samples": SAMPLES,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                       "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"\nwrote {args.out}")
    return 0


def table(doc: dict[str, Any]) -> str:
    r, n = doc["rows"], doc["n"]
    up = doc["message_bytes"]["update"]
    lines = []
    if "workers=0" in r:
        w0, w2 = r["workers=0"], r["workers=2"]
        lines += [
            f"N = {n}: | s/round | root CPU s/round | root CPU ms/update | workers' CPU ms/update",
            f"1 coordinator | {w0['round_s']:.3f} | {w0['root_cpu_s_per_round']:.3f} | "
            f"{w0['root_cpu_ms_per_update']:.3f} | -",
            f"+ 2 workers | {w2['round_s']:.3f} | {w2['root_cpu_s_per_round']:.3f} | "
            f"{w2['root_cpu_ms_per_update']:.3f} | {w2['worker_cpu_ms_per_update']:.3f}",
            f"ratio (2 workers / 1) | {w2['round_s'] / w0['round_s']:.2f} | "
            f"{w2['root_cpu_s_per_round'] / w0['root_cpu_s_per_round']:.2f} | |", ""]
    if "shards=0" in r:
        flat = r["shards=0"]["root_bytes_per_round"]
        lines.append(f"N = {doc['shard_n']}: | bytes through the root broker per round (in + out) | in updates of "
                     f"{up} B | into the root broker | in updates | ratio to flat")
        for key, label in (("shards=0", "flat"), ("shards=2 detail", "2 shards + relays, per-device entries"),
                           ("shards=2", "2 shards + relays, compact partials"),
                           ("shards=2 fp32", "2 shards + relays, compact partials, --fp32-sums")):
            if key in r:
                b, i = r[key]["root_bytes_per_round"], r[key].get("root_bytes_in_per_round", 0.0)
                lines.append(f"{label} | {b:.0f} | {b / up:.1f} | {i:.0f} | {i / up:.1f} | {b / flat:.3f}")
    for key in sorted(k for k in r if k.startswith("merge")):
        m = r[key]
        lines += ["", f"root, N = {m['n']} in {m['partials']} compact partials of {m['devices_per_partial']} | "
                  f"register ms/device {m['root_register_ms_per_device']:.3f} | merge ms/partial "
                  f"{m['root_merge_ms_per_partial']:.1f} ({m['root_merge_us_per_device']:.2f} us/device) | "
                  f"finish ms {m['root_finish_ms']:.2f} | partial B {m['partial_bytes']:.0f} | aggregator ms/update "
                  f"{m['aggregator_ms_per_update']:.3f} | report JSON B {m['report_json_bytes']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
