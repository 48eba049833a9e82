"""The transport interface between the round engine and device agents.

Two implementations: :mod:`fedge.common.inmemory` (one process, used by
``fedge simulate``) and the MQTT transport. The engine, the agent and every
method see only these classes, so a method runs unchanged over either; all
payloads are already-encoded bytes (see :mod:`fedge.common.messages`), which is
what makes the in-process byte counts the real wire sizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator


class CoordinatorTransport(ABC):
    """Coordinator side: announce rounds, publish global state, receive hellos and updates."""

    @abstractmethod
    def announce_round(self, data: bytes) -> None:
        """Publish the (retained) round descriptor message."""

    @abstractmethod
    def publish_global(self, artifact: str, data: bytes) -> None:
        """Publish (retained) global state ``artifact``."""

    @abstractmethod
    def hellos(self) -> list[bytes]:
        """Hello messages received since the last call."""

    @abstractmethod
    def collect(self, round: int, expected: Collection[str], deadline: float) -> Iterator[bytes]:
        """Yield raw update messages until every id in ``expected`` has sent one for
        ``round`` or ``deadline`` (unix seconds; 0 = wait for all) passes.

        Implementations yield every message they receive; the engine validates them.
        """

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

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
