"""The driver of a parallel simulation (issue 30): devices in workers, everything else here.

The round engine, the coordinator half and the in-memory bus stay in the driver exactly as in a
sequential run; only the bus's *pump* — "let every device handle the round" — changes. Instead of
stepping each agent here, the pump hands the encoded round descriptor and the encoded global
artifacts that changed since the last round to every worker at once, and puts the encoded
updates the workers return onto the bus **in fleet order**, so the engine validates and
aggregates them in the order a sequential run does: the same sums, bit for bit.

Each device lives in one worker, state and all (:mod:`fedge.sim.worker` says why). The first
placement comes from the planner's estimate of each device's round (:func:`estimated_cost`: the
longest jobs first, each to the least-loaded worker). That estimate counts multiply-accumulates,
and small networks' rounds are not proportional to them (per-batch and memory-bound work weigh
as much), so once the first round of a phase has run the driver places the devices again by the
seconds each one actually took (:func:`rebalance`), and moves the devices whose worker changes
— their whole state, once — when that promises the busiest worker at least :data:`MIN_GAIN` less
time. A device's results do not depend on which worker trains it: a rebalanced run is still the
sequential run, bit for bit.

A worker that dies takes its devices with it: they are missing from that round on, which the
engine reports as dropouts, and ``results.json`` says which worker died and how (``simulation.lost``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport, InMemoryDeviceTransport
from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.common.transport import CoordinatorTransport
from fedge.edge.agent import DeviceAgent
from fedge.errors import ConfigError, FedgeError
from fedge.fleet.clock import fleet_clock
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import FleetData, SimDevice
from fedge.fleet.registry import method_entry
from fedge.fleet.sim_sections import SimulationSection
from fedge.fleet.slots import DeviceSlot
from fedge.sim.pool import WorkerLost, WorkerPool, dumps
from fedge.sim.worker import DeviceShare, DeviceState, HostSpec, RoundResult, peak_rss_bytes

log = logging.getLogger(__name__)

# A rebalance must promise the busiest worker at least this fraction less time: one round's seconds
# are noisy on a shared machine, and a moved device's state travels twice (out of its worker, into the next).
MIN_GAIN = 0.1


def default_threads(sim: SimulationSection) -> int:
    """torch intra-op threads per worker: ``threads``, else 1 (process) or ``num_cpus`` (Ray)."""
    if sim.threads is not None:
        return sim.threads
    return max(1, int(sim.num_cpus)) if sim.backend == "ray" else 1


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def estimated_cost(cfg: FleetConfig, slot: DeviceSlot) -> float:
    """A device's relative cost per round before any round has run: its training MACs (MACs × samples ×
    epochs) on one common clock, since every simulated device trains on this machine's cores, whatever
    its profile's (the speed model, :mod:`fedge.profiles.speed`, would time it on its own hardware)."""
    epochs = cfg.train.local_epochs or slot.plan.local_epochs
    return float(slot.spec.macs() * max(1, slot.num_samples) * epochs)


def place(costs: list[float], workers: int) -> list[list[int]]:
    """Device indices per worker: longest job first to the least-loaded worker (ties: the lower index),
    each worker's devices in fleet order. Deterministic, so a run is placed the same way every time."""
    load = [0.0] * workers
    pinned: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(workers), key=lambda w: (load[w], w))
        load[w] += costs[i]
        pinned[w].append(i)
    return [sorted(p) for p in pinned if p]


def measured_costs(timing: RoundTiming) -> dict[str, float | None]:
    """What a rebalance places the devices by, from a round's timing: the CPU seconds each device took in it
    (None: not measured). The one place the decision reads a clock, so a test passes its own seconds."""
    return dict(timing.device_cpu_s)


