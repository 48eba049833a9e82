"""Scale-out: the root coordinator's CPU per update with 0 and 2 aggregation workers, the bytes through the root
broker for a flat fleet and for 2 shards with relays, and N devices over S shards with relay processes.

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
* **relays** (``--only relays``, issue 29's target): N devices of a fleet config in S swarm processes, on one
  broker with the root coordinator reading every update, then over S shard brokers with one real ``fedge
  relay`` process each; in each topology the floor first (bare paho carrying the same bytes through the same
  brokers: ``fleet_scale``'s collector, and a bare-paho relay per shard). Reported: round wall time against
  the floor, the root coordinator's CPU per round and peak RSS, the relays' CPU and RSS.

The machine has 2 cores shared with other work: every process here (devices, brokers, coordinator,
workers, relays) competes for them, so this measures *where the CPU goes*, not the throughput of 2
machines.

    .venv/bin/python -m benchmarks.scaleout --n 1000 --rounds 3
    .venv/bin/python -m benchmarks.scaleout --only relays --n 20000 --shards 4 --rounds 3
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from benchmarks import fleet_scale
from benchmarks.common import RESULTS, child_command
from benchmarks.fleet_scale import MODULE as FLEET_SCALE
from benchmarks.fleet_scale import SAMPLES, Swarm, _cpu, _update_bytes, sizes
from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo
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


def fedge_device(fleet: str, ids: list[str], infos: list[DeviceInfo], rounds: int, *, seed: int = 0
                 ) -> tuple[Callable[[int, paho.Client], None], Callable[[int, paho.Client, paho.MQTTMessage], None]]:
    """(``on_connect``, ``on_message``) of ``Swarm`` devices ``ids`` speaking fedge's protocol: status online and
    a retained hello (``infos``) on connecting; one FedProto-sized update per round descriptor (encoded here, before
    any clock starts; ``seed``: the first device's seed, so a device's updates do not depend on how the fleet is
    split over processes)."""
    t = FleetTopics(fleet)
    updates = [{r: split(_update_bytes(fleet, dev, r, r > rounds, seed=(seed + i) * 100 + r), DEFAULT_CHUNK_BYTES)
                for r in range(1, rounds + 2)} for i, dev in enumerate(ids)]
    hellos = [Message("hello", dev, 0, fleet, info={"device": info.to_dict()}).to_bytes()
              for dev, info in zip(ids, infos, strict=True)]
    answered: dict[int, str] = {}

    def on_connect(i: int, c: paho.Client) -> None:
        c.publish(t.status(ids[i]), STATUS_ONLINE, qos=1, retain=True)
        c.publish(t.hello(ids[i]), hellos[i], qos=1, retain=True)

    def on_message(i: int, c: paho.Client, msg: paho.MQTTMessage) -> None:
        if msg.topic != t.round or not msg.payload:
            return
        meta = read_header(bytes(msg.payload))[1]
        if answered.get(i) == meta["msg_id"]:
            return
        answered[i] = meta["msg_id"]
        for frame in updates[i].get(int(meta["round"]), []):
            c.publish(t.update(ids[i]), frame, qos=1)

    return on_connect, on_message


def _devices(ports: list[int], fleet: str, n: int, rounds: int) -> list[Swarm]:
    """N protocol devices spread over the brokers on ``ports`` (contiguous blocks), answering every round."""
    from benchmarks.fleet_scale import _device_info

    t = FleetTopics(fleet)
    ids = [f"dev-{i:04d}" for i in range(n)]
    swarms = []
    per = -(-n // len(ports))
    for k, port in enumerate(ports):
        block = ids[k * per:(k + 1) * per]
        on_connect, on_message = fedge_device(fleet, block, [_device_info(d) for d in block], rounds, seed=k * per)
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
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.connection import BrokerSettings
    from fedge.scaleout.aggregator import PartialAggregator
    from fedge.scaleout.worker import AggregationWorker

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
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.scaleout.aggregator import PartialAggregator
    from fedge.scaleout.relay import Relay

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
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.gate import UpdateGate
    from fedge.coordinator.merge import PartialMerger, merged_into
    from fedge.coordinator.report import RoundReport
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.scaleout.aggregator import PartialAggregator

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


# -- relays: N devices over S shard brokers with one `fedge relay` process each, against one broker -----------

FLEET_TOML = """\
[run]
method = "fedproto"
rounds = {rounds}
dataset = "digits"
fleet = "{fleet}"
seed = 1

