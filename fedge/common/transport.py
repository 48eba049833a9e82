"""The transport interface between the round engine and device agents.

Two implementations: :mod:`fedge.common.inmemory` (one process, used by
``fedge simulate``) and the MQTT transport. The engine, the agent and every
method see only these classes, so a method runs unchanged over either; all
payloads are already-encoded bytes (see :mod:`fedge.common.messages`), which is
what makes the in-process byte counts the real wire sizes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from fedge.errors import TransportError


@dataclass(frozen=True)
class Inbound:
    """One message a coordinator transport received from a device.

    ``origin`` is the device id the transport vouches for (over MQTT: the
    ``devices/{id}/`` topic level, which the broker ACL ties to the device's
    credentials), or None when the transport cannot tell (in-process). The engine
    rejects an update whose envelope sender differs from its origin.
    ``reject`` = (reason, message) marks a payload the transport itself refused
    (a bad chunk checksum, an oversize transfer ...); the engine only counts it.
    ``kind`` is ``update`` (a device's update), ``partial`` (an aggregation worker's or a
    relay's partial aggregate, ``origin`` then being that aggregator's account; see
    :mod:`fedge.coordinator.partial`), ``secagg`` (a device's secure-aggregation stage message,
    :mod:`fedge.coordinator.secure`) or ``secagg-sum`` (a relay's sum of its devices' masked inputs,
    :mod:`fedge.secagg.partial`, ``origin`` being the relay's account).
    """

    data: bytes
    origin: str | None = None
    received: float = 0.0  # unix seconds; 0 = unknown
    reject: tuple[str, str] | None = None
    kind: str = "update"


class CoordinatorTransport(ABC):
    """Coordinator side: announce rounds, publish global state, receive hellos and updates."""

    # Whether updates arrive on the wall clock over a network that can lose them (MQTT). Only then does the
    # engine's default ("auto") round and task timeout apply: in-process transports deliver every update, and a
    # simulator's virtual time is not the wall clock (fedge.coordinator.engine.RoundEngine.task_timeout_s).
    realtime: bool = False

    @abstractmethod
    def announce_round(self, data: bytes) -> None:
        """Publish the (retained) round descriptor message."""

    @abstractmethod
    def publish_global(self, artifact: str, data: bytes) -> None:
        """Publish (retained) global state ``artifact``."""

    @abstractmethod
    def hellos(self) -> list[Inbound]:
        """Hello messages received since the last call."""

    @abstractmethod
    def collect(self, round: int, expected: Collection[str], deadline: float) -> Iterator[Inbound]:
        """Yield received update messages until no id in ``expected`` is still awaited or
        ``deadline`` (unix seconds; 0 = none) passes.

        ``expected`` is live: the engine removes a device from it as soon as that
        device's update was accepted, so the transport can stop when it is empty (or
        when every id left in it is known to be offline). Implementations yield
        every message they receive; the engine validates them.

        The early return: the engine may stop reading before the iterator ends (it
        closes it, as ``break`` does). Asynchronous mode's version loop does so once its
        buffer is full, or when a refusal ended a device's task (that device gets a new
        task at once), and then calls ``collect`` again. Nothing received is lost by
        that: every message is yielded exactly once, in the order received, the
        messages not yet yielded first by the next call. A ``collect`` that yields
        nothing says there is nothing to wait for (every expected device answered, is
        offline or, in-process, has nothing more to send); the version loop then
        withdraws the tasks it waited on. ``tests/test_transport_contract.py`` holds
        every transport to this.
        """

    def offline(self) -> set[str]:
        """Ids of devices known to be offline (e.g. by their last-will); default: none known."""
        return set()

    def health(self) -> list[Inbound]:
        """Health messages (heartbeats) received since the last call; default: none (in-process)."""
        return []

    def statuses(self) -> dict[str, tuple[bool, float]]:
        """Each device's latest status as received: id -> (online, unix seconds); default: none known.

        Unlike :meth:`offline` this is what the devices (or their last-wills) said, believed or not:
        what an operator is shown."""
        return {}

    def last_seen(self) -> dict[str, float]:
        """Unix seconds of the last message of any kind from each device; default: none known."""
        return {}

    def connections(self) -> int:
        """Connections to the broker so far: 1 + reconnections (in-process: always 1). The fleet monitor says what
        the coordinator waits for after each reconnection (fedge.observe.monitor)."""
        return 1

    def refuse(self, device_id: str, data: bytes | None) -> None:  # noqa: B027 - optional hook
        """Tell ``device_id`` why its hello was refused (a ``refused`` message), or clear that with None."""

    # Whether it carries secure aggregation's stage messages: the devices' arrive from ``collect`` as kind
    # ``secagg``, the coordinator's leave with :meth:`send_stages` (fedge.coordinator.secure).
    stages: bool = False

    def send_stages(self, messages: Mapping[str, bytes]) -> None:
        """Send each device its secure-aggregation stage message (device id -> bytes)."""
        raise TransportError(f"{type(self).__name__} carries no secure-aggregation stage messages",
                             hint="run [privacy] secure_aggregation over MQTT or in `fedge simulate`")

    def end_run(self) -> None:  # noqa: B027 - optional hook
        """The run is over (after its final round): withdraw the round descriptor, so a device that
        starts before the next run waits for it instead of answering this run's rounds."""

    def wait_for_devices(self, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Block up to ``timeout_s`` for new hellos or status changes (default: return at once)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


class DeviceTransport(ABC):
    """Device side: announce, follow rounds, fetch global state, upload."""

    @abstractmethod
    def send_hello(self, data: bytes) -> None:
        """Announce this device (profile, plan, architecture)."""

    @abstractmethod
    def current_round(self) -> bytes | None:
        """The latest round descriptor message, or None if none was announced yet."""

    @abstractmethod
    def fetch_global(self, artifact: str) -> bytes | None:
        """The latest retained global state ``artifact``, or None."""

    @abstractmethod
    def send_update(self, data: bytes) -> None:
        """Upload this device's update for the current round."""

    def send_health(self, data: bytes) -> None:  # noqa: B027 - optional hook
        """Publish a health message (a heartbeat; may be lost: the next one replaces it). Default: dropped."""

    def send_stage(self, data: bytes) -> None:
        """Send the coordinator one secure-aggregation stage message (fedge.edge.secure)."""
        raise TransportError(f"{type(self).__name__} carries no secure-aggregation stage messages")

    def receive_stage(self, timeout_s: float) -> bytes | None:
        """The coordinator's next stage message for this device, waiting up to ``timeout_s`` (None: none came)."""
        raise TransportError(f"{type(self).__name__} carries no secure-aggregation stage messages")

    def clear_stages(self) -> None:  # noqa: B027 - optional hook
        """Drop stage messages received so far (left from an earlier round)."""

    def wait_for_round(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a new round descriptor may be available.

        Returns whether something changed; the default (polling) just sleeps a little.
        """
        time.sleep(min(timeout_s, 0.05))
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
