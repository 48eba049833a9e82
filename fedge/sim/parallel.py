"""The driver of a parallel simulation (issue 30): devices in workers, everything else here.

The round engine, the coordinator half and the in-memory bus stay in the driver exactly as in a
sequential run; only the bus's *pump* — "let every device handle the round" — changes. Instead of
stepping each agent here, the pump hands the encoded round descriptor and the encoded global
artifacts that changed since the last round to every worker at once, and puts the encoded
updates the workers return onto the bus **in fleet order**, so the engine validates and
aggregates them in the order a sequential run does: the same sums, bit for bit.

Devices are pinned to workers for the whole run (:func:`place`: the longest estimated jobs first,
each to the least-loaded worker). A worker that dies takes its devices with it: they are missing
from that round on, which the engine reports as dropouts, and ``results.json`` says which worker
died and how (``simulation.lost``).
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
from fedge.common.rounds import DeviceInfo
from fedge.common.transport import CoordinatorTransport
from fedge.edge.agent import DeviceAgent
from fedge.errors import ConfigError, FedgeError
from fedge.fleet.config import FleetConfig, SimulationSection
from fedge.fleet.devices import FleetData, SimDevice
from fedge.fleet.registry import method_entry
from fedge.fleet.slots import DeviceSlot
from fedge.sim.pool import WorkerLost, WorkerPool
from fedge.sim.worker import DeviceShare, FinishedDevice, HostSpec, RoundResult, peak_rss_bytes

log = logging.getLogger(__name__)


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
    """A device's relative cost per round: samples × epochs × multiply-accumulates per sample."""
    epochs = cfg.train.local_epochs or slot.plan.local_epochs
    return float(max(1, slot.num_samples) * epochs * max(1, slot.spec.macs()))


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

    def to_dict(self) -> dict[str, Any]:
        rounds = [t for t in self.timings if t.wall_s > 0]
        overheads = [t.overhead_s for t in rounds]
        return {
            "backend": self.backend, "workers": self.workers, "threads_per_worker": self.threads,
            "placement": self.placement, "start_s": round(self.start_s, 3),
            "round_wall_s": [round(t.wall_s, 4) for t in rounds],
            "round_overhead_s": [round(t.overhead_s, 4) for t in rounds],
            # how evenly the placement spread the work: each worker's busy seconds per round, and each
            # device's total over the run (the placement estimates it from samples × epochs × MACs)
            "round_worker_s": [[None if x is None else round(x, 3) for x in t.worker_s] for t in rounds],
            "device_s": {d: round(sum(t.device_s.get(d, 0.0) for t in rounds), 3)
                         for d in dict.fromkeys(d for t in rounds for d in t.device_s)},
            "mean_round_overhead_s": sum(overheads) / len(overheads) if overheads else None,
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

    def __init__(self, cfg: FleetConfig, data: FleetData, slots: list[DeviceSlot]) -> None:
        self.cfg = cfg
        self.data = data
        self.slots = slots
        sim = cfg.simulation
        self.pool, n = make_pool(sim, len(slots))
        self.placement = place([estimated_cost(cfg, s) for s in slots], n)
        self.run = ParallelRun(sim.backend, [[slots[i].device_id for i in idx] for idx in self.placement],
                               default_threads(sim))
        self.bus = InMemoryBus()
        self._sent: dict[str, bytes] = {}  # artifact -> the bytes last shipped to the workers
        self._last_descriptor: bytes | None = None
        self._lost_workers: set[int] = set()

    def start(self) -> CoordinatorTransport:
        """Start the workers, build every device in them, and queue the devices' hellos on the bus."""
        cfg, data = self.cfg, self.data
        entry = method_entry(cfg.run.method)
        specs = [HostSpec(w, cfg, entry, [DeviceShare(self.slots[i], data.train.subset(data.splits[i].train),
                                                      data.train.subset(data.splits[i].test)) for i in idx],
                          self.run.threads)
                 for w, idx in enumerate(self.placement)]
        log.info("%s backend: %d workers, devices %s", self.pool.kind, len(specs), self.run.placement)
        started = self.pool.start(specs, data.test)
        del specs
        failed = [r for r in started.values() if isinstance(r, WorkerLost)]
        if failed:  # a worker that cannot even build its devices is a broken set-up, not a device's dropout
            self.pool.close()
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
        self._last_descriptor = raw
        rnd = Message.from_bytes(raw).round
        # The engine encodes each artifact anew when it publishes it: a new bytes object is a new version.
        changed = {k: v for k, v in self.bus.globals.items() if self._sent.get(k) is not v}
        t0 = time.perf_counter()
        results = self.pool.broadcast("run_round", raw, changed)
        wall = time.perf_counter() - t0
        self._sent.update(changed)
        self._absorb(results, rnd=rnd)
        done = [r for r in results.values() if isinstance(r, RoundResult)]
        per_worker = [r.seconds if isinstance(r := results.get(w), RoundResult) else None
                      for w in range(len(self.placement))]
        self.run.timings.append(RoundTiming(rnd, wall, max((r.seconds for r in done), default=0.0), per_worker,
                                            {d: t for r in done for d, t in r.device_seconds.items()}))
        by_device: dict[str, list[bytes]] = {}
        for r in done:
            for dev, data in r.updates:
                by_device.setdefault(dev, []).append(data)
        for s in self.slots:  # fleet order: the aggregation order of a sequential run
            self.bus.updates.extend(by_device.get(s.device_id, []))

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
        states: dict[str, FinishedDevice] = {}
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

    def close(self) -> None:
        self.pool.close()


def sequential_run(devices: list[SimDevice]) -> dict[str, Any]:
    """``results.json`` → ``simulation`` for a sequential run: one process, every device."""
    import torch

    ev = next((d.method.ctx.global_eval for d in devices if d.method.ctx.global_eval is not None), None)
    return {"backend": "sequential", "threads_per_worker": torch.get_num_threads(), "lost": {},
            "workers": [{"worker": 0, "pid": os.getpid(), "devices": [d.info.device_id for d in devices],
                         "peak_rss_bytes": peak_rss_bytes(), "global_eval_passes": ev.passes if ev else 0,
                         "global_eval_hits": ev.hits if ev else 0}]}

