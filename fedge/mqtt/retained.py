"""The coordinator's retained messages — the round descriptor and each global state — and what to
publish again after a reconnection.

A broker that restarted may have lost every retained message (all of them without persistence, the
latest ones with it), so after each reconnection the coordinator publishes every global state again,
then the round descriptor under a fresh message id, which tells devices that already answered this
round to send their cached update again (in asynchronous mode: the devices whose task it still lists, told by
the descriptor's ``recovery`` flag). This module decides *what* to publish, in which order; the
transport (:mod:`fedge.mqtt.coordinator_transport`) publishes it. No paho, no broker and no lock (the
transport holds its own around every call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedge.common.inmemory import RECOVERY_KEY, descriptor_tasks
from fedge.common.messages import Message
from fedge.errors import PayloadError
from fedge.mqtt.chunking import chunk_frames
from fedge.mqtt.topics import FleetTopics

Publish = tuple[str, bytes]
"""(topic, payload) of one retained publish."""


@dataclass(frozen=True)
class GlobalUpdate:
    """What publishing one global state takes: ``publish`` in order, then delete ``clear`` (empty payloads)."""

    publish: list[Publish]
    clear: list[str]


@dataclass(frozen=True)
class Republish:
    """What to publish after a reconnection: every global state, then the re-announced round descriptor."""

    globals: list[Publish]
    round: bytes | None
    """The current round descriptor under a fresh message id (None: no round, or an unreadable one)."""
    round_number: int | None
    tasks: dict[str, int] | None = None
    """Asynchronous mode: the outstanding tasks (device -> version) the re-announced descriptor lists."""


class RetainedState:
    """The retained state a coordinator has published: the round descriptor and each artifact's messages."""

    def __init__(self, topics: FleetTopics, chunk_bytes: int) -> None:
        self.topics = topics
        self.chunk_bytes = chunk_bytes
        self.round: bytes | None = None
        self._published: dict[str, list[Publish]] = {}  # artifact -> (topic, payload) to republish
        self._parts: dict[str, int] = {}  # artifact -> number of retained part topics in use

    def set_round(self, data: bytes | None) -> None:
        """The round descriptor just announced (None: deleted at the end of a run)."""
        self.round = data

    def set_global(self, artifact: str, data: bytes,
                   seal: Callable[[str, bytes], bytes] | None = None) -> GlobalUpdate:
        """Remember ``artifact``'s new global state (republished after every reconnection from now on) and
        say what publishing it takes: the whole message, or its parts first and the chunk manifest last
        (a device that sees the new manifest finds every part); and the part topics a previous, longer
        version used, to be cleared. ``seal(topic, payload)`` signs what goes on the artifact's own topic —
        the whole message, or the manifest, which carries the whole message's sha256 (protocol section 11)."""
        root = self.topics.global_(artifact)
        seal = seal or (lambda topic, payload: payload)
        if len(data) <= self.chunk_bytes:
            items = [(root, seal(root, data))]
        else:
            manifest, frames = chunk_frames(data, self.chunk_bytes)
            items = [(self.topics.global_part(artifact, i), f) for i, f in enumerate(frames)]
            items.append((root, seal(root, manifest)))
        new_parts = len(items) - 1
        self._published[artifact] = items
        clear = [self.topics.global_part(artifact, i) for i in range(new_parts, self._parts.get(artifact, 0))]
        self._parts[artifact] = new_parts
        return GlobalUpdate(items, clear)

    def after_reconnect(self) -> Republish:
        """Every global state as last published, and the round descriptor under a fresh message id (which
        becomes the current one)."""
        published = [item for items in self._published.values() for item in items]
        if self.round is None:
            return Republish(published, None, None)
        try:
            msg = Message.from_bytes(self.round)
        except PayloadError:
            return Republish(published, None, None)
        msg.msg_id = Message("round", msg.sender, msg.round).msg_id
        tasks = descriptor_tasks(msg.info)
        if tasks is not None:  # asynchronous mode: within one session only this flag makes devices resend
            msg.info[RECOVERY_KEY] = True
        self.round = msg.to_bytes()
        return Republish(published, self.round, msg.round, tasks)
