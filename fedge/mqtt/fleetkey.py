"""The fleet key's rotations on the wire: a device follows the retained key chain on ``fedge/{fleet}/keys/fleet``.

The chain (:mod:`fedge.common.keyrotation`) is published retained by the coordinator on every connection and
by ``fedge deploy``; a device subscribes to it on its one connection (:meth:`MqttClient.route`, as the OTA
updates do), follows it through :class:`~fedge.common.keyrotation.FleetKeyTrust`, and then asks the broker for
every retained message again (:meth:`MqttClient.resubscribe`): a round descriptor or global state signed with
the new key that arrived before the chain was refused as ``key`` and now verifies.
"""

from __future__ import annotations

import logging

from fedge.common.keyrotation import FleetKeyTrust
from fedge.common.signing import SignatureError
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.settings import TransportStats
from fedge.mqtt.topics import FleetTopics

log = logging.getLogger(__name__)

REJECT_PREFIX = "key-chain:"  # refused chains are counted as "key-chain:<reason>" beside the signed state's reasons


class KeyChainFollower:
    """Follows the fleet's key chain on a device's connection; refusals counted in ``stats.rejected``."""

    def __init__(self, client: MqttClient, topics: FleetTopics, trust: FleetKeyTrust, device_id: str,
                 stats: TransportStats | None = None) -> None:
        self.client = client
        self.topics = topics
        self.trust = trust
        self.device_id = device_id
        self.stats = stats if stats is not None else TransportStats()
        self.rotations = 0  # chains that moved this device to a newer key
        client.route(topics.fleet_keys, self._on_chain)
        client.subscribe(topics.fleet_keys)

    def _on_chain(self, m: Received) -> None:
        if m.topic != self.topics.fleet_keys or not m.payload:
            return  # an empty payload deletes the retained chain: nothing to follow
        try:
            changed = self.trust.accept(m.payload)
        except SignatureError as exc:
            reason = REJECT_PREFIX + exc.reason
            self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
            log.warning("%s: refused the key chain on %s: %s (still trusting key %s)", self.device_id, m.topic,
                        exc.message, self.trust.current)
            return
        except OSError as exc:  # the state directory: the key is not switched unless it is persisted
            log.error("%s: could not persist the rotated fleet key: %s (still trusting key %s)", self.device_id,
                      exc, self.trust.current)
            return
        if changed:
            self.rotations += 1
            self.client.resubscribe()  # what the new key signed and came first was refused: deliver it again