def rebalance(costs: dict[int, float], placement: list[list[int]], live: list[int], *,
              min_gain: float = MIN_GAIN) -> list[list[int]] | None:
    """The live workers' devices placed again by ``costs`` (device index -> seconds it took), or None
    when that would not cut the busiest live worker's time by at least ``min_gain``.

    :func:`place` decides the groups; then, greedily, the group and live worker that share the most
    devices are paired first, so few devices (and their bytes) move. Lost workers keep their entries.
    """
    devices = [i for w in live for i in placement[w]]
    current = max(sum(costs[i] for i in placement[w]) for w in live)
    if current <= 0:
        return None
    groups = [[devices[j] for j in g] for g in place([costs[i] for i in devices], len(live))]
    if max(sum(costs[i] for i in g) for g in groups) > (1.0 - min_gain) * current:
        return None
    out = [[] if w in live else list(p) for w, p in enumerate(placement)]
    shared = sorted(((len(set(g) & set(placement[w])), -k, -w) for k, g in enumerate(groups) for w in live),
                    reverse=True)
    taken_groups: set[int] = set()
    taken_workers: set[int] = set()
    for _, k, w in shared:
        if -k not in taken_groups and -w not in taken_workers:
            taken_groups.add(-k)
            taken_workers.add(-w)
            out[-w] = groups[-k]
    return out


@dataclass(frozen=True)
class LostDevice:
    """A device whose worker died: what the report needs without its state."""

    info: DeviceInfo
    plan: dict[str, Any]
    num_local_test: int
    reason: str


