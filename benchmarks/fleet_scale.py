"""Fleet scale over MQTT: N = 10, 100, 1000 devices through Mosquitto on loopback, against the transport floor.

For each N, in the same run and through the same broker:

* **fedge** — the real coordinator (``RoundEngine`` + ``FedProtoStrategy`` +
  ``MqttCoordinatorTransport``, checkpointing every round) in its own process;
  N lightweight devices that speak the wire protocol (status + last-will,
  retained hello, round descriptor, retained global prototypes, one update per
  round: 10 x 64 float32 prototypes + 10 class counts, fp32). Statistics-only
  rounds: no training, the devices' update bytes are encoded before the clock
  starts, so what is measured is the transport plus the coordinator.
* **floor** — the same number and sizes of messages with bare paho clients: a
  collector process publishes a "go" of the descriptor's size; each device
  answers with a payload of its update's size; once the collector has all N
  answers it publishes a retained "global" of the global's size — the order and
  the acknowledgements a fedge round waits for.

Both sides drive their N device connections from one selector thread (paho's
external-loop API), so the device side costs the same in both. Reported per
N: median round wall time over the training rounds, coordinator CPU seconds
(user + sys over those rounds) and peak RSS, the RSS growth during the rounds,
and updates received per second; and the aggregate state, what FedProto's
coordinator half holds once it has accumulated N such updates, measured beside
the run through the strategy interface (tracing allocations would slow the
rounds). Writes ``benchmarks/results/fleet_scale.json``.

The device side is made of fedge's protocol code: the topics and status words
(``fedge.mqtt.topics``), the hello and update messages (``fedge.common.messages``,
``DeviceInfo``), the update's framing (``fedge.mqtt.chunking.split``: one frame at
this size) and the descriptor's header (``fedge.common.tensorcodec.read_header``).
Two parts are its own, for speed: the connections are not fedge's ``MqttClient``
(``MqttDeviceTransport``), which gives each connection a paho network thread and
a dispatcher thread, so N = 1000 would be 2000 threads on the 2 cores the
coordinator is measured on, and the floor could not share the device side; and a
descriptor is read with the codec's header reader (about 40 µs here) rather than
``Message.from_bytes``, whose envelope checks cost about 100 µs: some 55 ms more
per round at N = 1000 on a device side the floor does not pay for.

``run_fedge(..., buffer=K)`` runs the coordinator in asynchronous mode (``[coordinator] mode = "async"``,
``buffer_size = K``, every device training at once): the devices then answer each task a descriptor's
``round.assigned`` gives them, once, with the descriptor's version as their update's round (docs/protocol.md,
section 6), and ``rounds`` counts versions. ``benchmarks.async_cost`` compares the two modes' coordinator CPU
per update with it.

    .venv/bin/python -m benchmarks.fleet_scale                # N = 10, 100, 1000
    .venv/bin/python -m benchmarks.fleet_scale --sizes 10,100 --rounds 3 --repeat 1
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.metadata
import json
import os
import platform
import resource
import selectors
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho

from benchmarks.common import RESULTS
from fedge.common.inmemory import descriptor_tasks
from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo
from fedge.common.tensorcodec import read_header
from fedge.mqtt.broker import LOOPBACK, MosquittoProcess, loopback_config
from fedge.mqtt.chunking import DEFAULT_CHUNK_BYTES, split
from fedge.mqtt.client import new_paho_client, no_delay
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics

# FedProto-sized: prototypes (C, p) + counts (C,). FEDGE_BENCH_DIM sets p (benchmarks.scaleout --dim: larger
# updates for the bytes comparison); child processes inherit it.
CLASSES, DIM = 10, int(os.environ.get("FEDGE_BENCH_DIM", "64"))
SAMPLES = 100  # each device's training samples (its hello)
OUT = RESULTS / "fleet_scale.json"
MODULE = "benchmarks.fleet_scale"  # the coordinator and the floor's collector run as its child processes
# Set by a driver (benchmarks.async_cost --profile DIR): each coordinator writes a cProfile of its rounds there.
PROFILE_DIR: Path | None = None


def _new_client(client_id: str) -> paho.Client:
    c = new_paho_client(client_id, clean_session=True)  # a bare paho client, 1.6 or 2.x
    # TCP_NODELAY like fedge's own client: the floor must not pay Nagle delays fedge avoids.
    c.on_socket_open = no_delay
    return c


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- the device side: N paho connections on one selector thread --------------------------------------

class Swarm:
    """N MQTT connections driven by one thread through paho's external-loop API."""

    def __init__(self, port: int, ids: list[str], on_message: Callable[[int, paho.Client, paho.MQTTMessage], None],
                 *, subscribe: list[str], will: Callable[[str], tuple[str, bytes]] | None = None,
                 on_connect: Callable[[int, paho.Client], None] | None = None) -> None:
        self.ids = ids
        self.clients: list[paho.Client] = []
        self.connected = 0
        self._dirty: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.sel = selectors.DefaultSelector()
        for i, dev in enumerate(ids):
            c = _new_client(f"swarm-{dev}")
            if will is not None:
                topic, payload = will(dev)
                c.will_set(topic, payload, qos=1, retain=True)
            c.max_inflight_messages_set(100)

            def _conn(client: paho.Client, userdata: Any, flags: Any, rc: Any, *a: Any, i: int = i) -> None:
                for t in subscribe:
                    client.subscribe(t, 1)
                if on_connect is not None:
                    on_connect(i, client)
                self.connected += 1
                self._dirty.add(i)

            def _msg(client: paho.Client, userdata: Any, msg: paho.MQTTMessage, i: int = i) -> None:
                on_message(i, client, msg)
                self._dirty.add(i)

            c.on_connect = _conn
            c.on_message = _msg
            c.connect(LOOPBACK, port, keepalive=120)
            sock = c.socket()
            assert sock is not None
            self.sel.register(sock, selectors.EVENT_READ, i)
            self.clients.append(c)
            self._flush(i)
        self._thread = threading.Thread(target=self._loop, name="swarm", daemon=True)
        self._thread.start()

    def _flush(self, i: int) -> None:
        c = self.clients[i]
        while c.want_write():
            if c.loop_write() != paho.MQTT_ERR_SUCCESS:
                break

    def _loop(self) -> None:
        last_misc = time.monotonic()
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                self.clients[key.data].loop_read(100)
            dirty, self._dirty = self._dirty, set()
            for i in dirty:
                self._flush(i)
            if time.monotonic() - last_misc > 1.0:
                last_misc = time.monotonic()
                for i, c in enumerate(self.clients):
                    c.loop_misc()
                    self._flush(i)

    def wait_connected(self, timeout_s: float = 120) -> None:
        end = time.monotonic() + timeout_s
        while self.connected < len(self.clients):
            if time.monotonic() > end:
                raise TimeoutError(f"{self.connected}/{len(self.clients)} swarm clients connected")
            time.sleep(0.05)

    def close(self, final: Callable[[str], tuple[str, bytes]] | None = None) -> None:
        if final is not None:
            for i, dev in enumerate(self.ids):
                topic, payload = final(dev)
                self.clients[i].publish(topic, payload, qos=0, retain=True)
                self._dirty.add(i)
            time.sleep(0.5)
        self._stop.set()
        self._thread.join(5)
        for i, c in enumerate(self.clients):
            with contextlib.suppress(OSError, ValueError):
                c.disconnect()
                self._flush(i)
                sock = c.socket()
                if sock is not None:
                    sock.close()


