"""What both MQTT transports share: their protocol settings, their counters and the size limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedge.mqtt.chunking import DEFAULT_CHUNK_BYTES

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_HELLO_BYTES = 1 << 20
# Health messages waiting for the coordinator's monitor; beyond it the oldest are dropped (and counted):
# a heartbeat is replaced by the next one, and a flood must not grow the coordinator's memory.
MAX_QUEUED_HEALTH = 10_000


@dataclass(frozen=True)
class TransportSettings:
    """Protocol knobs shared by both sides."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # messages above this travel in chunks
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger transfers are refused
    global_timeout_s: float = 120.0  # device: how long to wait for the global state a round names
    connect_timeout_s: float = 30.0
    # How long a publish may wait for the broker's acknowledgement, reconnections included; the
    # coordinator's announce_round/publish_global raise TransportError after it.
    publish_timeout_s: float = 120.0
    # Coordinator: an `offline` status counts only once it is this old and the coordinator's own
    # connection stayed up around it (a broker shutting down sends every device's last-will just
    # before it drops the coordinator) ...
    offline_confirm_s: float = 1.0
    # ... and statuses that arrived around a broker outage count only this long after the
    # reconnection, once devices have had time to reconnect (their back-off reaches 30 s).
    status_grace_s: float = 30.0


@dataclass
class TransportStats:
    """Counters for logs and benchmarks."""

    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def count_out(self, n: int) -> None:
        """One message of ``n`` bytes sent."""
        self.messages_out += 1
        self.bytes_out += n
