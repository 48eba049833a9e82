"""The worker side of a parallel simulation (issue 30): a host for some of the fleet's devices.

A :class:`DeviceHost` lives in a worker process (``--backend process``) or a Ray actor
(``--backend ray``) for the whole run. It builds its devices once, from the slots and data shares
the driver sends (the same :func:`~fedge.fleet.devices.device_from_slot` the sequential run uses,
so the devices are the same, bit for bit), and keeps each one's whole state — model, optimizer,
personal copy, generator, random generators, data share — between rounds: shipping that state
every round would cost more than the round's training for the small models of a fleet, and
rebuilding it would lose what a device carries from round to round.

Each round the host receives what a device would receive over the wire — the encoded round
descriptor and the encoded global artifacts that changed — and runs the real
:class:`~fedge.edge.agent.DeviceAgent` of every device it holds, in fleet order; it returns each
update exactly as encoded. The round engine, the coordinator half and the transport stay in the
driver, so every message still crosses the real encoding.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import resource
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.common.rounds import DeviceInfo
from fedge.common.transport import DeviceTransport
from fedge.edge.agent import DeviceAgent, Traffic
from fedge.edge.data.datasets import Dataset
from fedge.edge.methods.base import DeviceMethod, GlobalEval
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import device_from_slot
from fedge.fleet.registry import METHODS, MethodEntry, register_method
from fedge.fleet.slots import DeviceSlot
from fedge.sim.clocked import Stopwatch

log = logging.getLogger(__name__)


@dataclass
class DeviceShare:
    """What a worker needs to build one device: its slot and its data share."""

    slot: DeviceSlot
    train: Dataset
    local_test: Dataset
    val: Dataset | None = None  # the validation fold (fedge.edge.best)


@dataclass
class HostSpec:
    """Everything one worker is sent at start-up (the global test set travels separately: it is
    shared by every worker, and Ray puts it into the object store once)."""

    worker: int
    cfg: FleetConfig
    entry: MethodEntry  # registered in the worker when it is not a built-in (a method defined outside fedge)
    shares: list[DeviceShare]
    threads: int


@dataclass
class RoundResult:
    """One worker's answer to a round: every update its devices sent, in fleet order."""

    updates: list[tuple[str, bytes]]
    seconds: float  # time the worker spent on the round
    peak_rss: int  # the worker process's peak resident set, bytes
    device_seconds: dict[str, float] = field(default_factory=dict)  # each device's share of ``seconds``
    # each device's CPU seconds in this worker process: its work, whatever other jobs took of the cores
    # meanwhile (wall seconds on a shared machine are partly theirs); what a rebalance goes by
    device_cpu_s: dict[str, float] = field(default_factory=dict)


@dataclass
class DeviceState:
    """A device's whole state between rounds: its method half (model, optimizer, personal copy,
    generator, random generators, data share) and what its agent counted. Shipped to another
    worker when the driver rebalances the placement, and back to the driver after the last round.
    The global test set and the worker's evaluation cache stay behind (each worker has its own)."""

    info: DeviceInfo
    method: DeviceMethod
    traffic: list[Traffic]
    last_round: int
    trained_runs: set[str] = field(default_factory=set)

    @property
    def device_id(self) -> str:
        return self.info.device_id


def _writable(d: Dataset) -> Dataset:
    if d.x.flags.writeable and d.y.flags.writeable:
        return d
    return Dataset(d.name, d.x.copy(), d.y.copy(), d.classes, d.norm)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes.

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this program's own memory. Not
    ``ru_maxrss``: across the exec that starts a worker, Linux keeps the larger of the two, and
    the forked copy of the driver counts the driver's whole resident set — every worker would
    report at least the driver's peak. Elsewhere ``ru_maxrss`` (bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class _HostTransport(DeviceTransport):
    """One device's view of the round its worker was handed: the descriptor and the global bytes
    as the driver's bus holds them; its updates are kept for the driver."""

    def __init__(self, host: DeviceHost) -> None:
        self.host = host
        self.sent: list[bytes] = []

    def send_hello(self, data: bytes) -> None:
        self.host.hellos.append(data)

    def current_round(self) -> bytes | None:
        return self.host.descriptor

    def fetch_global(self, artifact: str) -> bytes | None:
        return self.host.globals.get(artifact)

    def send_update(self, data: bytes) -> None:
        self.sent.append(data)