def _device_info(dev: str) -> DeviceInfo:
    return DeviceInfo(dev, "tier-xs", "bench", num_samples=SAMPLES, feature_dim=DIM)


def _update_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One FedProto update: prototypes and the class counts of the device's samples (the coordinator
    refuses counts beyond its hello's samples)."""
    counts = rng.multinomial(SAMPLES, np.full(CLASSES, 1 / CLASSES)).astype(np.int64)
    protos = rng.normal(size=(CLASSES, DIM)).astype(np.float32)
    return {"protos": protos, "counts": counts}


def _update_bytes(fleet: str, dev: str, rnd: int, final: bool, seed: int) -> bytes:
    if final:
        return Message("update", dev, rnd, fleet, info={"metrics": {"acc_global": 0.5},
                                                        "num_samples": SAMPLES}).to_bytes()
    return Message("update", dev, rnd, fleet, tensors=_update_arrays(np.random.default_rng(seed)),
                   info={"metrics": {}, "num_samples": SAMPLES}).to_bytes()


def sizes() -> dict[str, int]:
    """Encoded sizes of one update, the global prototypes and a round descriptor (for the floor)."""
    up = _update_bytes("bench", "dev-0000", 1, False, 0)
    glob = Message("global", "coordinator", 1, "bench", tensors={
        "protos": np.zeros((CLASSES, DIM), np.float32), "counts": np.zeros(CLASSES, np.int64)},
        info={"artifact": PROTOTYPES_ARTIFACT}).to_bytes()
    desc = Message("round", "coordinator", 1, "bench", info={
        "round": {"round": 1, "phase": "train", "method": "fedproto", "deadline": 0.0, "config": {}},
        "run": "0" * 32, "globals": {PROTOTYPES_ARTIFACT: 1}}).to_bytes()
    return {"update": len(up), "global": len(glob), "descriptor": len(desc)}


