"""``[simulation] backend = "ray"`` (extra ``fedge[ray]``): the device hosts as Ray actors.

Each worker is one actor holding a :class:`~fedge.sim.worker.DeviceHost` for the whole run and
reserving ``num_cpus`` CPUs and ``num_gpus`` GPUs (a fraction lets several actors share one GPU):
a worker trains its devices one at a time, so these are each device's resources while it trains.
The global test set is put into the object store once (actors on one node read the same copy),
and each round's changed global artifacts once per round, whatever the number of actors.

Without ``address`` a local Ray is started for the run (and stopped after it); a Ray already
initialised in this process — a test's ``ray.init(num_cpus=2)``, a notebook's — is used as it is
and left running. With ``address`` (``fedge simulate --address HOST:6379``, or ``"auto"``) the
driver joins an existing cluster started with ``ray start``: docs/simulation.md has the recipe.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from fedge.common.extras import MissingExtraError
from fedge.edge.data.datasets import Dataset
from fedge.errors import ConfigError, FedgeError
from fedge.fleet.sim_sections import SimulationSection
from fedge.sim.pool import WorkerLost, WorkerPool
from fedge.sim.worker import DeviceHost, HostSpec

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`MissingExtraError` naming ``fedge[ray]``."""
    try:
        import ray
    except ImportError as exc:
        raise MissingExtraError("ray", "ray", "ray") from exc
    return ray


class RayPool(WorkerPool):
    """``workers`` Ray actors, each hosting the devices pinned to it."""

    kind = "ray"

    def __init__(self, sim: SimulationSection) -> None:
        self.sim = sim
        self.ray = import_ray()
        self._actors: dict[int, Any] = {}
        self._started_ray = False
        self.init_seconds = 0.0
        self.start_seconds = 0.0
        self.resources: dict[str, float] = {}

    def connect(self, num_devices: int) -> int:
        """Start or join Ray; check the cluster can host the workers; return the worker count."""
        ray, sim = self.ray, self.sim
        t0 = time.perf_counter()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                                      "log_to_driver": True}
            if sim.address:
                ray.init(address=sim.address, **kwargs)
            else:
                # a local Ray's workers import what this process can (a method defined beside a script),
                # as the process backend's do; a cluster's nodes must have it installed (docs/simulation.md)
                path = os.pathsep.join(p for p in sys.path if p)
                ray.init(runtime_env={"env_vars": {"PYTHONPATH": path}}, **kwargs)
            self._started_ray = True
        self.init_seconds = time.perf_counter() - t0
        self.resources = {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        cpus, gpus = self.resources.get("CPU", 0.0), self.resources.get("GPU", 0.0)
        if sim.num_gpus > 0 and gpus < sim.num_gpus:
            self.close()
            raise ConfigError(f"[simulation] num_gpus = {sim.num_gpus:g}, but the Ray cluster has "
                              f"{'no GPU' if not gpus else f'{gpus:g} GPUs'}",
                              hint="set num_gpus = 0 to train on the CPUs, or join a cluster with GPUs (--address)")
        fit = int(cpus // sim.num_cpus)
        if sim.num_gpus > 0:
            fit = min(fit, int(gpus // sim.num_gpus))
        workers = sim.workers or max(1, min(fit, num_devices))
        workers = min(workers, num_devices)
        if workers > fit:
            self.close()
            raise ConfigError(f"[simulation] workers = {workers} actors of num_cpus = {sim.num_cpus:g}"
                              + (f", num_gpus = {sim.num_gpus:g}" if sim.num_gpus else "")
                              + f" do not fit the Ray cluster ({cpus:g} CPUs, {gpus:g} GPUs): the extra actors "
                              "would wait for resources forever",
                              hint=f"set workers = {max(fit, 1)} or less, lower num_cpus, or add nodes (ray start)")
        return workers

    def start(self, specs: list[HostSpec], global_test: Dataset | None) -> dict[int, Any | WorkerLost]:
        ray, sim = self.ray, self.sim
        t0 = time.perf_counter()
        actor = ray.remote(max_restarts=0, max_task_retries=0)(DeviceHost)
        test_ref = ray.put(global_test)  # once: every actor on a node reads the same copy
        for spec in specs:
            self._actors[spec.worker] = actor.options(num_cpus=sim.num_cpus, num_gpus=sim.num_gpus,
                                                      name=None).remote(spec, test_ref)
        # An actor's constructor runs asynchronously; a cheap call on each waits for it (and shows a failure).
        out = self._gather({w: a.status.remote() for w, a in self._actors.items()})
        self.start_seconds = time.perf_counter() - t0
        return {w: (None if not isinstance(r, WorkerLost) else r) for w, r in out.items()}

    @property
    def live(self) -> list[int]:
        return sorted(self._actors)

    def broadcast(self, name: str, *args: Any) -> dict[int, Any | WorkerLost]:
        ray = self.ray
        # Arguments put once (a round's global artifacts), then handed to every actor by reference.
        refs = [ray.put(a) for a in args]
        return self._gather({w: getattr(a, name).remote(*refs) for w, a in self._actors.items()})

    def call_each(self, name: str, args: dict[int, tuple[Any, ...]]) -> dict[int, Any | WorkerLost]:
        pending = {w: getattr(self._actors[w], name).remote(*a) for w, a in args.items() if w in self._actors}
        out = self._gather(pending)
        out.update({w: WorkerLost(w, f"worker {w} was lost before") for w in args if w not in pending})
        return out

    def _gather(self, pending: dict[int, Any]) -> dict[int, Any | WorkerLost]:
        ray = self.ray
        out: dict[int, Any | WorkerLost] = {}
        for w, ref in pending.items():
            try:
                out[w] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
                reason = f"worker {w} (Ray actor) died: {first}"
                log.warning("%s", reason)
                self._actors.pop(w, None)
                out[w] = WorkerLost(w, reason)
            except ray.exceptions.RayTaskError as exc:
                raise FedgeError(f"worker {w} failed: {exc}") from exc
        return out

    def describe(self) -> dict[str, Any]:
        return {"ray": {"version": self.ray.__version__, "address": self.sim.address or "local",
                        "started_here": self._started_ray, "init_s": round(self.init_seconds, 3),
                        "actors_s": round(self.start_seconds, 3), "cluster": self.resources,
                        "num_cpus": self.sim.num_cpus, "num_gpus": self.sim.num_gpus}}

    def close(self) -> None:
        ray = self.ray
        for a in self._actors.values():
            try:
                ray.kill(a)
            except Exception as exc:  # an actor already gone
                log.debug("ray.kill: %s", exc)
        self._actors.clear()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