class DeviceHost:
    """Some devices of a fleet, built once and stepped in fleet order each round."""

    def __init__(self, spec: HostSpec, global_test: Dataset | None) -> None:
        t0 = time.perf_counter()
        # One intra-op thread per worker by default: the workers are the parallelism, and float
        # reductions then run in the order a single-threaded sequential run uses (bit-identical results).
        torch.set_num_threads(spec.threads)
        # torch imports its compiler (torch._dynamo, 2-5 s) the first time an optimizer is built: here, while
        # the other workers start too, rather than inside round 1, whose seconds decide the rebalance
        importlib.import_module("torch._dynamo")
        if spec.entry.name not in METHODS:
            register_method(spec.entry)
        cfg = spec.cfg
        self.worker = spec.worker
        self.fleet, self.eval_every = cfg.run.fleet, cfg.run.eval_every
        self.global_test = global_test
        self.global_eval = GlobalEval(global_test) if global_test is not None else None
        self.descriptor: bytes | None = None
        self.globals: dict[str, bytes] = {}
        self.hellos: list[bytes] = []
        self.agents: list[DeviceAgent] = []
        if global_test is not None and not global_test.x.flags.writeable:
            # Ray hands every actor of a node the same read-only copy from its object store; the test
            # set is only ever read (evaluation), so torch's warning about non-writable arrays is noise here.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for share in spec.shares:
            # a device's own share is written to by nobody either, but it is small: a private copy
            # keeps "training data is an ordinary array" true for every method
            train, local_test = _writable(share.train), _writable(share.local_test)
            dev = device_from_slot(cfg, share.slot, train, local_test, global_test, global_eval=self.global_eval,
                                   val=share.val)
            self.agents.append(DeviceAgent(dev.method, _HostTransport(self), dev.info, fleet=cfg.run.fleet,
                                           eval_every=cfg.run.eval_every))
        self.build_seconds = time.perf_counter() - t0
        log.info("worker %d (pid %d): built %d devices in %.1f s", self.worker, os.getpid(), len(self.agents),
                 self.build_seconds)

    def hello(self) -> list[bytes]:
        """Every device's hello message, in fleet order."""
        self.hellos = []
        for a in self.agents:
            a.hello()
        return list(self.hellos)

    def run_round(self, descriptor: bytes, changed: dict[str, bytes],
                  train_s: dict[str, float] | None = None) -> RoundResult:
        """Step every device through the round ``descriptor`` announces; ``changed``: the global
        artifacts published since the previous call; ``train_s``: the virtual seconds each device reports
        for its work (:mod:`fedge.sim.clocked`: as in the sequential run, so the updates' bytes repeat)."""
        t0 = time.perf_counter()
        self.descriptor = descriptor
        self.globals.update(changed)
        updates: list[tuple[str, bytes]] = []
        took: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for a in self.agents:
            if train_s is not None:
                a.timer = Stopwatch(train_s.get(a.device.device_id, 0.0))
            t1, c1 = time.perf_counter(), time.process_time()
            a.step()
            took[a.device.device_id] = time.perf_counter() - t1
            cpu[a.device.device_id] = time.process_time() - c1
            sent = a.transport.sent  # type: ignore[attr-defined]
            updates += [(a.device.device_id, data) for data in sent]
            sent.clear()
        return RoundResult(updates, time.perf_counter() - t0, peak_rss_bytes(), took, cpu)

    def status(self) -> dict[str, Any]:
        """Where this worker runs and what it measured: pid, host, devices, memory, evaluations."""
        ev = self.global_eval
        return {"worker": self.worker, "pid": os.getpid(), "node": socket.gethostname(),
                "devices": [a.device.device_id for a in self.agents], "threads": torch.get_num_threads(),
                "build_s": round(self.build_seconds, 3), "peak_rss_bytes": peak_rss_bytes(),
                "global_eval_passes": ev.passes if ev else 0, "global_eval_hits": ev.hits if ev else 0}

    def release(self, device_ids: list[str]) -> list[DeviceState]:
        """Hand over the state of ``device_ids`` (the driver moves them to another worker) and stop
        stepping them here."""
        wanted = set(device_ids)
        out = [self._state(a) for a in self.agents if a.device.device_id in wanted]
        self.agents = [a for a in self.agents if a.device.device_id not in wanted]
        log.info("worker %d: released %s", self.worker, [s.device_id for s in out])
        return out

    def adopt(self, blob: bytes) -> None:
        """Take over devices another worker released; they train here from the next round on.

        ``blob``: their :class:`DeviceState` list as the driver pickled it (:func:`fedge.sim.pool.dumps`),
        unpickled here into arrays of this worker's own: Ray would hand over read-only views of its
        object store, and a device's state is written to every round."""
        states: list[DeviceState] = pickle.loads(blob)
        for st in states:
            st.method.ctx.global_test = self.global_test
            st.method.ctx.global_eval = self.global_eval
            agent = DeviceAgent(st.method, _HostTransport(self), st.info, fleet=self.fleet, eval_every=self.eval_every)
            agent.traffic, agent.last_round, agent.trained_runs = st.traffic, st.last_round, st.trained_runs
            self.agents.append(agent)
        log.info("worker %d: adopted %s", self.worker, [s.device_id for s in states])

    def finish(self) -> list[DeviceState]:
        """Every device's final state, for checkpoints, reports and sample grids in the driver."""
        return [self._state(a) for a in self.agents]

    @staticmethod
    def _state(a: DeviceAgent) -> DeviceState:
        """``a``'s state without the global test set and the shared evaluation cache: the receiving
        side has the one test set and puts it back, so it does not travel once per device."""
        a.method.ctx.global_test = None
        a.method.ctx.global_eval = None
        return DeviceState(a.device, a.method, a.traffic, a.last_round, set(a.trained_runs))
