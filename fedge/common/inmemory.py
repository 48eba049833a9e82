"""In-memory twin of the MQTT transport: retained topics and an update queue in one process.

Devices are stepped synchronously by the coordinator's ``collect`` (through a
``pump`` callback), so a simulated round is deterministic: devices run in
registration order, then the engine aggregates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator

from fedge.common.transport import CoordinatorTransport, DeviceTransport, Inbound


class InMemoryBus:
    """Shared state: retained round descriptor and globals, queued hellos and updates."""

    def __init__(self) -> None:
        self.round_msg: bytes | None = None
        self.globals: dict[str, bytes] = {}
        self.hellos: deque[bytes] = deque()
        self.updates: deque[bytes] = deque()
        self.refusals: dict[str, bytes] = {}  # device id -> the coordinator's latest refusal of its hello
        self.pump: Callable[[], None] | None = None


class InMemoryCoordinatorTransport(CoordinatorTransport):
    def __init__(self, bus: InMemoryBus) -> None:
        self.bus = bus

    def announce_round(self, data: bytes) -> None:
        self.bus.round_msg = data

    def publish_global(self, artifact: str, data: bytes) -> None:
        self.bus.globals[artifact] = data

    def refuse(self, device_id: str, data: bytes | None) -> None:
        if data is None:
            self.bus.refusals.pop(device_id, None)
        else:
            self.bus.refusals[device_id] = data

    def hellos(self) -> list[Inbound]:
        out = [Inbound(h) for h in self.bus.hellos]
        self.bus.hellos.clear()
        return out

    def collect(self, round: int, expected: Collection[str], deadline: float) -> Iterator[Inbound]:
        if self.bus.pump is not None:
            self.bus.pump()
        while self.bus.updates:
            yield Inbound(self.bus.updates.popleft())


class InMemoryDeviceTransport(DeviceTransport):
    def __init__(self, bus: InMemoryBus) -> None:
        self.bus = bus

    def send_hello(self, data: bytes) -> None:
        self.bus.hellos.append(data)

    def current_round(self) -> bytes | None:
        return self.bus.round_msg

    def fetch_global(self, artifact: str) -> bytes | None:
        return self.bus.globals.get(artifact)

    def send_update(self, data: bytes) -> None:
        self.bus.updates.append(data)