# -- fedge: real coordinator process + protocol devices --------------------------------------------

def run_fedge(port: int, n: int, rounds: int, workdir: Path, aggregation: str = "mean",
              clip: float = 0.0, observe: Path | None = None, buffer: int = 0,
              max_staleness: int = 10, state: bool = True) -> dict[str, Any]:
    """One fedge run; ``observe``: the coordinator also serves its dashboard and /metrics (FleetMonitor,
    FleetMetrics, the web server on a free loopback port, whose URL it writes to that file).

    ``buffer`` > 0: the coordinator runs ``[coordinator] mode = "async"`` with ``buffer_size = buffer`` (every
    device training at once, ``max_staleness``, polynomial weights), ``rounds`` counts versions, and a device
    answers each task a descriptor's ``round.assigned`` gives it, once, with the descriptor's version as its
    update's round (docs/protocol.md, section 6). The final round carries no ``assigned``: every device
    answers it as in synchronous mode.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = f"scale{n}-{workdir.name}" + (f"-k{buffer}" if buffer else "") + ("" if state else "-ns")
    t = FleetTopics(fleet)
    ids = [f"dev-{i:04d}" for i in range(n)]
    # Every update a device will send, encoded and framed (as MqttDeviceTransport.send_update frames it)
    # before the clock starts: one per round, or in async mode one per version it may train from.
    updates = [{r: split(_update_bytes(fleet, dev, r, r > rounds, seed=i * 100 + r), DEFAULT_CHUNK_BYTES)
                for r in range(1, rounds + 2)} for i, dev in enumerate(ids)]
    answered: list[str | None] = [None] * n
    done_task: list[int | None] = [None] * n  # async mode: the last task answered
    parsed: list[Any] = [None, None]  # async mode: (msg id, round.assigned) of the latest descriptor

    def on_connect(i: int, c: paho.Client) -> None:
        # What MqttDeviceTransport does on connecting: status online (the will says offline), then the hello.
        dev = ids[i]
        c.publish(t.status(dev), STATUS_ONLINE, qos=1, retain=True)
        hello = Message("hello", dev, 0, fleet, info={"device": _device_info(dev).to_dict()})  # as the agent's
        c.publish(t.hello(dev), hello.to_bytes(), qos=1, retain=True)

    def on_message(i: int, c: paho.Client, msg: paho.MQTTMessage) -> None:
        if msg.topic != t.round or not msg.payload:
            return  # global prototypes: a statistics-only device just receives them; empty: the run is over
        meta = read_header(bytes(msg.payload))[1]  # the envelope, without Message's checks (module docstring)
        if answered[i] == meta["msg_id"]:
            return  # the same descriptor again (a retained redelivery)
        answered[i] = meta["msg_id"]
        rnd = int(meta["round"])
        # Async mode's descriptors are read for round.assigned; a synchronous fleet's carry none, and its devices
        # skip the JSON (the device side the floor's devices are compared with stays as cheap as it was). Every
        # device gets the same descriptor: its info (a task per device, 20 KB at N = 1000) is parsed once per
        # descriptor, not by each of the N devices in turn on this one thread — real devices parse in parallel,
        # and N serial parses (~0.15 ms each) would make the updates trickle in where a synchronous round's burst.
        tasks = None
        if buffer:
            if parsed[0] != meta["msg_id"]:
                parsed[:] = [meta["msg_id"], descriptor_tasks(json.loads(meta["info"]))]
            tasks = parsed[1]
        if tasks is not None:  # async mode: train once per task, from this descriptor's version
            task = tasks.get(ids[i])
            if task is None or task == done_task[i]:
                return
            done_task[i] = task
        for frame in updates[i].get(rnd, []):
            c.publish(t.update(ids[i]), frame, qos=1)

    swarm = Swarm(port, ids, on_message, subscribe=[t.round, t.global_filter(PROTOTYPES_ARTIFACT)],
                  will=lambda d: (t.status(d), STATUS_OFFLINE), on_connect=on_connect)
    try:
        swarm.wait_connected()
        out = workdir / f"fedge-{n}{f'-k{buffer}' if buffer else ''}.json"
        cmd = [sys.executable, "-m", MODULE, "_coordinator", "--port", str(port), "--n", str(n),
               "--rounds", str(rounds), "--fleet", fleet, "--state-dir", str(workdir / f"state-{fleet}"),
               "--out", str(out), "--aggregation", aggregation, "--clip", str(clip),
               "--buffer", str(buffer), "--max-staleness", str(max_staleness)]
        cmd += ["--observe", str(observe)] if observe else []
        cmd += [] if state else ["--no-state"]
        cmd += ["--profile", str(PROFILE_DIR / f"{fleet}.prof")] if PROFILE_DIR is not None else []
        subprocess.run(cmd, check=True, timeout=1800)
        return json.loads(out.read_text())
    finally:
        swarm.close(final=lambda d: (t.status(d), STATUS_OFFLINE))


def coordinator_main(args: argparse.Namespace) -> None:
    from fedge.common.asyncmode import AsyncSettings
    from fedge.coordinator.accumulators import Aggregation
    from fedge.coordinator.engine import EngineConfig, RoundEngine
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy
    from fedge.mqtt.connection import BrokerSettings
    from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport

    rss_start = _rss_kb()
    # --workers-mode: aggregation workers read the updates (benchmarks.scaleout); this process merges partials
    transport = MqttCoordinatorTransport(BrokerSettings(port=args.port), args.fleet,
                                         updates=not getattr(args, "workers_mode", False)).start()
    strat = FedProtoStrategy(num_classes=CLASSES, rounds=args.rounds)
    # keep_reports=1 as in a long-running coordinator (fedge coordinator run keeps 8): the history is on disk.
    agg = Aggregation(args.aggregation, clip=args.clip)
    buffer = getattr(args, "buffer", 0)
    asynchronous = AsyncSettings(buffer_size=buffer, max_staleness=args.max_staleness, fleet_size=args.n) \
        if buffer else None
    engine = RoundEngine(strat, transport, EngineConfig(fleet=args.fleet, method="fedproto", min_devices=args.n,
                                                       quorum_timeout_s=600, keep_reports=1, aggregation=agg,
                                                       asynchronous=asynchronous),
                         state_dir=None if getattr(args, "no_state", False) else args.state_dir)
    if args.observe:
        _serve(engine, transport, args)
    engine.await_quorum()  # registration is not part of a round
    engine.register_pending()
    if getattr(args, "ready_file", None):  # a driver reads its meters between registration and the rounds
        Path(args.ready_file).write_text("registered\n")
        go = Path(args.ready_file + ".go")
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    cpu0, rss0, t0 = _cpu(), _rss_kb(), time.perf_counter()
    main0 = time.thread_time()  # the engine's own thread (the rest: paho's network thread, the dispatcher)
    cpu_rounds: list[float] = []
    rss_rounds: list[float] = []
    ends: list[float] = []

    def on_round(rep: Any) -> None:
        # Wall time between consecutive round ends: announce, collect, aggregate, publish *and* the
        # checkpoint (RoundReport.seconds stops before the checkpoint is written).
        ends.append(time.perf_counter())
        cpu_rounds.append(_cpu())
        rss_rounds.append(_rss_kb() / 1024)

    accepted: list[int] = []
    rejected = 0

    stale: list[float] = []

    main_train: float | None = None

    def count(rep: Any) -> None:
        nonlocal rejected, main_train
        accepted.append(len(rep.accepted))
        if rep.phase != "final":
            main_train = time.thread_time()
        if rep.staleness:
            stale.extend(rep.staleness.values())
        rejected += sum(rep.rejected.values())
        on_round(rep)

    # the main thread's CPU time, not wall (fsync waits and idle polling would dominate a wall profile), nor the
    # process's (it would charge the MQTT network thread's work to whatever the main thread waits in)
    profile = cProfile.Profile(time.thread_time) if getattr(args, "profile", None) else None
    if profile is not None:
        profile.enable()
    engine.run(on_round=count)
    main_cpu = main_train - main0 if main_train is not None else 0.0
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    transport.close()
    # a synchronous round takes every device's update, an asynchronous version buffer_size; the final round all
    assert all(a == (buffer or args.n) for a in accepted[:-1]) and accepted[-1] == args.n, accepted
    train = accepted[:-1]  # the last round is the final (metrics-only) one
    wall = [b - a for a, b in zip([t0, *ends], ends, strict=False)]
    staleness = statistics.mean(stale) if stale else 0.0
    cpu_train = [b - a for a, b in zip([cpu0, *cpu_rounds], cpu_rounds, strict=False)][:len(train)]
    result = {
        "round_seconds": wall[:len(train)],
        "final_round_seconds": wall[-1],
        "cpu_seconds_per_round": cpu_train,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_at_start_mb": rss_start / 1024,
        "rss_before_rounds_mb": rss0 / 1024,
        "rss_after_rounds_mb": _rss_kb() / 1024,
        "rss_after_each_round_mb": rss_rounds,
        "torch_imported": "torch" in sys.modules,
        "rejected": rejected,
        "accepted_per_round": train,
        "cpu_seconds_per_update": [c / a for c, a in zip(cpu_train, train, strict=True)],
        "staleness_mean": staleness,
        "main_thread_cpu_seconds": main_cpu,  # over the training rounds, as cpu_seconds_per_round
        "cpu_seconds_before_rounds": cpu0,  # the process's CPU from its start: imports and registration
    }
    Path(args.out).write_text(json.dumps(result))


def _serve(engine: Any, transport: Any, args: argparse.Namespace) -> None:
    """What ``fedge coordinator run --http`` adds to the coordinator: the monitor, /metrics and the page."""
    from fedge.common.rounds import DeviceInfo
    from fedge.observe.dashboard import monitor_routes
    from fedge.observe.metrics import FleetMetrics
    from fedge.observe.monitor import FleetMonitor
    from fedge.observe.web import DashboardServer, Endpoint

    ids = [f"dev-{i:04d}" for i in range(args.n)]
    monitor = FleetMonitor(fleet=args.fleet, method="fedproto", total_rounds=args.rounds, transport=transport,
                           fleet_devices={d: DeviceInfo(d, "", "") for d in ids}, run_id=engine.run_id)
    metrics = FleetMetrics(monitor)
    engine.observers += [monitor, metrics.observer]
    monitor.start()
    server = DashboardServer(monitor_routes(monitor, metrics.render), Endpoint("127.0.0.1", 0)).start()
    Path(args.observe).write_text(server.url)


def aggregate_state_bytes(n: int, rule: str, clip: float) -> int:
    """What FedProto's coordinator half holds once it has accumulated ``n`` of this benchmark's updates
    under the aggregation ``rule``: the running sums of the mean (the same whatever ``n`` is), or every
    device's rows for a robust rule.

    Measured through the strategy interface alone (the engine's ``aggregation``, ``begin_round``,
    ``accumulate``): the numpy memory still allocated once the updates are in, each update's arrays
    dropped after ``accumulate`` as the engine drops them (tracemalloc, numpy's domain).
    """
    from fedge.coordinator.accumulators import Aggregation
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy

    strat = FedProtoStrategy(num_classes=CLASSES, rounds=1)
    strat.aggregation = Aggregation(rule, clip=clip)  # as the engine sets its EngineConfig's
    device, rng = _device_info("dev-0000"), np.random.default_rng(0)  # made before tracing: not counted
    tracemalloc.start()
    try:
        strat.begin_round(1)
        for _ in range(n):
            strat.accumulate(device, _update_arrays(rng), {})
        held = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    finally:
        tracemalloc.stop()
    return sum(trace.size for trace in held.traces)


# -- the floor: bare paho clients, same number and sizes of messages -------------------------------

def floor_topics(base: str) -> list[str]:
    """What a floor device subscribes to: the collector's "go" (a descriptor's size) and "global"."""
    return [f"{base}/go", f"{base}/global"]


def floor_device(base: str, ids: list[str], update_bytes: int) -> Callable[[int, paho.Client, paho.MQTTMessage], None]:
    """A ``Swarm`` ``on_message`` for floor devices ``ids``: each answers every round's "go" once, with a payload
    of an update's size on ``BASE/devices/ID/up`` (messages on other topics are ignored, so the same devices can
    also speak fedge's protocol)."""
    payloads = [os.urandom(update_bytes) for _ in ids]
    answered = [-1] * len(ids)
    go = f"{base}/go"

    def on_message(i: int, c: paho.Client, msg: paho.MQTTMessage) -> None:
        if msg.topic != go:
            return
        rnd = int(json.loads(bytes(msg.payload).rstrip(b" "))["round"])
        if answered[i] != rnd:
            answered[i] = rnd
            c.publish(f"{base}/devices/{ids[i]}/up", payloads[i], qos=1)

    return on_message


