"""A relay between a broker shard and its parent broker: ``fedge relay``.

Devices of a shard talk only to their shard's broker, with the same topics as a flat fleet. The relay
is connected to both brokers under its own account:

* **down** (parent → shard, retained, byte for byte): the round descriptor, the global state
  (``global/#``, chunk parts included), the devices' ``refused/{id}`` and ``fedge deploy``'s model
  packages and orders (``ota/#``) — signed frames stay signed: a
  relay holds no fleet key and changes nothing a device verifies (it reads the descriptor inside the
  frame without verifying it); and, whenever this relay starts or reconnects to its shard, a retained
  **resend request** (``rounds/resend``, naming the descriptor) so that devices whose update it may have
  lost send their cached update again (protocol §8 and §13) — where a coordinator re-announces the round
  under a new message id, which a relay could not sign;
* **up** (shard → parent): the devices' retained ``hello``, ``status`` and OTA status (the parent
  registers the devices and knows who is offline — an ``offline`` once it is believable, as the
  coordinator's :class:`~fedge.mqtt.status_book.StatusBook` decides, so the last-wills a restarting
  shard broker publishes do not end the round for devices about to return —, ``fedge deploy`` follows
  the rollout; the parent's ACL lets this relay write exactly those of its shard's devices), and —
  instead of N updates — its partial aggregate: every update passes the update gate into the strategy's accumulators
  (:class:`~fedge.scaleout.aggregator.PartialAggregator`), a child relay's partial is merged, and
  once every online device of the shard has answered (or the round's deadline is ``margin_s`` away, or
  nothing new came for ``hold_s``) one ``partial`` goes to ``fedge/{fleet}/partials/{account}`` on the
  parent.

A relay of relays is the same program with a relay's shard as its child broker: trees of any depth.

**Secure rounds** (``[privacy] secure_aggregation``, a descriptor carrying ``secagg``): the relay forwards the
coordinator's stage messages (``secagg/{id}``) down and its devices' ``keys``, ``shares`` and ``unmask`` messages
up byte for byte, never retained; it does not forward their masked inputs but adds them up modulo the round's
field, with its child relays' sums (:class:`~fedge.secagg.partial.RelaySums`), and sends each group's sum to
``relays/{account}/secagg`` on its parent once every device whose shares it forwarded has sent its masked input
(or is offline), or nothing new came for ``hold_s``. Neither it nor its parent sees one device's values; what
it refuses (a malformed or repeated masked input, a child's forged sum) is counted as ``secagg-{reason}`` in
the round's report through its next partial.

**Compact partials.** A partial lists its devices as runs of ids with one summary of their reports (the
aggregator's default; ``--detail`` sends one entry per device), so the bytes through the parent do not grow
with the shard; with ``state_dir`` the relay keeps each round's per-device entries itself
(``rounds.jsonl``: bytes up and update info of every device it counted, a child relay's compact devices
under that child's name).

**Faults.** The devices this relay has forwarded in the current round are saved (``state_dir``) after
the parent acknowledged each partial. A relay killed mid-round loses its unsent sums; restarted, it
asks its devices to resend (the resend request), they send their cached updates again, the ones it had forwarded are
refused as duplicates and the rest aggregated: no accepted update is lost or counted twice. A shard
broker restart is a reconnection: the relay publishes the global state, the descriptor and a resend request
again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from fedge.common.atomicfile import write_atomic
from fedge.common.messages import Message, new_msg_id
from fedge.common.transport import Inbound
from fedge.mqtt.chunking import Reassembler, split
from fedge.mqtt.client import MqttClient, Received, Will
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.inbound import InboundClassifier, RefusalLog
from fedge.mqtt.settings import MAX_HELLO_BYTES, TransportSettings, TransportStats
from fedge.mqtt.status_book import StatusBook
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics
from fedge.scaleout.aggregator import PartialAggregator
from fedge.secagg.partial import RelaySums

log = logging.getLogger(__name__)

STATE_FILE = "relay-state.json"
OWED_REFRESH_S = 0.05  # how often the devices owed are recomputed while offline statuses await belief (a tick)
ROUNDS_FILE = "rounds.jsonl"  # one line per finished round: each device's entry as this relay counted it


class Relay:
    """One relay: ``child`` is its shard's broker, ``parent`` the broker above (see the module docstring)."""

    def __init__(self, child: BrokerSettings, parent: BrokerSettings, fleet: str, aggregator: PartialAggregator, *,
                 settings: TransportSettings | None = None, state_dir: str | os.PathLike[str] | None = None,
                 margin_s: float = 1.0, hold_s: float = 1.0) -> None:
        self.topics = t = FleetTopics(fleet)
        self.aggregator = aggregator
        self.name = aggregator.name
        self.settings = settings or TransportSettings()
        self.margin_s = margin_s
        self.hold_s = hold_s
        self.state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self.up_stats = TransportStats()  # what this relay sent to / received from its parent
        self.down_stats = TransportStats()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # The shard's device statuses, believed as the coordinator believes its own (StatusBook): an ``offline``
        # published while this relay's shard connection drops — a shard broker shutting down publishes every
        # last-will — counts, and is forwarded up, only once the devices had the grace period to come back.
        self._book = StatusBook(self.settings.offline_confirm_s, self.settings.status_grace_s)
        self._book_lock = threading.Lock()
        self._held_offline: dict[str, str] = {}  # device -> its status topic: an offline not forwarded up yet
        self._down_retained: dict[str, bytes] = {}  # topic -> payload forwarded down (republished after a
        self._down_lock = threading.Lock()          # reconnection to the shard)
        self._parent_round_id: str | None = None
        self._descriptor: Message | None = None  # the parent's current descriptor (inside its signed frame)
        # A relay that starts while its shard already holds the parent's current descriptor (retained: a previous
        # run of this relay forwarded it) may have lost updates its devices sent: it asks them again, once.
        self._ask_resend = True
        self._shard_round_id: str | None = None  # msg id of the descriptor retained on the shard at (re)connection
        self._deadline = 0.0
        self._last_accept = 0.0
        # The devices this round still owes (expected() less those answered), kept up to date rather than
        # recomputed after every message: expected() walks every device of the shard, so checking it per update
        # made a round quadratic in the shard's size (1.75 ms per update at 5,000 devices, more than the update's
        # own gate and accumulation). A hello or a status rechecks its one device (``_owed_changed``, under
        # ``_book_lock``: statuses arrive on the dispatcher thread) — devices that connect during a round would
        # otherwise make it quadratic again —; the whole set is recomputed when a round, a child's partial or
        # this relay's shard connection changed it (``_owed_stale``) and, while an offline status waits to become
        # believable (time alone changes StatusBook.offline()), at most every OWED_REFRESH_S.
        self._owed: set[str] | None = None
        self._owed_stale = True
        self._owed_changed: set[str] = set()
        self._owed_at = 0.0
        self._saved = self._load_state()
        # what the shard sends: sizes, retained copies, chunks, descriptors (refusals in down_stats.rejected)
        self.inbound = InboundClassifier(RefusalLog(f"relay {self.name}", self.down_stats),
                                         Reassembler(self.settings.max_message_bytes))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.partials_sent = 0
        self.secure = RelaySums(self.name)  # a secure round's masked inputs, summed (fedge.secagg.partial)
        self.sums_sent = 0
        self.up = MqttClient(parent, self.name, clean_session=True, on_message=self._on_parent,
                             on_connect=self._on_parent_connect,
                             will=Will(t.relay_status(self.name), STATUS_OFFLINE))
        # over-the-air model updates (fedge deploy, signed by the fleet key) go down unchanged too
        # and the fleet key's rotations (the retained key chain), which devices verify themselves
        for topic in (t.round, f"{t.base}/global/#", f"{t.base}/refused/+", f"{t.base}/ota/#", t.fleet_keys):
            self.up.subscribe(topic)
        self.up.subscribe(f"{t.base}/secagg/+")  # secure rounds: the coordinator's stage messages to devices
        self.down = MqttClient(child, self.name, clean_session=False, on_message=self._on_child,
                               on_connect=self._on_child_connect, on_disconnect=self._on_child_disconnect)
        for kind in ("status", "hello", "update", "secagg"):
            self.down.subscribe(t.device_filter(kind))
        self.down.subscribe(t.relay_secagg_filter)  # child relays' sums of masked inputs
        self.down.subscribe(t.partial_filter)
        self.down.subscribe(t.ota_status_filter())
        self.down.subscribe(t.round)  # what the shard holds (retained) when this relay connects

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Relay:
        self.down.start(self.settings.connect_timeout_s)
        self.up.start(self.settings.connect_timeout_s)
        self._thread = threading.Thread(target=self._loop, name=f"relay-{self.name}", daemon=True)
        self._thread.start()
        log.info("relay %s: shard %s -> parent %s", self.name, self.down.settings.url, self.up.settings.url)
        return self

    def run_forever(self) -> None:
        while not self._stop.wait(1.0):
            pass

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.down.stop()
        self.up.stop(final=(self.topics.relay_status(self.name), STATUS_OFFLINE))

    # -- parent → shard (dispatcher thread of the parent connection) --------------------------
    def _on_parent_connect(self, session_present: bool) -> None:
        self.up.publish(self.topics.relay_status(self.name), STATUS_ONLINE, retain=True)

    def _on_parent(self, m: Received) -> None:
        self.up_stats.messages_in += 1
        self.up_stats.bytes_in += len(m.payload)
        if m.topic == self.topics.round:
            self._inbox.put(("round", m.payload))
            return
        if m.topic.startswith(f"{self.topics.base}/secagg/"):  # a stage message: for this round's stage only
            if m.payload and not m.retain:
                self.down.publish(m.topic, m.payload)
                self.down_stats.count_out(len(m.payload))
            return
        self._forward_down(m.topic, m.payload)  # global state, chunk parts, refusals, OTA: byte for byte

    def _forward_down(self, topic: str, payload: bytes) -> None:
        with self._down_lock:
            if payload:
                self._down_retained[topic] = payload
            else:
                self._down_retained.pop(topic, None)
        self.down.publish(topic, payload, retain=True)
        self.down_stats.count_out(len(payload))

    def _on_child_disconnect(self) -> None:
        with self._book_lock:
            self._book.connection_lost()
        self._owed_stale = True

    def _on_child_connect(self, session_present: bool) -> None:
        with self._book_lock:
            self._book.connection_back()
        self._owed_stale = True
        if self.down.connects <= 1:
            return
        # The shard's broker may have restarted and lost its retained messages (the descriptor among them):
        # publish them again, and a resend request (devices whose update it lost send it again).
        with self._down_lock:
            again = list(self._down_retained.items())
        for topic, payload in again:
            self.down.publish(topic, payload, retain=True)
        self._inbox.put(("reissue", None))

    # -- shard → parent (dispatcher thread of the shard connection) ----------------------------
    def _on_child(self, m: Received) -> None:
        self.down_stats.messages_in += 1
        self.down_stats.bytes_in += len(m.payload)
        if m.topic == self.topics.round:
            if m.retain and m.payload:  # retained: delivered on subscribing, not this relay's own forward
                self._inbox.put(("shard-round", m.payload))
            return
        if self.topics.parse_ota_status(m.topic) is not None:  # a device's OTA status, for fedge deploy
            if len(m.payload) <= MAX_HELLO_BYTES:
                self._forward_up(m.topic, m.payload, retain=True)
            return
        account = self.topics.parse_partial(m.topic)
        if account is not None:
            self._upload("partial", account, m)
            return
        account = self.topics.parse_relay_secagg(m.topic)
        if account is not None:
            self._upload("secagg-sum", account, m)
            return
        t = self.topics.parse_device(m.topic)
        if t is None:
            return
        if t.kind == "status":
            if m.payload in (STATUS_ONLINE, STATUS_OFFLINE):
                online = m.payload == STATUS_ONLINE
                with self._book_lock:
                    self._book.record(t.device_id, online)
                    if online:
                        self._held_offline.pop(t.device_id, None)
                    else:  # forwarded up once believable (_forward_offline)
                        self._held_offline[t.device_id] = m.topic
                    self._owed_changed.add(t.device_id)
                if online:
                    self._forward_up(m.topic, m.payload, retain=True)
            return
        if t.kind == "hello":
            hello = self.inbound.hello(t.device_id, m.payload, m.received)
            if hello is not None:
                self._inbox.put(("hello", hello))
                self._forward_up(m.topic, m.payload, retain=True)
            return
        if t.kind in ("update", "secagg"):
            self._upload(t.kind, t.device_id, m)

    def _upload(self, kind: str, source: str, m: Received) -> None:
        item = self.inbound.upload(source, m.payload, m.retain, m.received, kind=kind)
        if item is not None and item.reject is not None and item.reject[0] == "retained":
            self.down.publish(m.topic, b"", retain=True)  # the protocol never retains an update or a partial
        if item is not None:
            self._inbox.put((kind, item))

    def _forward_up(self, topic: str, payload: bytes, *, retain: bool) -> None:
        self.up.publish(topic, payload, retain=retain)
        self.up_stats.count_out(len(payload))

    # -- the relay's own thread: the aggregator, rounds, partials -------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                kind, arg = self._inbox.get(timeout=0.05)
            except queue.Empty:
                kind, arg = "", None
            try:
                self._handle(kind, arg)
                self._forward_offline()
                self._maybe_send()
            except Exception:  # the relay keeps serving whatever one message did
                log.exception("relay %s: handling %s failed", self.name, kind or "a tick")

    def _handle(self, kind: str, arg: Any) -> None:
        agg = self.aggregator
        if kind == "hello":
            agg.register([arg])
            if arg.origin is None:
                self._owed_stale = True
            else:
                with self._book_lock:
                    self._owed_changed.add(arg.origin)
        elif kind == "update":
            if agg.admit(arg):
                self._last_accept = time.monotonic()
                # the device its topic names: the gate refuses an update whose envelope names another sender
                if arg.origin is not None and arg.origin in agg.answered and self._owed is not None:
                    self._owed.discard(arg.origin)
                else:
                    self._owed_stale = True
        elif kind in ("secagg", "secagg-sum"):
            self._stage(kind, arg)
        elif kind == "partial":
            if agg.admit_partial(arg):
                self._last_accept = time.monotonic()
            self._owed_stale = True
        elif kind == "round":
            self._on_round(arg)
            self._owed_stale = True
        elif kind == "shard-round":
            held = self.inbound.descriptor(arg)  # a bad one is refused (counted, logged)
            if held is None:
                return
            self._shard_round_id = held.msg.msg_id
            self._maybe_ask_resend()
        elif kind == "reissue" and self._descriptor is not None:
            self._ask_resend = False
            self._request_resend()

    def _stage(self, kind: str, item: Inbound) -> None:
        """A device's stage message (forwarded up, or a masked input summed) or a child relay's masked sum."""
        origin = item.origin or "?"
        if item.reject is not None:
            self.aggregator.gate.rejections.add(origin, f"secagg-{item.reject[0]}")
            return
        before = self.secure.refusals.total()
        if kind == "secagg":
            forward = self.secure.upward(origin, item.data)
            if forward is not None:
                self._publish_up(self.topics.secagg(origin), forward, wait=False)
        else:
            allowed = self.aggregator.merger.allowed
            if allowed is not None and origin not in allowed:
                self.aggregator.gate.rejections.add(origin, "secagg-foreign")
                log.warning("relay %s: a masked sum from %r, no child relay of this shard", self.name, origin)
                return
            self.secure.child_sum(origin, item.data, None if allowed is None else allowed[origin])
        if self.secure.refusals.total() > before and self.secure.last_refusal is not None:
            self.aggregator.gate.rejections.add(origin, f"secagg-{self.secure.last_refusal.reason}")

    def _publish_up(self, topic: str, data: bytes, *, wait: bool = True) -> bool:
        """``data`` on the parent's ``topic`` (QoS 1, chunked as a device would, never retained); with ``wait``,
        whether the parent acknowledged it within the publish timeout."""
        pubs = [self.up.publish(topic, f) for f in split(data, self.settings.chunk_bytes)]
        self.up_stats.count_out(len(data))
        return not wait or self.up.wait_published(pubs, self.settings.publish_timeout_s)

    def _on_round(self, raw: bytes) -> None:
        if not raw:  # the run is over: the parent withdrew its descriptor
            self._parent_round_id = None
            self._forward_down(self.topics.round, b"")
            self._forward_down(self.topics.resend, b"")
            return
        read = self.inbound.descriptor(raw)  # a signed one is read inside its frame: the devices verify it
        if read is None:
            return
        msg, final, deadline = read.msg, read.final, read.deadline
        if msg.msg_id == self._parent_round_id:
            return  # the same descriptor again (a reconnection to the parent)
        self._parent_round_id = msg.msg_id
        self._send(self.aggregator.flush())  # whatever is left of the previous round (refused there if late)
        self._descriptor, self._deadline = msg, deadline
        run = str(msg.info.get("run", ""))
        previous = self.aggregator.round
        if self.aggregator.begin(msg.round, final=final, descriptor=msg.msg_id,
                                 sampled=self.aggregator.sampled_of(msg.info.get("round"))):
            saved = self._saved
            if saved.get("run") == run and saved.get("round") == msg.round:
                self.aggregator.mark_answered(saved.get("forwarded", []))
                log.info("relay %s: resuming round %d, %d devices forwarded before the restart", self.name,
                         msg.round, len(saved.get("forwarded", [])))
            self._saved = {"run": run, "round": msg.round, "forwarded": sorted(self.aggregator.answered)}
            self._record_round(run, previous)
        if self.secure.begin(msg.round, msg.info.get("secagg")) and self.secure.active:
            self.aggregator.strategy.secure_sums = True  # its devices' updates carry metrics only
        # Byte for byte: a signed descriptor keeps the coordinator's signature (its topic is the same on every
        # broker of the tree, the fleet's ``rounds/current``), and every shard sees the same message id.
        self._forward_down(self.topics.round, raw)
        self._maybe_ask_resend()

    def _maybe_ask_resend(self) -> None:
        """Once after starting, if the shard already held the parent's current descriptor (whichever of the two
        this relay learnt first): its devices may have answered a previous run of this relay."""
        if self._ask_resend and self._descriptor is not None and self._shard_round_id == self._descriptor.msg_id:
            self._ask_resend = False
            self._request_resend()

    def _request_resend(self) -> None:
        """Ask the shard's devices to send their cached update of the current descriptor again (this relay
        started, perhaps after being killed, or reconnected to its shard): retained, so a device away now
        gets it when it returns; a device acts on each request once (protocol §13)."""
        assert self._descriptor is not None
        body = json.dumps({"descriptor": self._descriptor.msg_id, "id": new_msg_id()}).encode()
        self.down.publish(self.topics.resend, body, retain=True)
        self.down_stats.count_out(len(body))

    def owed(self) -> set[str]:
        """:meth:`expected` less the devices already answered (see ``_owed`` in ``__init__``): cheap per message."""
        now = time.monotonic()
        with self._book_lock:
            changed, self._owed_changed = self._owed_changed, set()
            waiting = bool(self._held_offline)
        if self._owed is None or self._owed_stale or (waiting and now - self._owed_at >= OWED_REFRESH_S):
            self._owed_stale = False  # before reading: a change arriving meanwhile marks it stale again
            self._owed = self.expected() - self.aggregator.answered
            self._owed_at = now
            return self._owed
        if changed:
            gate, answered = self.aggregator.gate, self.aggregator.answered
            with self._book_lock:
                gone = {d for d in changed if self._book.all_offline([d])}
            for d in changed:  # as expected() decides, for these devices alone
                if d in gate.devices and d not in gone and gate.sampled(d) and d not in answered:
                    self._owed.add(d)
                else:
                    self._owed.discard(d)
        return self._owed

    def expected(self) -> set[str]:
        """The shard's registered devices that are not offline and owe this round an update (sampled, when the
        round samples), child relays' devices included."""
        gate = self.aggregator.gate
        with self._book_lock:
            offline = self._book.offline()
        return {d for d in gate.devices if d not in offline and gate.sampled(d)}

    def _forward_offline(self) -> None:
        """Forward up the ``offline`` statuses that became believable (not around this relay's own outage)."""
        with self._book_lock:
            if not self._held_offline:
                return
            offline = self._book.offline()
            due = {d: topic for d, topic in self._held_offline.items() if d in offline}
            for d in due:
                del self._held_offline[d]
            if due:
                self._owed_stale = True
        for topic in due.values():
            self._forward_up(topic, STATUS_OFFLINE, retain=True)

    def _maybe_send(self) -> None:
        agg = self.aggregator
        if self.secure.pending:
            self._maybe_send_sums()
        if agg.round == 0 or not agg.dirty:
            return
        now = time.monotonic()
        complete = not self.owed()
        closing = bool(self._deadline) and time.time() >= self._deadline - self.margin_s
        idle = now - self._last_accept >= self.hold_s
        if complete or closing or idle:
            self._send(agg.flush())

    def _maybe_send_sums(self) -> None:
        """Send the masked sums once every device whose shares went up through here has sent its masked input
        (or is offline), or nothing new came for ``hold_s``."""
        with self._book_lock:
            offline = self._book.offline()
        complete = not (self.secure.waiting() - offline)
        if complete or time.monotonic() - self.secure.last_added >= self.hold_s:
            for data in self.secure.flush():
                if not self._publish_up(self.topics.relay_secagg(self.name), data):
                    log.warning("relay %s: the parent did not acknowledge a masked sum within %.0f s", self.name,
                                self.settings.publish_timeout_s)
                self.sums_sent += 1

    def _send(self, data: bytes | None) -> None:
        if data is None:
            return
        self.partials_sent += 1
        if self._publish_up(self.topics.partial(self.name), data):
            self._saved["forwarded"] = sorted(self.aggregator.answered)
            self._save_state()
        else:
            log.warning("relay %s: the parent did not acknowledge a partial within %.0f s; it stays queued",
                        self.name, self.settings.publish_timeout_s)

    # -- state ----------------------------------------------------------------------------------
    def _load_state(self) -> dict[str, Any]:
        if self.state_path is None or not self.state_path.is_file():
            return {}
        try:
            doc = json.loads(self.state_path.read_text())
            return doc if isinstance(doc, dict) and isinstance(doc.get("forwarded"), list) else {}
        except (OSError, ValueError):
            log.warning("relay %s: %s is unreadable; starting without it", self.name, self.state_path)
            return {}

    def _record_round(self, run: str, rnd: int) -> None:
        """The previous round's per-device entries, appended to ``rounds.jsonl`` (the detail a compact partial
        leaves here)."""
        agg = self.aggregator
        if self.state_path is None or not agg.last_round_devices:
            return
        line = json.dumps({"run": run, "round": rnd, "relay": self.name,
                           "devices": agg.last_round_devices}, separators=(",", ":"))
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            with (self.state_path.parent / ROUNDS_FILE).open("a") as f:
                f.write(line + "\n")
        except OSError as exc:
            log.warning("relay %s: cannot write %s: %s", self.name, ROUNDS_FILE, exc)

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        write_atomic(self.state_path, json.dumps(self._saved).encode())
