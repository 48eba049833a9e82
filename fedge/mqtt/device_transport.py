"""The device's side of the transport interface (:mod:`fedge.common.transport`) over MQTT.

The agent sees exactly what it sees in-process: encoded message bytes. This module adds what a real
network needs: topics (:mod:`.topics`), chunked updates and reassembled global state
(:mod:`.chunking`), the device's online/offline status with a last-will, a retained hello for late
joiners, and recovery after a reconnect: the cached update sent again when the coordinator
re-announces a round (see ``docs/protocol.md``, "Recovery").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fedge.common import boundedjson
from fedge.common.inmemory import AsyncAnswer, async_answer, descriptor_tasks, resend_async
from fedge.common.messages import Message
from fedge.common.signing import SignatureError, Verifier
from fedge.common.tensorcodec import read_header
from fedge.common.transport import DeviceTransport
from fedge.errors import PayloadError, TransportError
from fedge.mqtt.chunking import RetainedAssembler, split
from fedge.mqtt.client import MqttClient, Received, Will
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.settings import MAX_HELLO_BYTES, TransportSettings, TransportStats
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics, check_name

log = logging.getLogger(__name__)

MAX_RESEND_BYTES = 1024  # a relay's resend request: {"descriptor": msg id, "id": request id}


class MqttDeviceTransport(DeviceTransport):
    """Device side over MQTT: status + last-will, retained hello, round descriptor, globals, updates.

    Global state is subscribed to on demand (a device downloads only the
    artifacts its method asks for), and :meth:`fetch_global` waits for exactly
    the version the current round descriptor names.
    """

    def __init__(self, broker: BrokerSettings, fleet: str, device_id: str,
                 settings: TransportSettings | None = None, *, client_id: str | None = None,
                 verifier: Verifier | None = None) -> None:
        self.topics = FleetTopics(fleet)
        # With a verifier (the fleet key from the bundle), round descriptors, global state and refusals are
        # accepted only signed by the fleet key, for the topic they came on, and not older than the newest
        # accepted there; the rest is refused, counted in stats.rejected and logged.
        self.verifier = verifier
        self.device_id = check_name(device_id, "device id")
        self.settings = settings or TransportSettings()
        self.stats = TransportStats()
        self._cond = threading.Condition()
        self._round_raw: bytes | None = None
        self._round_id: str | None = None  # msg id of the current descriptor
        self._round_key: tuple[str, int] | None = None  # (run, round) of the current descriptor
        self._want: dict[str, int] | None = None  # artifact -> round of the version the round starts from
        self._globals: dict[str, tuple[int, bytes]] = {}  # artifact -> (its round, message bytes)
        self._assemblers: dict[str, RetainedAssembler] = {}
        self._hello: bytes | None = None
        # Whether _on_connect ran for the current connection: until it has, it publishes the hello itself,
        # so send_hello must not (a race that sent two hellos).
        self._hello_lock = threading.Lock()
        self._announced = False
        # Last update: ((run, round), descriptor id it answered, message) — sent again when the
        # coordinator re-announces the same round (it restarted or the broker lost it).
        self._last_update: tuple[tuple[str, int], str | None, bytes] | None = None
        # Asynchronous mode: the current descriptor's info, and what the last update answered: it is sent again
        # when a new coordinator process still lists that task (fedge.common.inmemory.resend_async).
        self._round_info: dict[str, Any] = {}
        self._last_task: AsyncAnswer | None = None
        # Relay resend requests (_on_resend): the id of the latest one received, and of the latest one that no
        # longer concerns the cached update (received before it was sent, or acted on already).
        self._resend_latest: str | None = None
        self._resend_seen: str | None = None
        self.refusal: bytes | None = None  # the coordinator's latest `refused` message for this device
        self.refusal_text: str | None = None  # ... in words ("slot: ..."), for the device's health record
        self.changes = 0  # descriptor changes received
        self._changes_read = 0  # ... as of the last current_round() call
        self.client = MqttClient(broker, client_id or f"fedge-{fleet}-{device_id}", clean_session=True,
                                 will=Will(self.topics.status(device_id), STATUS_OFFLINE),
                                 on_message=self._on_message, on_connect=self._on_connect,
                                 on_disconnect=self._on_disconnect)
        self.client.subscribe(self.topics.round)
        self.client.subscribe(self.topics.refused(device_id))
        self.client.subscribe(self.topics.resend)

    def start(self, wait: bool = True) -> MqttDeviceTransport:
        """Connect (in the background; with ``wait``, until the first connection or a clear error)."""
        self.client.start(self.settings.connect_timeout_s if wait else None)
        return self

    # -- dispatcher thread -------------------------------------------------------------
    def _on_connect(self, session_present: bool) -> None:
        with self._hello_lock:
            self.client.publish(self.topics.status(self.device_id), STATUS_ONLINE, retain=True)
            if self._hello is not None:
                self.client.publish(self.topics.hello(self.device_id), self._hello, retain=True)
            self._announced = True

    def _on_disconnect(self) -> None:
        with self._hello_lock:
            self._announced = False

    def _opened(self, topic: str, data: bytes) -> bytes | None:
        """The message inside a signed frame when this device verifies (None: refused, counted, logged)."""
        if self.verifier is None or not data:
            return data
        try:
            return self.verifier.open(topic, data)
        except SignatureError as exc:
            self.stats.rejected[exc.reason] = self.stats.rejected.get(exc.reason, 0) + 1
            log.warning("%s: refused a message on %s: %s", self.device_id, topic, exc.message)
            return None

    def _on_message(self, m: Received) -> None:
        self.stats.messages_in += 1
        self.stats.bytes_in += len(m.payload)
        if m.topic == self.topics.round:
            raw = self._opened(m.topic, m.payload)
            if raw is not None:
                self._on_round(raw)
            return
        if m.topic == self.topics.resend:
            self._on_resend(m.payload)
            return
        if m.topic == self.topics.refused(self.device_id):
            raw = self._opened(m.topic, m.payload)
            if raw is not None:
                self._on_refused(raw)
            return
        g = self.topics.parse_global(m.topic)
        if g is None:
            return
        asm = self._assemblers.setdefault(g.artifact, RetainedAssembler(self.settings.max_message_bytes))
        try:
            if g.part is None:
                # Verified here: the whole message, or the manifest whose sha256 the reassembled parts must match.
                root = self._opened(m.topic, m.payload) if m.payload else None
                if root is None:
                    return
                whole = asm.on_root(root)
            else:
                whole = asm.on_part(m.payload)
            if whole is None:
                return
            _, meta = read_header(whole)
            rnd = int(meta.get("round", "-1"))
        except (PayloadError, ValueError) as exc:
            log.warning("%s: ignored global state on %s: %s", self.device_id, m.topic, exc)
            return
        with self._cond:
            self._globals[g.artifact] = (rnd, whole)
            self._cond.notify_all()

    def _on_refused(self, raw: bytes) -> None:
        self.refusal = raw or None
        if not raw:
            self.refusal_text = None
            return
        try:
            msg = Message.from_bytes(raw, max_bytes=MAX_HELLO_BYTES)
            reason, text = msg.info.get("reason", "?"), msg.info.get("message", "")
        except (PayloadError, AttributeError) as exc:
            log.warning("%s: the coordinator refused this device (unreadable reason: %s)", self.device_id, exc)
            self.refusal_text = "refused by the coordinator (unreadable reason)"
            return
        log.error("%s: the coordinator refused this device: %s: %s", self.device_id, reason, text)
        self.refusal_text = f"refused by the coordinator: {reason}: {text}"

    def _on_round(self, raw: bytes) -> None:
        if not raw:
            return
        try:
            msg = Message.from_bytes(raw, max_bytes=MAX_HELLO_BYTES)
            run = str(msg.info.get("run", ""))
            want = msg.info.get("globals")
            key = (run, int(msg.round))
        except (PayloadError, ValueError, TypeError) as exc:
            log.warning("%s: ignored a bad round descriptor: %s", self.device_id, exc)
            return
        resend: bytes | None = None
        with self._cond:
            if msg.msg_id == self._round_id:
                return  # the same descriptor again (retained redelivery after a reconnect)
            if self._outdated_task(key, msg.info):
                log.info("%s: ignored an older descriptor of version %d (a restarted broker's retained copy)",
                         self.device_id, key[1])
                return
            self._round_raw, self._round_id, self._round_key = raw, msg.msg_id, key
            self._want = {str(k): int(v) for k, v in want.items()} if isinstance(want, dict) else None
            self._round_info = msg.info
            last = self._last_update
            if descriptor_tasks(msg.info) is not None:
                if last is not None and resend_async(self._last_task, msg.info):
                    resend = last[2]
            elif last is not None and last[0] == key and last[1] != msg.msg_id:
                resend = last[2]
                self._last_update = (key, msg.msg_id, last[2])
            self.changes += 1
            self._cond.notify_all()
        if resend is not None:
            log.info("%s: %s %d was re-announced; sending the cached update again", self.device_id,
                     "version" if self._last_task is not None else "round", key[1])
            self._send_again(resend)

    def _outdated_task(self, key: tuple[str, int], info: dict[str, Any]) -> bool:
        """Asynchronous mode: whether a descriptor of the run this device follows is older than what it has seen —
        an earlier version, or a task of this device older than the one its last update answered. A broker
        restarted after a crash hands its retained copy from its last autosave over before the coordinator
        re-announces; training on it would only make an update the coordinator refuses (called under _cond)."""
        tasks = descriptor_tasks(info)
        if tasks is None or self._round_key is None or key[0] != self._round_key[0]:
            return False
        if key[1] < self._round_key[1]:
            return True
        answered, mine = self._last_task, tasks.get(self.device_id)
        return answered is not None and answered[0] == key[0] and mine is not None and mine < answered[3]

    def _on_resend(self, raw: bytes) -> None:
        """A relay asks for the cached update again (it restarted, or its shard's broker did). A relay forwards
        the coordinator's round descriptor byte for byte — it holds no fleet key, so it could not re-announce a
        signed round under a new id — and asks with this instead (docs/protocol.md sections 8 and 13). It is
        not signed and needs not be: it only makes this device repeat, once per request id, the update it
        already sent for the descriptor the request names; a copy counted before is refused as a duplicate.
        It is retained, so a device that was away when the relay asked gets it on reconnecting; one the device
        had received before sending its update (again on every reconnection) is not for that update."""
        if not raw:
            return
        try:
            req = boundedjson.loads(raw, max_bytes=MAX_RESEND_BYTES, max_depth=1, what="resend request")
            descriptor, req_id = req["descriptor"], req["id"]
            if not isinstance(descriptor, str) or not isinstance(req_id, str):
                raise TypeError("descriptor and id must be strings")
        except (PayloadError, KeyError, TypeError) as exc:
            log.warning("%s: ignored a bad resend request: %s", self.device_id, exc)
            return
        with self._cond:
            self._resend_latest = req_id
            last = self._last_update
            if req_id == self._resend_seen or last is None or last[1] != descriptor:
                return
            self._resend_seen = req_id
            data = last[2]
        log.info("%s: the relay asked again for round %d's update; sending the cached update", self.device_id,
                 last[0][1])
        self._send_again(data)

    def _send_again(self, data: bytes) -> None:
        # Split again: a fresh transfer id, since the coordinator ignores repeats of a finished transfer.
        for frame in split(data, self.settings.chunk_bytes):
            self.client.publish(self.topics.update(self.device_id), frame)
            self.stats.count_out(len(frame))

    # -- DeviceTransport ---------------------------------------------------------------
    def send_hello(self, data: bytes) -> None:
        """Publish the hello (retained) now if connected, and again after every reconnection."""
        with self._hello_lock:
            self._hello = data
            if self._announced:
                self.client.publish(self.topics.hello(self.device_id), data, retain=True)
        self.stats.count_out(len(data))

    def current_round(self) -> bytes | None:
        with self._cond:
            self._changes_read = self.changes
            return self._round_raw

    @property
    def run_id(self) -> str | None:
        """Run id of the current round descriptor (changes when a new run starts)."""
        with self._cond:
            return self._round_key[0] if self._round_key else None

    def wait_for_round(self, timeout_s: float) -> bool:
        """Wait until a descriptor arrives that :meth:`current_round` has not returned yet."""
        with self._cond:
            return self._cond.wait_for(lambda: self.changes != self._changes_read, timeout_s)

    def fetch_global(self, artifact: str) -> bytes | None:
        with self._cond:
            want = self._want
        if want is not None and artifact not in want:
            return None  # the coordinator has not published this artifact yet
        self.client.subscribe(self.topics.global_filter(artifact))
        end = time.monotonic() + (self.settings.global_timeout_s if want is not None else 2.0)
        with self._cond:
            while True:
                have = self._globals.get(artifact)
                need = self._want.get(artifact) if self._want is not None else None
                if have is not None and (need is None or have[0] == need):
                    return have[1]
                remaining = end - time.monotonic()
                if remaining <= 0:
                    if need is None:
                        return have[1] if have else None
                    raise TransportError(
                        f"{self.device_id}: global state {artifact!r} of round {need} did not arrive within "
                        f"{self.settings.global_timeout_s:.0f} s (have round {have[0] if have else None})",
                        hint="check the connection to the broker and its message_size_limit",
                    )
                self._cond.wait(min(remaining, 0.5))

    def send_update(self, data: bytes) -> None:
        frames = split(data, self.settings.chunk_bytes)
        with self._cond:
            key, rid, info = self._round_key, self._round_id, self._round_info
        try:
            rnd = int(read_header(data)[1].get("round", "-1"))
        except (PayloadError, ValueError):
            rnd = -1
        if key is not None and key[1] == rnd:
            self._last_update = (key, rid, data)
            self._last_task = async_answer(info, self.device_id)
            self._resend_seen = self._resend_latest  # requests received so far do not concern this update
        pubs = [self.client.publish(self.topics.update(self.device_id), f) for f in frames]
        for f in frames:
            self.stats.count_out(len(f))
        # Wait across a broker restart (paho resends after the reconnect). Not raising after the timeout:
        # the round is done (a retry would train again); the message stays queued, and the coordinator's
        # re-announcement of the round makes this device send its cached copy again.
        if not self.client.wait_published(pubs, self.settings.publish_timeout_s):
            log.warning("%s: update not acknowledged within %.0f s; it stays queued and is resent after the "
                        "reconnect", self.device_id, self.settings.publish_timeout_s)

    def send_health(self, data: bytes) -> None:
        """Publish a heartbeat at QoS 0, not retained: one lost or sent while disconnected is dropped, not
        queued (a burst of stale heartbeats after a reconnection would say nothing the next one does not)."""
        self.client.publish(self.topics.health(self.device_id), data, qos=0)
        self.stats.count_out(len(data))

    def close(self) -> None:
        """Disconnect cleanly, marking this device offline (the last-will is for crashes)."""
        self.client.stop(final=(self.topics.status(self.device_id), STATUS_OFFLINE))

    def abort(self) -> None:
        """Vanish like a crashed device: no DISCONNECT, so the broker publishes the last-will."""
        self.client.abort()