@dataclass
class RoundTiming:
    """One round as the driver saw it: wall time of the workers' part, and the slowest worker's own time."""

    round: int
    wall_s: float
    slowest_worker_s: float
    worker_s: list[float | None] = field(default_factory=list)  # each worker's own time (None: lost)
    device_s: dict[str, float] = field(default_factory=dict)  # each device's step in its worker
    device_cpu_s: dict[str, float] = field(default_factory=dict)  # the same in CPU seconds (the rebalance's)
    phase: str = ""
    # the driver's own time before this round's workers' part (since the previous one ended): the engine
    # validating, aggregating and encoding, while every worker waits
    driver_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Dispatch, transfer and (de)serialisation: the wall time no worker spent on its devices."""
        return max(0.0, self.wall_s - self.slowest_worker_s)


@dataclass
class ParallelRun:
    """What the parallel driver measured, for ``results.json`` → ``simulation``."""

    backend: str
    placement: list[list[str]]
    threads: int
    start_s: float = 0.0
    timings: list[RoundTiming] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)  # device id -> how its worker was lost
    workers: list[dict[str, Any]] = field(default_factory=list)
    backend_info: dict[str, Any] = field(default_factory=dict)
    migrations: list[dict[str, Any]] = field(default_factory=list)  # each rebalance: round, moves, seconds
    final_placement: list[list[str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        rounds = [t for t in self.timings if t.wall_s > 0]
        overheads = [t.overhead_s for t in rounds]
        return {
            "backend": self.backend, "workers": self.workers, "threads_per_worker": self.threads,
            "placement": self.placement, "start_s": round(self.start_s, 3),
            "round_wall_s": [round(t.wall_s, 4) for t in rounds],
            "round_overhead_s": [round(t.overhead_s, 4) for t in rounds],
            "round_driver_s": [round(t.driver_s, 4) for t in rounds],
            # how evenly the placement spread the work: each worker's busy seconds per round, and each
            # device's total over the run (the first placement estimates it; rebalances measure it)
            "round_worker_s": [[None if x is None else round(x, 3) for x in t.worker_s] for t in rounds],
            "device_s": {d: round(sum(t.device_s.get(d, 0.0) for t in rounds), 3)
                         for d in dict.fromkeys(d for t in rounds for d in t.device_s)},
            "device_cpu_s": {d: round(sum(t.device_cpu_s.get(d, 0.0) for t in rounds), 3)
                             for d in dict.fromkeys(d for t in rounds for d in t.device_cpu_s)},
            "mean_round_overhead_s": sum(overheads) / len(overheads) if overheads else None,
            "migrations": self.migrations, "final_placement": self.final_placement or self.placement,
            "lost": self.lost, **self.backend_info,
        }


def make_pool(sim: SimulationSection, num_devices: int) -> tuple[WorkerPool, int]:
    """The backend's pool (not started) and its worker count."""
    if sim.backend == "process":
        from fedge.sim.procpool import ProcessPool

        return ProcessPool(), min(num_devices, sim.workers or max(1, available_cpus() // default_threads(sim)))
    if sim.backend == "ray":
        from fedge.sim.raypool import RayPool

        pool = RayPool(sim)
        return pool, pool.connect(num_devices)
    raise ConfigError(f"backend {sim.backend!r} does not run workers")


class ParallelFleet:
    """The fleet's devices in a :class:`WorkerPool`, wired to an in-memory bus in the driver."""

    def __init__(self, cfg: FleetConfig, data: FleetData, slots: list[DeviceSlot], pool: WorkerPool,
                 workers: int) -> None:
        self.cfg = cfg
        self.data = data
        self.slots = slots
        sim = cfg.simulation
        self.pool = pool  # made by make_pool, and maybe spawned already; closed by whoever made it
        self.placement = place([estimated_cost(cfg, s) for s in slots], workers)
        self.run = ParallelRun(sim.backend, [[slots[i].device_id for i in idx] for idx in self.placement],
                               default_threads(sim))
        self.bus = InMemoryBus()
        # the devices' virtual training seconds per round, as the sequential run's clock gives them (train_s)
        self.clock = fleet_clock(cfg, slots)
        self._sent: dict[str, bytes] = {}  # artifact -> the bytes last shipped to the workers
        self._last_descriptor: bytes | None = None
        self._lost_workers: set[int] = set()
        self._phases_balanced: set[str] = set()  # phases whose first round's seconds decided a rebalance
        self._driver_since: float | None = None  # when the driver last got the workers' results

    def start(self) -> CoordinatorTransport:
        """Start the workers, build every device in them, and queue the devices' hellos on the bus."""
        cfg, data = self.cfg, self.data
        entry = method_entry(cfg.run.method)
        specs = [HostSpec(w, cfg, entry, [DeviceShare(self.slots[i], data.train.subset(data.splits[i].train),
                                                      data.train.subset(data.splits[i].test),
                                                      data.train.subset(data.splits[i].val)) for i in idx],
                          self.run.threads)
                 for w, idx in enumerate(self.placement)]
        log.info("%s backend: %d workers, devices %s", self.pool.kind, len(specs), self.run.placement)
        started = self.pool.start(specs, data.test)
        del specs
        failed = [r for r in started.values() if isinstance(r, WorkerLost)]
        if failed:  # a worker that cannot even build its devices is a broken set-up, not a device's dropout
            raise FedgeError(f"{failed[0].reason} while starting (building its devices)",
                             hint="its error is above (stderr); a Ray cluster's nodes need the driver's fedge, torch "
                                  "and Python versions (docs/simulation.md)")
        # The workers hold their shares now; the driver keeps the splits and the test set, not the images.
        self.data = FleetData(data.train.subset(np.zeros(0, dtype=np.int64)), data.test, data.splits)
        self.run.start_s = self.pool.start_seconds
        self.run.backend_info = self.pool.describe()
        hellos = self.pool.broadcast("hello")
        self._absorb(hellos, rnd=0)
        by_index: dict[int, bytes] = {}
        for w in self._live_workers():
            got = hellos.get(w)
            if isinstance(got, list):  # one hello per device, in the order of the worker's placement
                by_index.update(zip(self.placement[w], got, strict=True))
        self.bus.hellos.extend(by_index[i] for i in sorted(by_index))  # registered in fleet order, as sequentially
        self.bus.pump = self.pump
        self._driver_since = time.perf_counter()  # round 1's driver time: the engine's start, the hellos
        return InMemoryCoordinatorTransport(self.bus)

    def _live_workers(self) -> list[int]:
        return [w for w in range(len(self.placement)) if w not in self._lost_workers]

    def _absorb(self, results: dict[int, Any], *, rnd: int) -> None:
        """Note the workers a call found dead: their devices are lost from round ``rnd`` on."""
        for w, res in results.items():
            if isinstance(res, WorkerLost) and w not in self._lost_workers:
                self._lost_workers.add(w)
                for i in self.placement[w]:
                    self.run.lost[self.slots[i].device_id] = f"round {rnd}: {res.reason}"
                log.warning("round %d: %s; its devices %s drop out", rnd, res.reason,
                            [self.slots[i].device_id for i in self.placement[w]])

    def pump(self) -> None:
        """Every live worker handles the announced round; their updates go onto the bus in fleet order."""
        raw = self.bus.round_msg
        if raw is None or raw is self._last_descriptor:
            return
        t_in = time.perf_counter()
        driver_s = t_in - self._driver_since if self._driver_since is not None else 0.0  # (None: pumped by hand)
        self._last_descriptor = raw
        msg = Message.from_bytes(raw)
        rnd = msg.round
        info = RoundInfo.from_dict(msg.info["round"])
        if not info.is_final:
            self._maybe_rebalance(rnd, info.phase)
        # The engine encodes each artifact anew when it publishes it: a new bytes object is a new version.
        changed = {k: v for k, v in self.bus.globals.items() if self._sent.get(k) is not v}
        t0 = time.perf_counter()
        # The final evaluation takes no virtual time (fedge.sim.clocked); a training round the clock's.
        train_s = {dev: 0.0 if info.is_final else c.train_s(rnd) for dev, c in self.clock.devices.items()}
        results = self.pool.broadcast("run_round", raw, changed, train_s)
        wall = time.perf_counter() - t0
        self._sent.update(changed)
        self._absorb(results, rnd=rnd)
        done = [r for r in results.values() if isinstance(r, RoundResult)]
        per_worker = [r.seconds if isinstance(r := results.get(w), RoundResult) else None
                      for w in range(len(self.placement))]
        self.run.timings.append(RoundTiming(rnd, wall, max((r.seconds for r in done), default=0.0), per_worker,
                                            {d: t for r in done for d, t in r.device_seconds.items()},
                                            {d: t for r in done for d, t in r.device_cpu_s.items()},
                                            info.phase, driver_s))
        by_device: dict[str, list[bytes]] = {}
        for r in done:
            for dev, data in r.updates:
                by_device.setdefault(dev, []).append(data)
        for s in self.slots:  # fleet order: the aggregation order of a sequential run
            self.bus.updates.extend(by_device.get(s.device_id, []))
        self._driver_since = time.perf_counter()

    def _maybe_rebalance(self, rnd: int, phase: str) -> None:
        """Before round ``rnd``: once per phase, after its first round, place the devices again by the
        CPU seconds each took in it (:func:`rebalance`) and move those whose worker changes. CPU seconds,
        not wall seconds: on a shared machine a worker that other jobs crowded out would look slow."""
        last = self.run.timings[-1] if self.run.timings else None
        if last is None or last.phase != phase or phase in self._phases_balanced:
            return
        self._phases_balanced.add(phase)
        live = self._live_workers()
        seconds = measured_costs(last)
        costs = {i: seconds.get(self.slots[i].device_id) for w in live for i in self.placement[w]}
        if len(live) < 2 or any(c is None for c in costs.values()):
            return
        measured = {i: float(c) for i, c in costs.items() if c is not None}
        new = rebalance(measured, self.placement, live)
        busiest = max(sum(measured[i] for i in self.placement[w]) for w in live)
        if new is None:
            log.info("round %d: the placement stays (round %d's busiest worker %.2f CPU s; no placement cuts it "
                     "by %.0f %%)", rnd, last.round, busiest, 100 * MIN_GAIN)
            return
        self._migrate(new, rnd, busiest, max(sum(measured[i] for i in new[w]) for w in live))

    def _migrate(self, new: list[list[int]], rnd: int, busiest: float, predicted: float) -> None:
        """Move every device whose worker differs in ``new``: its state out of the old worker, into the new."""
        t0 = time.perf_counter()
        where = {i: w for w, idx in enumerate(self.placement) for i in idx}
        moves = {i: (where[i], w) for w, idx in enumerate(new) for i in idx if where[i] != w}
        out: dict[int, list[str]] = {}
        for i, (src, _) in sorted(moves.items()):
            out.setdefault(src, []).append(self.slots[i].device_id)
        released = self.pool.call_each("release", {w: (ids,) for w, ids in out.items()})
        self._absorb(released, rnd=rnd)  # a worker lost now loses its devices, those about to move included
        states: dict[str, DeviceState] = {st.device_id: st for res in released.values() if isinstance(res, list)
                                          for st in res}
        placement = [list(p) for p in self.placement]
        into: dict[int, list[DeviceState]] = {}
        for i, (src, dst) in sorted(moves.items()):
            st = states.get(self.slots[i].device_id)
            if st is None:
                continue
            placement[src].remove(i)
            placement[dst].append(i)
            if dst in self._lost_workers:  # died while the others released: the state has nowhere to go
                self.run.lost[st.device_id] = f"round {rnd}: moving to worker {dst}, which was lost"
                continue
            into.setdefault(dst, []).append(st)
        self.placement = [sorted(p) for p in placement]
        blobs = {w: (dumps(sts),) for w, sts in into.items()}
        self._absorb(self.pool.call_each("adopt", blobs), rnd=rnd)
        moved = {self.slots[i].device_id: [src, dst] for i, (src, dst) in sorted(moves.items())
                 if self.slots[i].device_id in states}
        seconds = time.perf_counter() - t0
        self.run.migrations.append({"before_round": rnd, "moved": moved, "seconds": round(seconds, 3),
                                    "bytes": sum(len(b[0]) for b in blobs.values()),
                                    "busiest_worker_cpu_s": round(busiest, 3), "predicted_cpu_s": round(predicted, 3)})
        self.run.final_placement = [[self.slots[i].device_id for i in idx] for idx in self.placement]
        log.info("round %d: rebalanced by the measured CPU seconds (busiest worker %.2f s -> %.2f s predicted): "
                 "moved %s in %.2f s", rnd, busiest, predicted, moved, seconds)

    def finish(self) -> tuple[list[SimDevice], list[DeviceAgent], list[LostDevice]]:
        """Every surviving device's final state, shipped back once, as the sequential run's devices and
        agents; and the devices lost with their workers."""
        status = self.pool.broadcast("status")
        finished = self.pool.broadcast("finish")
        self._absorb(finished, rnd=self.run.timings[-1].round if self.run.timings else 0)
        for w in range(len(self.placement)):
            st = status.get(w)
            self.run.workers.append(st if isinstance(st, dict) else
                                    {"worker": w, "devices": [self.slots[i].device_id for i in self.placement[w]],
                                     "lost": True})
        states: dict[str, DeviceState] = {}
        for res in finished.values():
            if not isinstance(res, WorkerLost):
                states.update({f.device_id: f for f in res})
        devices: list[SimDevice] = []
        agents: list[DeviceAgent] = []
        lost: list[LostDevice] = []
        for s in self.slots:
            f = states.get(s.device_id)
            if f is None:
                lost.append(LostDevice(s.info(), s.plan.to_dict(), len(self.data.splits[s.index].test),
                                       self.run.lost.get(s.device_id, "its worker was lost")))
                continue
            f.method.ctx.global_test = self.data.test  # the worker left the shared test set behind
            dev = SimDevice(s.info(), f.method, s.plan.to_dict())
            agent = DeviceAgent(f.method, InMemoryDeviceTransport(self.bus), dev.info, fleet=self.cfg.run.fleet,
                                eval_every=self.cfg.run.eval_every)
            agent.traffic, agent.last_round, agent.trained_runs = f.traffic, f.last_round, f.trained_runs
            devices.append(dev)
            agents.append(agent)
        return devices, agents, lost


def sequential_run(devices: list[SimDevice]) -> dict[str, Any]:
    """``results.json`` → ``simulation`` for a sequential run: one process, every device."""
    import torch

    ev = next((d.method.ctx.global_eval for d in devices if d.method.ctx.global_eval is not None), None)
    return {"backend": "sequential", "threads_per_worker": torch.get_num_threads(), "lost": {},
            "workers": [{"worker": 0, "pid": os.getpid(), "devices": [d.info.device_id for d in devices],
                         "peak_rss_bytes": peak_rss_bytes(), "global_eval_passes": ev.passes if ev else 0,
                         "global_eval_hits": ev.hits if ev else 0}]}