def run_floor(port: int, n: int, rounds: int, workdir: Path, sz: dict[str, int]) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    base = f"floor/{n}/{workdir.name}"
    ids = [f"dev-{i:04d}" for i in range(n)]
    on_message = floor_device(base, ids, sz["update"])
    swarm = Swarm(port, ids, on_message, subscribe=floor_topics(base))
    try:
        swarm.wait_connected()
        out = workdir / f"floor-{n}.json"
        cmd = [sys.executable, "-m", MODULE, "_floor", "--port", str(port), "--n", str(n), "--rounds", str(rounds),
               "--base", base, "--global-bytes", str(sz["global"]), "--descriptor-bytes", str(sz["descriptor"]),
               "--out", str(out)]
        subprocess.run(cmd, check=True, timeout=1800)
        return json.loads(out.read_text())
    finally:
        swarm.close()


def floor_main(args: argparse.Namespace) -> None:
    got = 0
    done = threading.Event()
    connected = threading.Event()

    def on_connect(c: paho.Client, userdata: Any, flags: Any, rc: Any, *a: Any) -> None:
        c.subscribe(f"{args.base}/devices/+/up", 1)
        connected.set()

    def on_message(c: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        nonlocal got
        got += 1
        if got >= args.n:
            done.set()

    c = _new_client(f"floor-collector-{args.n}")
    c.on_connect, c.on_message = on_connect, on_message
    c.connect(LOOPBACK, args.port, keepalive=120)
    c.loop_start()
    connected.wait(30)
    time.sleep(0.5)  # the SUBACK
    cpu0 = _cpu()
    times, cpus = [], []
    for rnd in range(1, args.rounds + 1):
        got = 0
        done.clear()
        glob = os.urandom(args.global_bytes)
        go = json.dumps({"round": rnd}).encode().ljust(args.descriptor_bytes)
        # The same sequence as a fedge round: announce (until the broker acknowledges), collect every
        # answer, publish the new global state (until acknowledged).
        t0 = time.perf_counter()
        c.publish(f"{args.base}/go", go, qos=1, retain=True).wait_for_publish(60)
        if not done.wait(600):
            raise TimeoutError(f"floor round {rnd}: {got}/{args.n} answers")
        c.publish(f"{args.base}/global", glob, qos=1, retain=True).wait_for_publish(60)
        times.append(time.perf_counter() - t0)
        cpus.append(_cpu())
    c.loop_stop()
    c.disconnect()
    Path(args.out).write_text(json.dumps({
        "round_seconds": times,
        "cpu_seconds_per_round": [b - a for a, b in zip([cpu0, *cpus], cpus, strict=False)],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


# -- driver -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role")
    co = sub.add_parser("_coordinator")
    fl = sub.add_parser("_floor")
    for q in (co, fl):
        q.add_argument("--port", type=int, required=True)
        q.add_argument("--n", type=int, required=True)
        q.add_argument("--rounds", type=int, required=True)
        q.add_argument("--out", required=True)
    co.add_argument("--fleet", required=True)
    co.add_argument("--state-dir", required=True)
    co.add_argument("--no-state", action="store_true", help="no checkpoints and no update log (what durability "
                                                            "costs: benchmarks.async_cost --state both)")
    co.add_argument("--observe", metavar="URLFILE", help="serve the dashboard and /metrics; write the URL here")
    co.add_argument("--workers-mode", action="store_true", help="merge workers' partials, read no updates")
    co.add_argument("--buffer", type=int, default=0, help="async mode's buffer_size K (0: synchronous rounds)")
    co.add_argument("--max-staleness", type=int, default=10, help="async mode's max_staleness")
    co.add_argument("--profile", metavar="FILE", help="write a cProfile of the rounds to FILE")
    co.add_argument("--ready-file", help="after registration write this file and wait for FILE.go")
    for q in (p, co):
        q.add_argument("--aggregation", choices=("mean", "trimmed", "median"), default="mean",
                       help="the coordinator's aggregation rule (default mean)")
        q.add_argument("--clip", type=float, default=0.0, help="with a robust rule: clip factor (0: off)")
    fl.add_argument("--base", required=True)
    fl.add_argument("--global-bytes", type=int, required=True)
    fl.add_argument("--descriptor-bytes", type=int, required=True)
    p.add_argument("--sizes", default="10,100,1000", help="fleet sizes (comma-separated)")
    p.add_argument("--rounds", type=int, default=5, help="training rounds per run (median reported)")
    p.add_argument("--repeat", type=int, default=3, help="alternating floor/fedge runs per N (rounds pooled)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.role == "_coordinator":
        coordinator_main(args)
        return 0
    if args.role == "_floor":
        floor_main(args)
        return 0

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))  # 1000 sockets + the broker's
    sz = sizes()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedge-scale-") as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            broker = MosquittoProcess(port=None, max_message_bytes=1 << 20)
            broker.config_path.write_text(loopback_config(broker.port, max_message_bytes=1 << 20))
            broker.start()
            # Floor and fedge alternate, --repeat times each, and their rounds are pooled: on a shared
            # machine the load drifts, and back-to-back single runs would hand the drift to one side.
            floors, fedges = [], []
            try:
                for rep in range(args.repeat):
                    floors.append(run_floor(broker.port, n, args.rounds, Path(tmp) / f"r{rep}", sz))
                    fedges.append(run_fedge(broker.port, n, args.rounds, Path(tmp) / f"r{rep}", args.aggregation,
                                            args.clip))
            finally:
                broker.close()
            pooled = ("round_seconds", "cpu_seconds_per_round")
            floor = {k: [x for f in floors for x in f[k]] for k in pooled}
            floor["peak_rss_mb"] = max(f["peak_rss_mb"] for f in floors)
            fedge: dict[str, Any] = {k: [x for f in fedges for x in f[k]] for k in pooled}
            fedge["runs"] = fedges
            fedge["peak_rss_mb"] = max(f["peak_rss_mb"] for f in fedges)
            fedge["aggregate_state_bytes"] = aggregate_state_bytes(n, args.aggregation, args.clip)
            growth = statistics.median(f["rss_after_rounds_mb"] - f["rss_before_rounds_mb"] for f in fedges)
            f_med = statistics.median(floor["round_seconds"])
            e_med = statistics.median(fedge["round_seconds"])
            rows.append({
                "n": n,
                "floor_round_s": f_med,
                "fedge_round_s": e_med,
                "ratio": e_med / f_med,
                "fedge_updates_per_s": n / e_med,
                "floor_updates_per_s": n / f_med,
                "coordinator_cpu_s_per_round": statistics.median(fedge["cpu_seconds_per_round"]),
                "floor_collector_cpu_s_per_round": statistics.median(floor["cpu_seconds_per_round"]),
                "coordinator_peak_rss_mb": fedge["peak_rss_mb"],
                "coordinator_rss_growth_mb": growth,
                "aggregate_state_bytes": fedge["aggregate_state_bytes"],
                "fedge": fedge,
                "floor": floor,
            })
            print(f"N={n}: fedge {e_med:.3f} s/round, floor {f_med:.3f} s/round", file=sys.stderr, flush=True)
    doc = {
        "benchmark": "fleet_scale",
        "command": " ".join(["python -m benchmarks.fleet_scale", *(argv if argv is not None else sys.argv[1:])]),
        "rounds": args.rounds,
        "repeat": args.repeat,
        "aggregation": args.aggregation,
        "clip": args.clip,
        "message_bytes": sz,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "paho": importlib.metadata.version("paho-mqtt"), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(rows))
    print(f"\nwrote {args.out}")
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    head = ["N", "floor s/round", "fedge s/round", "ratio", "updates/s", "coord CPU s/round", "coord peak RSS MB",
            "RSS growth MB", "aggregate B"]
    lines = [head]
    for r in rows:
        lines.append([str(r["n"]), f"{r['floor_round_s']:.3f}", f"{r['fedge_round_s']:.3f}", f"{r['ratio']:.2f}",
                      f"{r['fedge_updates_per_s']:.0f}", f"{r['coordinator_cpu_s_per_round']:.3f}",
                      f"{r['coordinator_peak_rss_mb']:.0f}", f"{r['coordinator_rss_growth_mb']:.1f}",
                      str(r["aggregate_state_bytes"])])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines)


if __name__ == "__main__":
    raise SystemExit(main())
