"""In-memory twin of the MQTT transport: retained topics and an update queue in one process.

Devices are stepped synchronously by the coordinator's ``collect`` (through a
``pump`` callback), so a simulated round is deterministic: devices run in
registration order, then the engine aggregates.

It keeps the MQTT transport's contract (``tests/test_transport_contract.py``
runs the same tests over both): the descriptor and global state are retained
(a device sees the latest), updates are delivered whole and in the order sent,
duplicates are delivered (the engine refuses them), and a device that already
answered a round sends its update again when that round is re-announced under a
new message id (a resumed coordinator), exactly as over MQTT. In asynchronous mode
(``round.assigned``) the test is the task: a device sends its update again when a
descriptor from a new coordinator process (``session``) still lists the task it
answered (the process that got it died before accepting it).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from fedge.common.messages import Message
from fedge.common.tensorcodec import read_header
from fedge.common.transport import CoordinatorTransport, DeviceTransport, Inbound
from fedge.errors import PayloadError

log = logging.getLogger(__name__)


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

    def end_run(self) -> None:
        self.bus.round_msg = None

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


def _descriptor_key(raw: bytes) -> tuple[str, tuple[str, int]] | None:
    """(message id, (run, round)) of a round descriptor, or None if it is not one."""
    try:
        msg = Message.from_bytes(raw)
        return msg.msg_id, (str(msg.info.get("run", "")), int(msg.round))
    except (PayloadError, ValueError, TypeError):
        return None


def descriptor_tasks(info: Mapping[str, Any]) -> dict[str, int] | None:
    """A round descriptor's ``round.assigned`` (asynchronous mode: device -> task), None if it has none."""
    rnd = info.get("round")
    assigned = rnd.get("assigned") if isinstance(rnd, dict) else None
    if not isinstance(assigned, dict):
        return None
    return {str(k): v for k, v in assigned.items() if isinstance(v, int)}


# The flag (true) in the info of a descriptor the coordinator re-announced after reconnecting to the broker
# (fedge.mqtt.retained): a device whose task it still lists cannot know whether its update reached the coordinator
# (a broker that crashed may have acknowledged it and lost it), so it sends its cached update again; a copy that
# had arrived is refused as a replay. The other announcements of a version (new tasks handed out) do not carry it.
RECOVERY_KEY = "recovery"

AsyncAnswer = tuple[str, str, str, int]  # (run, session, device, task) an asynchronous update answered


def async_answer(info: Mapping[str, Any], device: str) -> AsyncAnswer | None:
    """What an update sent now answers, from the current descriptor's info (None: no task of ``device``)."""
    tasks = descriptor_tasks(info)
    if not tasks or device not in tasks:
        return None
    return str(info.get("run", "")), str(info.get("session", "")), device, tasks[device]


def resend_async(answered: AsyncAnswer | None, info: Mapping[str, Any]) -> bool:
    """Whether a device's cached asynchronous update must be sent again on a new descriptor (its ``info``) of the
    same run that still lists the task the update answered: one from a new coordinator process (``session``: the
    old one died before accepting it), or one the coordinator re-announced after reconnecting to the broker
    (``recovery``: a broker that crashed may have acknowledged the update and lost it). Otherwise, within one
    process, a listed task is only an update on its way."""
    if answered is None:
        return False
    run, session, device, task = answered
    tasks = descriptor_tasks(info)
    return (tasks is not None and str(info.get("run", "")) == run and tasks.get(device) == task
            and (str(info.get("session", "")) != session or info.get(RECOVERY_KEY) is True))


class InMemoryDeviceTransport(DeviceTransport):
    def __init__(self, bus: InMemoryBus) -> None:
        self.bus = bus
        self._seen_id: str | None = None  # message id of the last descriptor seen
        # ((run, round), descriptor id it answered, message): resent when that round is re-announced
        self._last_update: tuple[tuple[str, int], str, bytes] | None = None
        self._last_task: AsyncAnswer | None = None  # asynchronous mode: what the last update answered

    def send_hello(self, data: bytes) -> None:
        self.bus.hellos.append(data)

    def current_round(self) -> bytes | None:
        raw = self.bus.round_msg
        if raw is not None:
            key = _descriptor_key(raw)
            if key is not None and key[0] != self._seen_id:
                self._seen_id = key[0]
                last = self._last_update
                info = Message.from_bytes(raw).info
                if descriptor_tasks(info) is not None:
                    if last is not None and resend_async(self._last_task, info):
                        log.info("the coordinator still lists the task answered; sending the cached update again")
                        self.bus.updates.append(last[2])
                elif last is not None and last[0] == key[1] and last[1] != key[0]:
                    log.info("round %d was re-announced; sending the cached update again", key[1][1])
                    self._last_update = (last[0], key[0], last[2])
                    self.bus.updates.append(last[2])
        return raw

    def fetch_global(self, artifact: str) -> bytes | None:
        return self.bus.globals.get(artifact)

    def send_update(self, data: bytes) -> None:
        raw = self.bus.round_msg
        key = _descriptor_key(raw) if raw is not None else None
        try:
            rnd = int(read_header(data)[1].get("round", "-1"))
        except (PayloadError, ValueError):
            rnd = -1
        if key is not None and key[1][1] == rnd:
            self._last_update = (key[1], key[0], data)
            assert raw is not None
            self._last_task = async_answer(Message.from_bytes(raw).info, read_header(data)[1].get("sender", ""))
        self.bus.updates.append(data)
