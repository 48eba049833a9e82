"""What a parallel simulation's worker pool is (issue 30): the interface the process and Ray backends implement."""

from __future__ import annotations

import copyreg
import io
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fedge.edge.data.datasets import Dataset
from fedge.sim.worker import HostSpec


def _proxy(d: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(d)


def _reduce_proxy(m: MappingProxyType[Any, Any]) -> tuple[Any, tuple[dict[Any, Any]]]:
    return _proxy, (dict(m),)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled with the standard pickler, read-only mappings (profiles, plans) included."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = {**copyreg.dispatch_table, MappingProxyType: _reduce_proxy}
    p.dump(obj)
    return buf.getvalue()


@dataclass(frozen=True)
class WorkerLost:
    """A worker that stopped answering: it died (or its Ray actor did); ``reason`` says how."""

    worker: int
    reason: str


class WorkerPool(ABC):
    """Workers each hosting a :class:`~fedge.sim.worker.DeviceHost`; calls run on all of them at once."""

    kind: str
    start_seconds: float  # from asking for the workers to every device built

    def spawn(self, workers: int) -> None:  # noqa: B027 (optional: doing nothing is a valid implementation)
        """Start ``workers`` workers ahead of :meth:`start`, so their interpreters start and import torch
        while the driver loads the data (a backend that cannot may do nothing here)."""

    @abstractmethod
    def start(self, specs: list[HostSpec], global_test: Dataset | None) -> dict[int, Any | WorkerLost]:
        """Build each spec's devices in its worker (started here unless :meth:`spawn` did)."""

    @abstractmethod
    def broadcast(self, name: str, *args: Any) -> dict[int, Any | WorkerLost]:
        """``DeviceHost.<name>(*args)`` on every live worker in parallel (``args`` shipped once where the
        backend allows): each worker's result, or :class:`WorkerLost`."""

    @abstractmethod
    def call_each(self, name: str, args: dict[int, tuple[Any, ...]]) -> dict[int, Any | WorkerLost]:
        """``DeviceHost.<name>(*args[w])`` on each worker ``w`` of ``args`` in parallel, each with its own
        arguments (a rebalance's device states): each one's result, or :class:`WorkerLost`."""

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
