"""The coordinator's side of the transport interface (:mod:`fedge.common.transport`) over MQTT.

The engine sees exactly what it sees in-process: encoded message bytes. This module adds what a real
network needs: topics (:mod:`.topics`), reassembly of chunked updates (:mod:`.chunking`), the devices'
online/offline statuses believed only when no outage of our own connection explains them
(:mod:`.status_book`), and the retained round descriptor and global state, published again after a
reconnection (:mod:`.retained`; see ``docs/protocol.md``, "Recovery").
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterator, Mapping

from fedge.common.health import MAX_HEALTH_BYTES
from fedge.common.signing import Signer
from fedge.common.transport import CoordinatorTransport, Inbound
from fedge.errors import TransportError
from fedge.mqtt.chunking import Reassembler
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.inbound import InboundClassifier, RefusalLog
from fedge.mqtt.retained import RetainedState
from fedge.mqtt.settings import MAX_QUEUED_HEALTH, TransportSettings, TransportStats
from fedge.mqtt.status_book import StatusBook
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics, check_name

log = logging.getLogger(__name__)


class MqttCoordinatorTransport(CoordinatorTransport):
    """Coordinator side over MQTT.

    Uses a persistent session (``clean_session=False``, fixed client id) so QoS 1
    updates sent while the coordinator restarts are queued by the broker and
    delivered when it is back; duplicates that this produces are rejected by the
    engine by (sender, round) and message id.

    Broker restarts: a broker that shuts down publishes every device's last-will
    (and, with persistence, keeps those ``offline`` statuses), so a status that
    arrived around an outage of the coordinator's own connection is not believed
    until ``status_grace_s`` after the reconnection (see :meth:`offline`). Publishes
    wait for the broker across the outage, at most ``publish_timeout_s``.
    """

    realtime = True  # updates come over the network, on the wall clock: the engine's auto timeouts apply
    stages = True  # secure aggregation's stage messages: devices/{id}/secagg in, secagg/{id} out

    def __init__(self, broker: BrokerSettings, fleet: str, settings: TransportSettings | None = None, *,
                 client_id: str | None = None, signer: Signer | None = None, updates: bool = True,
                 key_chain: bytes | None = None) -> None:
        self.topics = FleetTopics(fleet)
        # The fleet key's rotations (fedge.common.keyrotation), published retained before anything signed with the
        # newest key, on every connection: devices that trust an older key follow it to the signer's.
        self.key_chain = key_chain
        # With a signer, every round descriptor, global state and refusal is published as a signed frame
        # (fedge.common.signing; docs/protocol.md section 11): a chunked global state through its manifest, which
        # carries the whole message's sha256. The retained book keeps the unsigned round descriptor (it
        # re-announces it under a fresh id) and the signed global state (republished as is).
        self.signer = signer
        self.settings = settings or TransportSettings()
        self.stats = TransportStats()
        self._updates: queue.Queue[Inbound] = queue.Queue()
        self._hellos: list[Inbound] = []
        self._hello_from: set[str] = set()  # every device a hello ever came from
        # Heartbeats for the monitor (fedge.observe.monitor), bounded: the oldest go first.
        self._health: collections.deque[Inbound] = collections.deque(maxlen=MAX_QUEUED_HEALTH)
        self.health_dropped = 0  # heartbeats dropped unread (queue full) or oversize
        # For people, not for decisions: each device's latest status as received (believed or not) and the
        # last time anything came from it, in unix seconds. Plain dict stores: atomic under the GIL.
        self._statuses: dict[str, tuple[bool, float]] = {}
        self._last_seen: dict[str, float] = {}
        self._book = StatusBook(self.settings.offline_confirm_s, self.settings.status_grace_s)  # under _cond
        self._cond = threading.Condition()
        # hellos, updates and partials: sizes, retained copies, chunks (refusals counted in stats.rejected)
        self.inbound = InboundClassifier(RefusalLog(f"coordinator of {fleet!r}", self.stats),
                                         Reassembler(self.settings.max_message_bytes))
        self._retained = RetainedState(self.topics, self.settings.chunk_bytes)  # under _lock
        self._lock = threading.Lock()
        self.client = MqttClient(broker, client_id or f"fedge-coordinator-{fleet}", clean_session=False,
                                 on_message=self._on_message, on_connect=self._on_connect,
                                 on_disconnect=self._on_disconnect)
        # Refusals retained on the broker (by this process or an earlier one), so that accepting a device clears
        # only a refusal that is there: clearing for every newcomer costs a message per device (20,000 at the
        # start of a 20,000-device fleet, each forwarded by every relay). First in the one SUBSCRIBE sent on
        # connect, so the broker queues these retained messages before any hello.
        self._refusals: set[str] = set()
        self.client.subscribe(self.topics.refused_filter)
        self.client.subscribe(self.topics.device_filter("status"))
        self.client.subscribe(self.topics.device_filter("hello"))
        # Partial aggregates of aggregation workers and relays (fedge.coordinator.merge) ...
        self.client.subscribe(self.topics.partial_filter)
        # ... and the devices' updates, unless aggregation workers read them (a shared subscription).
        self.updates = updates
        if updates:
            self.client.subscribe(self.topics.device_filter("update"))
        self.client.subscribe(self.topics.device_filter("health"))
        # Secure aggregation's stage messages (fedge.coordinator.secure): read here, whoever reads the updates.
        self.client.subscribe(self.topics.device_filter("secagg"))
        self.client.subscribe(self.topics.relay_secagg_filter)  # ... and relays' sums of their masked inputs

    def start(self) -> MqttCoordinatorTransport:
        self.client.start(self.settings.connect_timeout_s)
        if self.key_chain is not None:
            pub = self.client.publish(self.topics.fleet_keys, self.key_chain, retain=True)
            self.client.require_published([pub], self.settings.publish_timeout_s, "publishing the fleet's key chain")
        log.info("%s", self.describe())
        return self

    def describe(self) -> str:
        """One line for people starting devices: the broker, the fleet and its topics."""
        t = self.topics
        return (f"fleet {t.fleet!r} on {self.client.settings.url}: devices publish to {t.base}/devices/ID/"
                f"{{status,hello,update,health}} and read {t.round} and {t.base}/global/#")

    # -- inbound (dispatcher thread) -----------------------------------------------------
    def _on_message(self, m: Received) -> None:
        t = self.topics.parse_device(m.topic)
        if t is None:
            account = self.topics.parse_partial(m.topic)
            if account is not None and m.payload:
                self._on_partial(account, m)
            relay = self.topics.parse_relay_secagg(m.topic)
            if relay is not None and m.payload:  # a relay's sum of masked inputs (fedge.secagg.partial)
                self.stats.messages_in += 1
                self.stats.bytes_in += len(m.payload)
                self._upload(relay, m, "secagg-sum")
            refused = self.topics.parse_refused(m.topic)
            # Only a retained copy (sent on subscribing) tells what the broker holds; our own refusals come back
            # live, and are already known (refuse()), possibly older than a clear sent since.
            if refused is not None and m.payload and m.retain:
                self._refusals.add(refused)
            return
        self.stats.messages_in += 1
        self.stats.bytes_in += len(m.payload)
        # A retained copy says nothing about when the device was last there, and an `offline` is usually
        # its last-will, which the broker sends for it after it is gone.
        if m.payload and not m.retain and m.payload != STATUS_OFFLINE:
            self._last_seen[t.device_id] = m.received
        if t.kind == "health":
            if not m.payload:
                return
            if m.retain:
                self._clear_stray(m, "health record")
                return
            if len(m.payload) > MAX_HEALTH_BYTES:
                self.health_dropped += 1
                self._health.append(Inbound(b"", t.device_id, m.received,
                                            reject=("oversize", f"a {len(m.payload)}-byte health message")))
                return
            if len(self._health) == self._health.maxlen:
                self.health_dropped += 1
            self._health.append(Inbound(m.payload, t.device_id, m.received))
            return
        if t.kind == "status":
            if m.payload in (STATUS_ONLINE, STATUS_OFFLINE):
                self._statuses[t.device_id] = (m.payload == STATUS_ONLINE, m.received)
                with self._cond:
                    self._book.record(t.device_id, m.payload == STATUS_ONLINE)
                    self._cond.notify_all()
            elif m.payload and m.retain:
                self._clear_stray(m, "status")
            return
        if t.kind == "hello":
            hello = self.inbound.hello(t.device_id, m.payload, m.received)
            if hello is not None:
                with self._cond:
                    self._hellos.append(hello)
                    self._hello_from.add(t.device_id)
                    self._cond.notify_all()
            return
        self._upload(t.device_id, m, "secagg" if t.kind == "secagg" else "update")

    def _on_partial(self, account: str, m: Received) -> None:
        """A worker's or relay's partial aggregate (chunked when large), for the engine's merger."""
        self.stats.messages_in += 1
        self.stats.bytes_in += len(m.payload)
        self._upload(account, m, "partial")

    def _upload(self, source: str, m: Received, kind: str) -> None:
        """An update or a partial: a whole message or a chunk frame, for the engine (a refusal too: it is
        counted in the round's report). A retained one is deleted: the protocol never retains them."""
        item = self.inbound.upload(source, m.payload, m.retain, m.received, kind=kind)
        if item is not None and item.reject is not None and item.reject[0] == "retained":
            self.client.publish(m.topic, b"", retain=True)  # the ACL cannot forbid the retain flag
        if item is not None:
            self._updates.put(item)

    def _clear_stray(self, m: Received, what: str) -> None:
        """Delete a retained message the protocol does not allow (the ACL cannot forbid the retain flag)."""
        log.warning("deleting a stray retained %s (%d bytes) on %s", what, len(m.payload), m.topic)
        self.client.publish(m.topic, b"", retain=True)

    def _on_disconnect(self) -> None:
        with self._cond:
            self._book.connection_lost()

    def _on_connect(self, session_present: bool) -> None:
        with self._cond:
            self._book.connection_back()
            self._cond.notify_all()
        # Not on the first connection: nothing was lost yet, and its handler can run after start()
        # returned and the first round was announced (the dispatcher thread is late under load);
        # re-announcing then would tell every device to resend for no reason.
        if self.client.connects <= 1:
            return
        # After a reconnect the broker may have restarted and lost every retained message:
        # publish the key chain and the globals again, then the round descriptor under a fresh message id.
        if self.key_chain is not None:
            self.client.publish(self.topics.fleet_keys, self.key_chain, retain=True)
        with self._lock:
            again = self._retained.after_reconnect()
        for topic, payload in again.globals:
            self.client.publish(topic, payload, retain=True)
        if again.round is not None:
            self.client.publish(self.topics.round, self._seal(self.topics.round, again.round), retain=True)
            # a warning, as the lost connection was: the operator sees the recovery beside the outage
            if again.tasks is None:
                log.warning("re-announced round %d after reconnecting", again.round_number)
            else:  # asynchronous mode: the devices it lists send their update again, or train if they never had it
                log.warning("re-announced version %d after reconnecting (session present: %s), with the %d outstanding "
                         "task(s) of %s", again.round_number, session_present, len(again.tasks),
                         ", ".join(sorted(again.tasks)) or "nobody")

    def _seal(self, topic: str, data: bytes) -> bytes:
        """``data`` signed for ``topic`` when this coordinator signs, else as it is."""
        return data if self.signer is None else self.signer.seal(topic, data)

    # -- CoordinatorTransport -----------------------------------------------------------
    def announce_round(self, data: bytes) -> None:
        with self._lock:
            self._retained.set_round(data)
        signed = self._seal(self.topics.round, data)
        pub = self.client.publish(self.topics.round, signed, retain=True)
        self.stats.count_out(len(signed))
        self.client.require_published([pub], self.settings.publish_timeout_s, "announcing the round")

    def end_run(self) -> None:
        """Delete the retained round descriptor: a device that starts before the next run's coordinator
        then waits for it instead of answering this run's final round."""
        with self._lock:
            self._retained.set_round(None)
        pub = self.client.publish(self.topics.round, b"", retain=True)
        self.client.require_published([pub], self.settings.publish_timeout_s, "clearing the round descriptor")

    def publish_global(self, artifact: str, data: bytes) -> None:
        check_name(artifact, "artifact name")
        with self._lock:  # remembered before publishing: a reconnect meanwhile republishes it
            # signed: the payload of the artifact's own topic (the message, or the manifest of its chunks)
            update = self._retained.set_global(artifact, data, self._seal if self.signer is not None else None)
        pubs = [self.client.publish(t, p, retain=True) for t, p in update.publish]
        # A zero-length retained message deletes: the part topics a previous (longer) version used.
        pubs += [self.client.publish(t, b"", retain=True) for t in update.clear]
        for _, p in update.publish:
            self.stats.count_out(len(p))
        self.client.require_published(pubs, self.settings.publish_timeout_s, f"publishing global {artifact!r}")

    def send_stages(self, messages: Mapping[str, bytes]) -> None:
        """Each device's stage message on its own ``secagg/{id}`` topic (QoS 1, never retained; signed when this
        coordinator signs), all published before waiting for the broker's acknowledgements."""
        pubs = []
        for device_id, data in messages.items():
            topic = self.topics.secagg_to(device_id)
            payload = self._seal(topic, data)
            pubs.append(self.client.publish(topic, payload))
            self.stats.count_out(len(payload))
        self.client.require_published(pubs, self.settings.publish_timeout_s, "sending secure-aggregation stages")

    def hellos(self) -> list[Inbound]:
        with self._cond:
            out, self._hellos = self._hellos, []
        return out

    def refuse(self, device_id: str, data: bytes | None) -> None:
        """Tell a device why it was refused (a retained ``refused`` message on its own topic), or clear that
        (``None``) once it is accepted — if one is retained: one this process sent, or one the broker handed
        over on subscribing (an earlier process's). Not awaited: the device reads it whenever it is connected."""
        topic = self.topics.refused(device_id)
        if not data:
            if device_id not in self._refusals:
                return  # nothing retained to clear
            self._refusals.discard(device_id)
        else:
            self._refusals.add(device_id)
        self.client.publish(topic, self._seal(topic, data) if data else b"", retain=True)

    def offline(self) -> set[str]:
        """Devices whose latest status is a believable ``offline`` (:class:`~fedge.mqtt.status_book.StatusBook`).

        An ``offline`` counts once it is ``offline_confirm_s`` old, unless it arrived around an outage
        of our own connection (from ``offline_confirm_s`` before it began until ``status_grace_s``
        after it ended): a broker that shuts down publishes every device's last-will first, so those
        count only once the grace period is over and the device has not come back.
        """
        with self._cond:
            return self._book.offline()

    def online(self) -> set[str]:
        """Devices whose latest status is ``online``."""
        with self._cond:
            return self._book.online()

    def health(self) -> list[Inbound]:
        """Heartbeats received since the last call (at most :data:`MAX_QUEUED_HEALTH`; older ones dropped)."""
        out = []
        while True:
            try:
                out.append(self._health.popleft())
            except IndexError:
                return out

    def statuses(self) -> dict[str, tuple[bool, float]]:
        return dict(self._statuses)

    def last_seen(self) -> dict[str, float]:
        return dict(self._last_seen)

    def connections(self) -> int:
        return self.client.connects

    def wait_for_devices(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait(timeout_s)

    def wait_for_hellos(self, device_ids: Collection[str], timeout_s: float) -> None:
        """Block until every id in ``device_ids`` has said hello (without consuming the hellos)."""
        want = set(device_ids)
        with self._cond:
            if not self._cond.wait_for(lambda: want <= self._hello_from, timeout_s):
                missing = sorted(want - self._hello_from)
                raise TransportError(f"no hello from {len(missing)} device(s) after {timeout_s:.0f} s: "
                                     f"{', '.join(missing[:5])}")

    def collect(self, round: int, expected: Collection[str], deadline: float) -> Iterator[Inbound]:
        next_expiry = time.monotonic() + 5.0
        while True:
            now = time.time()
            if deadline and now >= deadline:
                return
            if self._updates.empty():
                with self._cond:  # stops at the first expected device online: no O(N) set per empty queue
                    gone = self._book.all_offline(expected)
                if gone:
                    return  # everyone expected has answered or is gone
            wait = min(0.25, deadline - now) if deadline else 0.25
            try:
                item = self._updates.get(timeout=max(wait, 0.001))
            except queue.Empty:
                item = None
            if time.monotonic() > next_expiry:
                next_expiry = time.monotonic() + 5.0
                yield from self.inbound.expired()
            if item is not None:
                yield item

    def close(self) -> None:
        self.client.stop()
