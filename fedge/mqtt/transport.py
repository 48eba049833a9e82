"""The MQTT implementation of the transport interface (:mod:`fedge.common.transport`).

The engine and the agent see exactly what they see in-process: encoded message
bytes. This module adds what a real network needs: topics (:mod:`.topics`),
chunking with checksums (:mod:`.chunking`), the device's online/offline status
with a last-will, retained state for late joiners, and recovery after a
reconnect (see ``docs/protocol.md``, "Recovery").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from fedge.common.messages import Message
from fedge.common.tensorcodec import read_header
from fedge.common.transport import CoordinatorTransport, DeviceTransport, Inbound
from fedge.errors import PayloadError, TransportError
from fedge.mqtt.chunking import (
    DEFAULT_CHUNK_BYTES,
    ChunkError,
    Reassembler,
    RetainedAssembler,
    chunk_frames,
    frame_kind,
    split,
)
from fedge.mqtt.client import BrokerSettings, MqttClient, Received, Will
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics, check_name

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_HELLO_BYTES = 1 << 20


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

    def __init__(self, broker: BrokerSettings, fleet: str, settings: TransportSettings | None = None, *,
                 client_id: str | None = None) -> None:
        self.topics = FleetTopics(fleet)
        self.settings = settings or TransportSettings()
        self.stats = TransportStats()
        self._updates: queue.Queue[Inbound] = queue.Queue()
        self._hellos: list[Inbound] = []
        self._hello_from: set[str] = set()  # every device a hello ever came from
        self._status: dict[str, tuple[bool, float]] = {}  # device id -> (online, monotonic time received)
        # Recent outages of our own connection: [start, end] monotonic, end None while it lasts (a list:
        # a second drop soon after a reconnection must not make the first one's last-wills believable).
        self._outages: list[list[float | None]] = []
        self._cond = threading.Condition()
        self._reasm = Reassembler(self.settings.max_message_bytes)
        self._round_msg: bytes | None = None
        self._published: dict[str, list[tuple[str, bytes]]] = {}  # artifact -> (topic, payload) to republish
        self._parts: dict[str, int] = {}  # artifact -> number of retained part topics in use
        self._lock = threading.Lock()
        self.client = MqttClient(broker, client_id or f"fedge-coordinator-{fleet}", clean_session=False,
                                 on_message=self._on_message, on_connect=self._on_connect,
                                 on_disconnect=self._on_disconnect)
        self.client.subscribe(self.topics.device_filter("status"))
        self.client.subscribe(self.topics.device_filter("hello"))
        self.client.subscribe(self.topics.device_filter("update"))

    def start(self) -> MqttCoordinatorTransport:
        self.client.start(self.settings.connect_timeout_s)
        log.info("%s", self.describe())
        return self

    def describe(self) -> str:
        """One line for people starting devices: the broker, the fleet and its topics."""
        t = self.topics
        return (f"fleet {t.fleet!r} on {self.client.settings.url}: devices publish to {t.base}/devices/ID/"
                f"{{status,hello,update}} and read {t.round} and {t.base}/global/#")

    # -- inbound (dispatcher thread) -----------------------------------------------------
    def _on_message(self, m: Received) -> None:
        t = self.topics.parse_device(m.topic)
        if t is None:
            return
        self.stats.messages_in += 1
        self.stats.bytes_in += len(m.payload)
        if t.kind == "status":
            if m.payload in (STATUS_ONLINE, STATUS_OFFLINE):
                with self._cond:
                    self._status[t.device_id] = (m.payload == STATUS_ONLINE, time.monotonic())
                    self._cond.notify_all()
            elif m.payload and m.retain:
                self._clear_stray(m, "status")
            return
        if t.kind == "hello":
            if not m.payload:
                return  # a cleared retained hello
            if len(m.payload) > MAX_HELLO_BYTES:
                log.warning("ignored a %d-byte hello on %s", len(m.payload), m.topic)
                return
            with self._cond:
                self._hellos.append(Inbound(m.payload, t.device_id, m.received))
                self._hello_from.add(t.device_id)
                self._cond.notify_all()
            return
        # update: a whole message or a chunk frame; never retained by the protocol, never empty (an
        # empty payload is a retained message's deletion, e.g. ours echoed back)
        if not m.payload:
            return
        if m.retain:
            self._clear_stray(m, "update")
            self._updates.put(Inbound(b"", t.device_id, m.received,
                                      reject=("retained", f"{t.device_id} left a retained update on the broker "
                                                          "(deleted)")))
            return
        if frame_kind(m.payload) == "message":
            self._updates.put(Inbound(m.payload, t.device_id, m.received))
            return
        try:
            whole = self._reasm.add(t.device_id, m.payload)
        except ChunkError as exc:
            self._updates.put(Inbound(b"", t.device_id, m.received, reject=(exc.reason, exc.message)))
            return
        if whole is not None:
            self._updates.put(Inbound(whole, t.device_id, m.received))

    def _clear_stray(self, m: Received, what: str) -> None:
        """Delete a retained message the protocol does not allow (the ACL cannot forbid the retain flag)."""
        log.warning("deleting a stray retained %s (%d bytes) on %s", what, len(m.payload), m.topic)
        self.client.publish(m.topic, b"", retain=True)

    def _on_disconnect(self) -> None:
        with self._cond:
            now = time.monotonic()
            grace = self.settings.status_grace_s
            self._outages = [o for o in self._outages if o[1] is None or o[1] + grace > now]
            if not self._outages or self._outages[-1][1] is not None:
                self._outages.append([now, None])

    def _on_connect(self, session_present: bool) -> None:
        with self._cond:
            if self._outages and self._outages[-1][1] is None:
                self._outages[-1][1] = time.monotonic()
            self._cond.notify_all()
        # After a reconnect the broker may have restarted and lost every retained message:
        # publish the globals again, then the round descriptor under a fresh message id, which
        # tells devices that already answered this round to send their cached update again.
        with self._lock:
            published = [item for items in self._published.values() for item in items]
            round_msg = self._round_msg
        # Not on the first connection: nothing was lost yet, and its handler can run after start()
        # returned and the first round was announced (the dispatcher thread is late under load);
        # re-announcing then would tell every device to resend for no reason.
        if self.client.connects <= 1:
            return
        for topic, payload in published:
            self.client.publish(topic, payload, retain=True)
        if round_msg is not None:
            try:
                msg = Message.from_bytes(round_msg)
            except PayloadError:
                return
            msg.msg_id = Message("round", msg.sender, msg.round).msg_id
            fresh = msg.to_bytes()
            with self._lock:
                self._round_msg = fresh
            self.client.publish(self.topics.round, fresh, retain=True)
            log.info("re-announced round %d after reconnecting", msg.round)

    # -- CoordinatorTransport -----------------------------------------------------------
    def announce_round(self, data: bytes) -> None:
        with self._lock:
            self._round_msg = data
        pub = self.client.publish(self.topics.round, data, retain=True)
        self._count_out(len(data))
        self.client.require_published([pub], self.settings.publish_timeout_s, "announcing the round")

    def end_run(self) -> None:
        """Delete the retained round descriptor: a device that starts before the next run's coordinator
        then waits for it instead of answering this run's final round."""
        with self._lock:
            self._round_msg = None
        pub = self.client.publish(self.topics.round, b"", retain=True)
        self.client.require_published([pub], self.settings.publish_timeout_s, "clearing the round descriptor")

    def publish_global(self, artifact: str, data: bytes) -> None:
        check_name(artifact, "artifact name")
        root = self.topics.global_(artifact)
        if len(data) <= self.settings.chunk_bytes:
            items = [(root, data)]
        else:
            manifest, frames = chunk_frames(data, self.settings.chunk_bytes)
            # parts first, the manifest last: a device that sees the new manifest finds every part
            items = [(self.topics.global_part(artifact, i), f) for i, f in enumerate(frames)] + [(root, manifest)]
        new_parts = len(items) - 1
        with self._lock:
            self._published[artifact] = items  # before publishing: a reconnect meanwhile republishes it
        pubs = [self.client.publish(t, p, retain=True) for t, p in items]
        # Clear part topics the previous (longer) version used: a zero-length retained message deletes.
        pubs += [self.client.publish(self.topics.global_part(artifact, i), b"", retain=True)
                 for i in range(new_parts, self._parts.get(artifact, 0))]
        self._parts[artifact] = new_parts
        for _, p in items:
            self._count_out(len(p))
        self.client.require_published(pubs, self.settings.publish_timeout_s, f"publishing global {artifact!r}")

    def hellos(self) -> list[Inbound]:
        with self._cond:
            out, self._hellos = self._hellos, []
        return out

    def refuse(self, device_id: str, data: bytes | None) -> None:
        """Tell a device why it was refused (a retained ``refused`` message on its own topic), or clear that
        (``None``) once it is accepted. Not awaited: the device reads it whenever it is connected."""
        self.client.publish(self.topics.refused(device_id), data or b"", retain=True)

    def offline(self) -> set[str]:
        """Devices whose latest status is a believable ``offline``.

        An ``offline`` counts once it is ``offline_confirm_s`` old, unless it arrived around an outage
        of our own connection (from ``offline_confirm_s`` before it began until ``status_grace_s``
        after it ended): a broker that shuts down publishes every device's last-will first, so those
        count only once the grace period is over and the device has not come back.
        """
        now = time.monotonic()
        s = self.settings
        with self._cond:
            # (from, to) windows still in force: [start - confirm, end + grace] while now < end + grace
            windows = []
            for start, end in self._outages:
                assert start is not None
                to = float("inf") if end is None else end + s.status_grace_s
                if now < to:
                    windows.append((start - s.offline_confirm_s, to))
            return {d for d, (up, at) in self._status.items()
                    if not up and now - at >= s.offline_confirm_s
                    and not any(lo <= at <= hi for lo, hi in windows)}

    def online(self) -> set[str]:
        """Devices whose latest status is ``online``."""
        with self._cond:
            return {d for d, (up, _) in self._status.items() if up}

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
                offline = self.offline()
                if all(d in offline for d in expected):
                    return  # everyone expected has answered or is gone
            wait = min(0.25, deadline - now) if deadline else 0.25
            try:
                item = self._updates.get(timeout=max(wait, 0.001))
            except queue.Empty:
                item = None
            if time.monotonic() > next_expiry:
                next_expiry = time.monotonic() + 5.0
                for src, tid in self._reasm.expire():
                    yield Inbound(b"", src, time.time(), reject=("incomplete", f"transfer {tid[:8]} from {src} "
                                                                               "never completed"))
            if item is not None:
                yield item

    def close(self) -> None:
        self.client.stop()

    def _count_out(self, n: int) -> None:
        self.stats.messages_out += 1
        self.stats.bytes_out += n


