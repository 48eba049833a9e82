"""The fleet config's tables for ``fedge simulate`` only: ``[clock]`` (the virtual clock) and ``[simulation]``
(where the devices' local work runs); each a frozen dataclass that checks itself."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.errors import ConfigError

AVAILABILITIES = ("always", "onoff", "trace")


@dataclass(frozen=True)
class ClockSection:
    """``[clock]``: the virtual clock of ``fedge simulate`` (issue 27; docs/simulation.md, "The virtual clock").

    Each device's time in a round is the speed model's compute time for its training plus the bytes it
    downloads and uploads over its profile's link (half its round-trip time each way), times a seeded
    jitter; a device is online per ``availability``; a synchronous round lasts until its slowest
    participant delivers, or ``deadline_s``.
    """

    jitter: float = 0.0
    """σ of a mean-one lognormal factor drawn per device, round and part (compute, down, up); 0: none."""
    availability: str = "always"
    """``always``; ``onoff`` (exponential online / offline spells of the means below); ``trace`` (a CSV file)."""
    online_mean_s: float = 3600.0
    offline_mean_s: float = 0.0
    trace: str = ""
    """``availability = "trace"``: CSV ``device,online_from,online_to`` (virtual seconds), relative to this file."""
    deadline_s: float = 0.0
    """Virtual seconds a round waits; an update that would arrive later is lost (0: wait for every participant)."""
    seed: int | None = None
    """Seed of the jitter and the on/off spells (default: ``[run] seed``)."""

    def __post_init__(self) -> None:
        if not (0 <= self.jitter <= 3):
            raise ConfigError(f"[clock] jitter = {self.jitter:g}: must be between 0 and 3",
                              hint="σ of the lognormal jitter factor, e.g. 0.1 for ~10 % spread; 0 for none")
        if self.availability not in AVAILABILITIES:
            raise ConfigError(f"[clock] availability = {self.availability!r}: unknown model",
                              hint=f"use one of {', '.join(repr(a) for a in AVAILABILITIES)}")
        if not (self.online_mean_s > 0 and self.online_mean_s < float("inf")):
            raise ConfigError(f"[clock] online_mean_s = {self.online_mean_s:g}: must be a positive number of seconds",
                              hint="the mean length of a device's online spell, e.g. 3600")
        if not (0 <= self.offline_mean_s < float("inf")):
            raise ConfigError(f"[clock] offline_mean_s = {self.offline_mean_s:g}: must be >= 0 seconds",
                              hint="the mean length of an offline spell (0: never offline)")
        if self.availability == "trace" and not self.trace:
            raise ConfigError('[clock] availability = "trace" needs trace = "FILE.csv"',
                              hint="a CSV with the header device,online_from,online_to (docs/simulation.md)")
        if self.trace and self.availability != "trace":
            raise ConfigError(f"[clock] trace = {self.trace!r} is set but availability = {self.availability!r}",
                              hint='set availability = "trace" to use it, or remove trace')
        if not (0 <= self.deadline_s < float("inf")):
            raise ConfigError(f"[clock] deadline_s = {self.deadline_s:g}: must be >= 0 seconds",
                              hint="virtual seconds a round waits for its participants; 0: no deadline")


BACKENDS = ("sequential", "process", "ray")


@dataclass(frozen=True)
class SimulationSection:
    """Where ``fedge simulate`` runs the devices' local work (issue 30; docs/simulation.md, "Backends").

    ``sequential``: every device in this process, one after another. ``process``: ``workers`` worker
    processes on this machine. ``ray``: ``workers`` Ray actors, each reserving ``num_cpus`` CPUs and
    ``num_gpus`` GPUs (a fraction shares one GPU), on a local Ray or the cluster at ``address``. Each
    worker holds its devices for the whole run and trains them one at a time, so a device's resources
    are its worker's. ``threads``: torch intra-op threads per worker (default 1 for process workers,
    ``num_cpus`` for Ray actors, torch's own choice for sequential runs).
    """

    backend: str = "sequential"
    workers: int | None = None
    threads: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    address: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend = {self.backend!r} is not a simulation backend",
                              hint=f"set backend to one of {', '.join(repr(b) for b in BACKENDS)}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers = {self.workers}: a simulation needs at least one worker",
                              hint="set workers = 2 (one per core), or leave it out for one per available CPU")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads = {self.threads}: each worker needs at least one torch thread",
                              hint="set threads = 1 (bit-identical to any other backend at 1 thread)")
        if self.num_cpus <= 0:
            raise ConfigError(f"num_cpus = {self.num_cpus} must be > 0", hint="set num_cpus = 1 (one core per worker)")
        if self.num_gpus < 0:
            raise ConfigError(f"num_gpus = {self.num_gpus} must be >= 0",
                              hint="set num_gpus = 0 (CPU only) or a share such as 0.5")
        ray_only = [k for k, v, default in (("num_cpus", self.num_cpus, 1.0), ("num_gpus", self.num_gpus, 0.0),
                                            ("address", self.address, None)) if v != default]
        if ray_only and self.backend != "ray":
            raise ConfigError(f"{ray_only[0]} applies to the ray backend, not backend = {self.backend!r}",
                              hint=f'set backend = "ray", or remove {ray_only[0]}')

    @property
    def parallel(self) -> bool:
        """Whether devices train outside the driver process."""
        return self.backend != "sequential"