[data]  # the devices' own data: their slots fix id, profile and embedding size (FedProto's 10 x 64 prototypes)
classes = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]

[[devices]]
profile = "rpi4-2gb"
arch = "tier-xs"
count = {n}
"""


def _fd_budget() -> int:
    """Device connections one Mosquitto can hold here: its file descriptors are bounded by the hard
    RLIMIT_NOFILE it inherits (not raisable without CAP_SYS_RESOURCE), less a margin for its listener, its log,
    the coordinator, the floor's collector and the meters."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 64


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_hwm_mb(pid: int) -> float:
    """Peak resident set of process ``pid`` so far (``VmHWM`` in ``/proc/PID/status``), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _partial_bytes(fleet: str, ids: list[str], infos: list[DeviceInfo]) -> int:
    """The size of the compact partial a relay sends for devices ``ids`` (all of them answered: one run of ids and
    one summary, whatever their number; measured on the first 200), for the floor's relays to carry."""
    from benchmarks.fleet_scale import CLASSES
    from fedge.common.transport import Inbound
    from fedge.coordinator.engine import EngineConfig
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.scaleout.aggregator import PartialAggregator

    ids, infos = ids[:200], infos[:200]
    agg = PartialAggregator(FedProtoStrategy(num_classes=CLASSES, rounds=3), EngineConfig(fleet=fleet,
                            method="fedproto"), "relay-1")
    agg.register([Inbound(Message("hello", d, 0, fleet, info={"device": i.to_dict()}).to_bytes(), d)
                  for d, i in zip(ids, infos, strict=True)])
    agg.begin(1, final=False, descriptor="x" * 32)
    for k, d in enumerate(ids):
        agg.admit(Inbound(_update_bytes(fleet, d, 1, False, k), d))
    data = agg.flush()
    assert data is not None
    return len(data)


def _fleet_devices(cfg: Any) -> tuple[list[str], list[DeviceInfo]]:
    """The fleet config's device ids and the hellos they announce: their slots (a device on its own data is
    checked on its id, profile and embedding size) with the sample count their updates' class counts sum to."""
    import dataclasses

    from fedge.fleet.slots import checked_slots

    slots = checked_slots(cfg)
    return [s.device_id for s in slots], [dataclasses.replace(s.info(), num_samples=SAMPLES) for s in slots]


