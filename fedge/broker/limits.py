"""Broker limits derived from a fleet: the largest message it sends and what the broker must queue.

Mosquitto bounds three things per client: the size of one MQTT packet
(``max_packet_size``: a larger packet disconnects its sender), and the number and
bytes of QoS 1 messages it queues for a client that is offline or slow
(``max_queued_messages``, ``max_queued_bytes``: beyond them, messages are
dropped). fedge chunks every message above the chunk size, so one packet is at
most a chunk plus its frame header, topic and MQTT header; the queues must hold
what the coordinator's persistent session collects while it restarts: every
device's update (twice: a device resends its cached update when a round is
re-announced) plus a few small status and hello messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedge.common.archs import TIERS, arch_by_name
from fedge.errors import ConfigError
from fedge.fleet.registry import method_entry
from fedge.mqtt.chunking import MAX_FRAME_HEADER

# Headroom on one packet: MQTT fixed header + topic (< 300 bytes) + a chunk frame header (<= 4096
# bytes), rounded up generously.
PACKET_OVERHEAD = 16 * 1024
# The largest message that is never chunked: hellos and round descriptors (~1-2 KB in practice; the
# coordinator refuses hellos above 1 MiB, so this also bounds how much a device can store retained).
SMALL_MESSAGE_BYTES = 64 * 1024
# Envelope + safetensors header of an update on top of its tensors' bytes.
ENVELOPE_BYTES = 64 * 1024
# Messages a device has queued for the coordinator besides its update's frames: status, hello, a spare.
SMALL_PER_DEVICE = 4


def largest_model_bytes(archs: list[str | None], *, embed_dim: int = 64, family_params: int | None = None) -> int:
    """fp32 bytes of the largest model among ``archs`` (None: the planner picks, so the largest tier).
    ``family_params``: the largest tier's parameters of a ``[model] family`` other than the GeFL CNNs
    (measured; its devices' ``archs`` then name its tiers)."""
    if family_params is not None:
        return family_params * 4
    names = [a if a else f"tier-{TIERS[-1]}" for a in archs] or [f"tier-{TIERS[-1]}"]
    # the fleet's embedding size applies to the size tiers; a cnnK keeps its own (or its -pN suffix)
    return max(arch_by_name(n, embed_dim=embed_dim if n.startswith("tier-") else None).num_params() * 4
               for n in names)


def largest_message_bytes(archs: list[str | None], method: str, *, embed_dim: int = 64,
                          family_params: int | None = None) -> int:
    """The largest update (or global state) a fleet of ``archs`` running ``method`` sends, at fp32.

    Every method's update is at most the device's whole model (FedAvg); generative
    methods (their settings say ``generative``: GeFL, GeFL-F, FedVTC) also carry a
    generator, counted as a second model. Statistics methods (FedProto) send far
    less. This is a bound, not an estimate: the broker and the coordinator refuse
    what exceeds it (with headroom). An unknown ``method`` is a :class:`ConfigError`.
    """
    model = largest_model_bytes(archs, embed_dim=embed_dim, family_params=family_params)
    factor = 2 if method_entry(method).settings.generative else 1
    return factor * model + ENVELOPE_BYTES


@dataclass(frozen=True)
class QueueLimits:
    """What ``mosquitto.conf`` gets: packet size and per-client queue bounds."""

    max_packet_size: int
    max_queued_messages: int
    max_queued_bytes: int
    max_inflight_messages: int = 100


def queue_limits(devices: int, largest_message: int, chunk_bytes: int, *, headroom: float = 2.0) -> QueueLimits:
    """Limits for a fleet of ``devices`` whose largest message is ``largest_message`` bytes."""
    if devices < 1:
        raise ConfigError("a fleet needs at least one device")
    if chunk_bytes < 1024:
        raise ConfigError(f"chunk size {chunk_bytes} is too small (minimum 1024 bytes)")
    if largest_message < 1:
        raise ConfigError(f"largest message {largest_message} must be > 0")
    packet = max(min(largest_message, chunk_bytes), SMALL_MESSAGE_BYTES) + MAX_FRAME_HEADER + PACKET_OVERHEAD
    frames = -(-largest_message // chunk_bytes)
    per_device_msgs = frames + SMALL_PER_DEVICE
    per_device_bytes = largest_message + frames * (MAX_FRAME_HEADER + 512) + SMALL_PER_DEVICE * SMALL_MESSAGE_BYTES
    return QueueLimits(
        max_packet_size=packet,
        max_queued_messages=max(1000, int(headroom * devices * per_device_msgs)),
        max_queued_bytes=int(headroom * devices * per_device_bytes),
    )