class MqttDeviceTransport(DeviceTransport):
    """Device side over MQTT: status + last-will, retained hello, round descriptor, globals, updates.

    Global state is subscribed to on demand (a device downloads only the
    artifacts its method asks for), and :meth:`fetch_global` waits for exactly
    the version the current round descriptor names.
    """

    def __init__(self, broker: BrokerSettings, fleet: str, device_id: str,
                 settings: TransportSettings | None = None, *, client_id: str | None = None) -> None:
        self.topics = FleetTopics(fleet)
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
        self.refusal: bytes | None = None  # the coordinator's latest `refused` message for this device
        self.changes = 0  # descriptor changes received
        self._changes_read = 0  # ... as of the last current_round() call
        self.client = MqttClient(broker, client_id or f"fedge-{fleet}-{device_id}", clean_session=True,
                                 will=Will(self.topics.status(device_id), STATUS_OFFLINE),
                                 on_message=self._on_message, on_connect=self._on_connect,
                                 on_disconnect=self._on_disconnect)
        self.client.subscribe(self.topics.round)
        self.client.subscribe(self.topics.refused(device_id))

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

    def _on_message(self, m: Received) -> None:
        self.stats.messages_in += 1
        self.stats.bytes_in += len(m.payload)
        if m.topic == self.topics.round:
            self._on_round(m.payload)
            return
        if m.topic == self.topics.refused(self.device_id):
            self._on_refused(m.payload)
            return
        g = self.topics.parse_global(m.topic)
        if g is None:
            return
        asm = self._assemblers.setdefault(g.artifact, RetainedAssembler(self.settings.max_message_bytes))
        try:
            whole = asm.on_root(m.payload) if g.part is None else asm.on_part(m.payload)
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
            return
        try:
            msg = Message.from_bytes(raw, max_bytes=MAX_HELLO_BYTES)
            reason, text = msg.info.get("reason", "?"), msg.info.get("message", "")
        except (PayloadError, AttributeError) as exc:
            log.warning("%s: the coordinator refused this device (unreadable reason: %s)", self.device_id, exc)
            return
        log.error("%s: the coordinator refused this device: %s: %s", self.device_id, reason, text)

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
            self._round_raw, self._round_id, self._round_key = raw, msg.msg_id, key
            self._want = {str(k): int(v) for k, v in want.items()} if isinstance(want, dict) else None
            last = self._last_update
            if last is not None and last[0] == key and last[1] != msg.msg_id:
                resend = last[2]
                self._last_update = (key, msg.msg_id, last[2])
            self.changes += 1
            self._cond.notify_all()
        if resend is not None:
            log.info("%s: round %d was re-announced; sending the cached update again", self.device_id, key[1])
            # Split again: a fresh transfer id, since the coordinator ignores repeats of a finished transfer.
            for frame in split(resend, self.settings.chunk_bytes):
                self.client.publish(self.topics.update(self.device_id), frame)

    # -- DeviceTransport ---------------------------------------------------------------
    def send_hello(self, data: bytes) -> None:
        """Publish the hello (retained) now if connected, and again after every reconnection."""
        with self._hello_lock:
            self._hello = data
            if self._announced:
                self.client.publish(self.topics.hello(self.device_id), data, retain=True)
        self._count_out(len(data))

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
            key, rid = self._round_key, self._round_id
        try:
            rnd = int(read_header(data)[1].get("round", "-1"))
        except (PayloadError, ValueError):
            rnd = -1
        if key is not None and key[1] == rnd:
            self._last_update = (key, rid, data)
        pubs = [self.client.publish(self.topics.update(self.device_id), f) for f in frames]
        for f in frames:
            self._count_out(len(f))
        # Wait across a broker restart (paho resends after the reconnect). Not raising after the timeout:
        # the round is done (a retry would train again); the message stays queued, and the coordinator's
        # re-announcement of the round makes this device send its cached copy again.
        if not self.client.wait_published(pubs, self.settings.publish_timeout_s):
            log.warning("%s: update not acknowledged within %.0f s; it stays queued and is resent after the "
                        "reconnect", self.device_id, self.settings.publish_timeout_s)

    def close(self) -> None:
        """Disconnect cleanly, marking this device offline (the last-will is for crashes)."""
        self.client.stop(final=(self.topics.status(self.device_id), STATUS_OFFLINE))

    def abort(self) -> None:
        """Vanish like a crashed device: no DISCONNECT, so the broker publishes the last-will."""
        self.client.abort()

    def _count_out(self, n: int) -> None:
        self.stats.messages_out += 1
        self.stats.bytes_out += n


__all__ = ["MqttCoordinatorTransport", "MqttDeviceTransport", "TransportSettings"]