def swarm_main(args: argparse.Namespace) -> None:
    """One swarm process: devices ``--first`` .. ``--first + --count - 1`` of the fleet config on one broker, each
    speaking both fedge's protocol (hello, status, an update per descriptor) and the floor's (an update-sized
    answer per "go"), until SIGTERM; then their offline statuses, and this process's CPU into ``--out``."""
    from benchmarks.fleet_scale import floor_device, floor_topics
    from fedge.fleet.config import load_fleet

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one descriptor per device connection
    cfg = load_fleet(args.config)
    fleet, t = cfg.run.fleet, FleetTopics(cfg.run.fleet)
    ids, infos = _fleet_devices(cfg)
    ids, infos = ids[args.first:args.first + args.count], infos[args.first:args.first + args.count]
    on_connect, fedge_message = fedge_device(fleet, ids, infos, cfg.run.rounds, seed=args.first)
    floor_message = floor_device(args.base, ids, sizes()["update"])

    def on_message(i: int, c: paho.Client, msg: paho.MQTTMessage) -> None:
        (floor_message if msg.topic.startswith(args.base) else fedge_message)(i, c, msg)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    cpu0 = _cpu()
    swarm = Swarm(args.port, ids, on_message, will=lambda d: (t.status(d), STATUS_OFFLINE), on_connect=on_connect,
                  subscribe=[t.round, t.global_filter(PROTOTYPES_ARTIFACT), *floor_topics(args.base)])
    swarm.wait_connected(600)
    Path(args.ready).write_text(f"{len(ids)} connected in {_cpu() - cpu0:.1f} CPU s\n")
    stop.wait()
    cpu = _cpu() - cpu0
    swarm.close(final=lambda d: (t.status(d), STATUS_OFFLINE))
    Path(args.out).write_text(json.dumps({"cpu_s": cpu, "peak_rss_mb":
                                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def floor_relay_main(args: argparse.Namespace) -> None:
    """The floor's relay: bare paho on the root broker and on one shard. The collector's "go" and "global" go down
    (retained, QoS 1, as a relay forwards the descriptor and the global state); once all ``--n`` devices of the
    shard answered a round, one partial-sized message goes up to the collector (QoS 1)."""
    from benchmarks.fleet_scale import _new_client, floor_topics

    payload = os.urandom(args.partial_bytes)
    got = 0
    lock = threading.Lock()
    root, shard = _new_client(f"floor-{args.name}-root"), _new_client(f"floor-{args.name}-shard")

    def on_root_connect(c: paho.Client, *a: Any) -> None:
        for topic in floor_topics(args.base):
            c.subscribe(topic, 1)

    def on_shard_connect(c: paho.Client, *a: Any) -> None:
        c.subscribe(f"{args.base}/devices/+/up", 1)

    def down(c: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        shard.publish(msg.topic, msg.payload, qos=1, retain=True)

    def on_up(c: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        nonlocal got
        with lock:
            got += 1
            if got % args.n == 0:  # the collector waits for every partial before the next round
                root.publish(f"{args.base}/devices/{args.name}/up", payload, qos=1)

    root.on_connect, root.on_message = on_root_connect, down
    shard.on_connect, shard.on_message = on_shard_connect, on_up
    for c, port in ((root, args.root_port), (shard, args.shard_port)):
        c.connect(LOOPBACK, port, keepalive=120)
        c.loop_start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    stop.wait()
    for c in (root, shard):
        c.loop_stop()
        c.disconnect()


def run_relays(n: int, shards: int, rounds: int, work: Path, *, prior: dict[str, Any] | None = None,
               save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The same N devices (``shards`` swarm processes of contiguous devices) on one broker with the root
    coordinator reading every update (``single``), then over ``shards`` shard brokers with one ``fedge relay``
    process each under a root broker (``sharded``); in each topology the floor first (bare paho carrying the same
    bytes through the same brokers: ``benchmarks.fleet_scale``'s collector on the root, and in the sharded run a
    bare-paho relay per shard forwarding "go" and "global" down and one partial-sized message up), then fedge.
    ``prior``: results of a run with the same settings to keep (a topology already measured is not rerun);
    ``save`` is called after each topology."""
    from fedge.fleet.config import load_fleet

    fleet = f"relays{n}"
    path = work / "fleet.toml"
    path.write_text(FLEET_TOML.format(rounds=rounds, fleet=fleet, n=n))
    ids, infos = _fleet_devices(load_fleet(path))
    sz = sizes()
    per = -(-n // shards)
    out: dict[str, Any] = dict(prior or {})
    out.setdefault("partial_bytes", _partial_bytes(fleet, ids[:per], infos[:per]))
    single_n = min(n, _fd_budget())
    for topology in ("single", "sharded"):
        if topology in out:
            print(f"relays: {topology} kept from the earlier run", file=sys.stderr, flush=True)
            continue
        m = single_n if topology == "single" else n
        out[topology] = _run_topology(topology, path, fleet, m, shards, rounds, work, sz, out["partial_bytes"])
        if save is not None:
            save(out)
    return out


def _wait_files(files: list[Path], procs: list[subprocess.Popen[bytes]], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not all(f.exists() for f in files):
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > end:
            raise RuntimeError(f"{what}: {sum(f.exists() for f in files)}/{len(files)} ready; exited: {dead}")
        time.sleep(0.2)


def _run_topology(topology: str, path: Path, fleet: str, n: int, shards: int, rounds: int, work: Path,
                  sz: dict[str, int], partial_bytes: int) -> dict[str, Any]:
    """One topology's floor and fedge runs (see :func:`run_relays`)."""
    sharded = topology == "sharded"
    work = work / topology
    work.mkdir(parents=True, exist_ok=True)
    base = f"floor/{fleet}"
    root = _broker()
    leaves = [_broker() for _ in range(shards)] if sharded else []
    per = -(-n // shards)
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[subprocess.Popen[bytes]] = []
    swarms: list[subprocess.Popen[bytes]] = []
    me = [sys.executable, "-m", MODULE]
    res: dict[str, Any] = {"n": n, "shards": shards if sharded else 1}
    logs = work / "logs"
    logs.mkdir(exist_ok=True)

    def spawn(cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        for k, leaf in enumerate(leaves):
            name = f"relay-{k + 1}"
            # as a user runs one: `fedge relay` with the fleet config, its name, its parent's and its shard's broker
            relays.append(spawn([sys.executable, "-m", "fedge", "relay", "--config", str(path), "--name", name,
                                 "--broker", root.url, "--shard", leaf.url, "--state-dir", str(work / name)], name))
            spawn([*me, "_floor_relay", "--root-port", str(root.port), "--shard-port", str(leaf.port), "--base", base,
                   "--name", name, "--n", str(len(range(k * per, min(n, (k + 1) * per)))),
                   "--partial-bytes", str(partial_bytes)], f"floor-{name}")
        t0 = time.perf_counter()
        for k in range(shards):
            port = leaves[k].port if sharded else root.port
            first, count = k * per, max(0, min(n, (k + 1) * per) - k * per)
            swarms.append(spawn([*me, "_swarm", "--config", str(path), "--port", str(port), "--first", str(first),
                                 "--count", str(count), "--base", base, "--ready", str(work / f"swarm-{k}.ready"),
                                 "--out", str(work / f"swarm-{k}.json")], f"swarm-{k}"))
        _wait_files([work / f"swarm-{k}.ready" for k in range(shards)], procs, 1800, f"{topology}: swarms")
        res["connect_s"] = time.perf_counter() - t0
        print(f"relays {topology}: {n} devices connected in {res['connect_s']:.0f} s", file=sys.stderr, flush=True)
        load0 = os.getloadavg()
        floor_out = work / "floor.json"
        subprocess.run([sys.executable, "-m", FLEET_SCALE, "_floor", "--port", str(root.port), "--n",
                        str(shards if sharded else n), "--rounds", str(rounds), "--base", base, "--global-bytes",
                        str(sz["global"]), "--descriptor-bytes", str(sz["descriptor"]), "--out", str(floor_out)],
                       check=True, timeout=3600)
        res["floor"] = json.loads(floor_out.read_text())
        print(f"relays {topology}: floor {statistics.median(res['floor']['round_seconds']):.2f} s/round",
              file=sys.stderr, flush=True)
        ready, coord_out = work / "ready", work / "coordinator.json"
        t1 = time.perf_counter()
        coord = spawn([sys.executable, "-m", FLEET_SCALE, "_coordinator", "--port", str(root.port), "--n", str(n),
                       "--rounds", str(rounds), "--fleet", fleet, "--state-dir", str(work / "state"), "--out",
                       str(coord_out), "--ready-file", str(ready)], "coordinator")
        _wait_files([ready], [coord, *relays], 1800, f"{topology}: registration")
        res["register_s"] = time.perf_counter() - t1
        relay_cpu0 = [_proc_cpu(r.pid) for r in relays]
        res["relay_cpu_before_rounds_s"] = relay_cpu0  # from their start: forwarding and registering the hellos
        # where the CPU goes over time (every 0.5 s from the go): [seconds, root coordinator CPU, each relay's]
        timeline: list[list[float]] = []
        res["cpu_timeline"] = timeline
        sampling = threading.Event()

        def sample(t0: float = time.perf_counter()) -> None:
            while not sampling.wait(0.5):
                try:
                    timeline.append([time.perf_counter() - t0, _proc_cpu(coord.pid),
                                     *(_proc_cpu(r.pid) for r in relays)])
                except OSError:  # the coordinator exited
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        Path(str(ready) + ".go").touch()
        sampler.start()
        if coord.wait(3600) != 0:
            raise RuntimeError(f"the root coordinator of {topology} failed ({coord.returncode}): see {logs}")
        sampling.set()
        sampler.join(5)
        res["relay_cpu_s"] = [_proc_cpu(r.pid) - c for r, c in zip(relays, relay_cpu0, strict=True)]
        res["relay_peak_rss_mb"] = [_proc_hwm_mb(r.pid) for r in relays]
        res["coordinator"] = json.loads(coord_out.read_text())
        res["load_average"] = [load0, os.getloadavg()]
        print(f"relays {topology}: fedge {statistics.median(res['coordinator']['round_seconds']):.2f} s/round, "
              f"root CPU {statistics.median(res['coordinator']['cpu_seconds_per_round']):.2f} s/round",
              file=sys.stderr, flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
        for b in (root, *leaves):
            b.close()
    res["swarm"] = [json.loads((work / f"swarm-{k}.json").read_text()) for k in range(shards)
                    if (work / f"swarm-{k}.json").exists()]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role")
    child_command(sub, "_worker", ("--port", "--rounds"), ("--fleet", "--name", "--out"))
    child_command(sub, "_swarm", ("--port", "--first", "--count"), ("--config", "--base", "--ready", "--out"))
    child_command(sub, "_floor_relay", ("--root-port", "--shard-port", "--n", "--partial-bytes"), ("--base", "--name"))
    p.add_argument("--n", type=int, default=1000, help="devices of the workers' and the relays' parts (default 1000)")
    p.add_argument("--shards", type=int, default=4, help="shard brokers of the relays part (default 4)")
    p.add_argument("--resume", action="store_true",
                   help="relays part: keep the topologies --out already holds for the same --n, --shards, --rounds")
    p.add_argument("--shard-n", type=int, default=200, help="devices of the bytes comparison (default 200)")
    p.add_argument("--dim", type=int, default=fleet_scale.DIM,
                   help=f"prototype size p of every update: C x p float32 (default {fleet_scale.DIM}: 2,992-byte "
                        "updates); larger updates show the fixed bytes per message shrink against the payload")
    p.add_argument("--rounds", type=int, default=3, help="training rounds per run (default 3)")
    p.add_argument("--only", choices=("workers", "shards", "merge", "relays"),
                   help="run one part: the workers' or the shards' comparison, the root's merge costs, or the relays' "
                        "(N devices on one broker against S shards with a `fedge relay` process each, and the floor; "
                        "only with --only relays)")
    p.add_argument("--merge-n", type=int, default=20000, help="devices of the merge measurement (default 20000)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    child = {"_worker": worker_main, "_swarm": swarm_main, "_floor_relay": floor_relay_main}.get(args.role or "")
    if child is not None:  # one of the processes a part starts
        child(args)
        return 0
    if args.dim != fleet_scale.DIM:  # this process's devices and every child's (coordinator, swarms) alike
        os.environ["FEDGE_BENCH_DIM"] = str(args.dim)
        fleet_scale.DIM = args.dim
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # every child inherits it: a Mosquitto holds one descriptor per connection (as many as the hard limit allows)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if args.only == "relays" else min(hard, max(soft, 8192)), hard))
    if args.only == "relays":
        return relays_main(args, argv)
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
           "n": args.n, "shard_n": args.shard_n, "dim": fleet_scale.DIM,
           "merge_n": args.merge_n, "rounds": args.rounds, "message_bytes": sz, "samples": SAMPLES,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                       "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"\nwrote {args.out}")
    return 0


def relays_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--only relays``: run (or resume) the relays part, write ``--out`` after each topology, print the table."""
    out = Path(args.out if args.out != str(OUT) else RESULTS / "scaleout_relays.json")
    settings = {"n": args.n, "shards": args.shards, "rounds": args.rounds}
    prior = None
    if args.resume and out.exists():
        old = json.loads(out.read_text())
        if {k: old.get(k) for k in settings} == settings:
            prior = old["relays"]
    doc: dict[str, Any] = {
        "benchmark": "scaleout relays", "command": " ".join(["python -m benchmarks.scaleout", *(argv or sys.argv[1:])]),
        **settings, "message_bytes": sizes(), "samples": SAMPLES,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "nofile_hard": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
                    "load_average_at_start": os.getloadavg()}}

    def save(relays: dict[str, Any]) -> None:
        doc["relays"] = relays
        doc["machine"]["load_average_at_end"] = os.getloadavg()
        if "single" in relays and "sharded" in relays:
            doc["summary"] = relays_summary(relays)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))

    with tempfile.TemporaryDirectory(prefix="fedge-relays-") as tmp:
        save(run_relays(args.n, args.shards, args.rounds, Path(tmp), prior=prior, save=save))
    print(relays_table(doc))
    print(f"\nwrote {out}")
    return 0


def relays_summary(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's three ratios from the two topologies' runs (medians over the training rounds)."""
    med = statistics.median
    rows = {}
    for key in ("single", "sharded"):
        t = r[key]
        c = t["coordinator"]
        rounds = len(c["round_seconds"])
        rows[key] = {
            "n": t["n"], "shards": t["shards"], "round_s": med(c["round_seconds"]),
            "floor_round_s": med(t["floor"]["round_seconds"]),
            "root_cpu_s_per_round": med(c["cpu_seconds_per_round"]),
            "root_cpu_ms_per_update": 1000 * med(c["cpu_seconds_per_round"]) / t["n"],
            "root_peak_rss_mb": c["peak_rss_mb"],
            # the relays' CPU from registration done to the coordinator's exit: training rounds + the final one
            "relays_cpu_s_per_round": sum(t["relay_cpu_s"]) / (rounds + 1) if t["relay_cpu_s"] else None,
            "relays_peak_rss_mb": max(t["relay_peak_rss_mb"]) if t["relay_peak_rss_mb"] else None,
            "register_s": t["register_s"], "connect_s": t["connect_s"], "load_average": t["load_average"]}
        rows[key]["round_over_floor"] = rows[key]["round_s"] / rows[key]["floor_round_s"]
    one, many = rows["single"], rows["sharded"]
    # per update when one broker could not hold all N devices (see _fd_budget): the root's CPU grows with N
    scale = many["n"] / one["n"]
    return {"rows": rows, "round_over_floor": many["round_over_floor"],
            "root_cpu_sharded_over_single": many["root_cpu_s_per_round"] / (one["root_cpu_s_per_round"] * scale),
            "single_cpu_scaled_by": scale, "root_peak_rss_mb": many["root_peak_rss_mb"],
            "targets": {"round_over_floor": 2.0, "root_cpu_sharded_over_single": 0.25, "root_peak_rss_mb": 150}}


def relays_table(doc: dict[str, Any]) -> str:
    s = doc.get("summary")
    if s is None:
        return "relays: incomplete (rerun with --resume)"
    head = ["run", "N", "brokers", "s/round", "floor s/round", "ratio", "root CPU s/round", "root ms/update",
            "root peak RSS MB", "relays' CPU s/round", "registration s"]
    lines = [head]
    for key in ("single", "sharded"):
        r = s["rows"][key]
        lines.append([key, str(r["n"]), str(r["shards"] + (1 if key == "sharded" else 0)), f"{r['round_s']:.2f}",
                      f"{r['floor_round_s']:.2f}", f"{r['round_over_floor']:.2f}", f"{r['root_cpu_s_per_round']:.3f}",
                      f"{r['root_cpu_ms_per_update']:.4f}", f"{r['root_peak_rss_mb']:.0f}",
                      "-" if r["relays_cpu_s_per_round"] is None else f"{r['relays_cpu_s_per_round']:.2f}",
                      f"{r['register_s']:.0f}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines)
    return (f"{text}\n\nsharded round / its floor: {s['round_over_floor']:.2f} (target <= 2); root CPU sharded / "
            f"single: {s['root_cpu_sharded_over_single']:.3f} (target <= 0.25"
            + (f"; single scaled x{s['single_cpu_scaled_by']:.4f} to the same N" if s["single_cpu_scaled_by"] != 1
               else "") + f"); root peak RSS {s['root_peak_rss_mb']:.0f} MB (target <= 150)")


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
