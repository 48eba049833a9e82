"""What a parallel simulation's worker pool is (issue 30): the interface the process and Ray backends implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from fedge.edge.data.datasets import Dataset
from fedge.sim.worker import HostSpec


@dataclass(frozen=True)
class WorkerLost:
    """A worker that stopped answering: it died (or its Ray actor did); ``reason`` says how."""

    worker: int
    reason: str


class WorkerPool(ABC):
    """Workers each hosting a :class:`~fedge.sim.worker.DeviceHost`; calls run on all of them at once."""

    kind: str
    start_seconds: float  # from asking for the workers to every device built

    @abstractmethod
    def start(self, specs: list[HostSpec], global_test: Dataset | None) -> dict[int, Any | WorkerLost]:
        """Start one worker per spec and build its devices."""

    @abstractmethod
    def broadcast(self, name: str, *args: Any) -> dict[int, Any | WorkerLost]:
        """``DeviceHost.<name>(*args)`` on every live worker in parallel (``args`` shipped once where the
        backend allows): each worker's result, or :class:`WorkerLost`."""

    @property
    @abstractmethod
    def live(self) -> list[int]:
        """Workers still answering."""

    def describe(self) -> dict[str, Any]:
        """Backend facts for ``results.json`` (start-up costs ...)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop the workers (and whatever the pool started)."""
