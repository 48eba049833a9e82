"""A small, careful wrapper around paho-mqtt that works with paho 1.6 and 2.x.

* paho 2.x needs ``CallbackAPIVersion``; paho 1.6.1 (Raspberry Pi OS bookworm) does
  not have it. :func:`new_paho_client` picks the right constructor and the
  callbacks below accept both signatures.
* paho's network thread must never block, so every callback only puts an event
  on a queue; a dispatcher thread owned by :class:`MqttClient` runs the user's
  handlers (which may take their time: reassembling chunks, hashing, decoding).
* Reconnection has one owner: paho's ``loop_start`` thread, with exponential
  back-off between ``reconnect_min_s`` and ``reconnect_max_s``. The minimum is
  jittered per client so a fleet does not reconnect in lock-step after a broker
  restart. Subscriptions are re-issued on every (re)connect.
* Publishing never fails because the broker is away: paho queues a QoS 1 message
  while disconnected and sends it after the reconnect. Completion is tracked here
  (paho's ``on_publish``), not with ``MQTTMessageInfo.is_published()``, which
  paho 2.2 turns into a ``RuntimeError`` for exactly such a queued message;
  :meth:`MqttClient.wait_published` waits for the broker's acknowledgement across
  a reconnection, bounded by its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import paho.mqtt.client as paho

from fedge.errors import TransportError
from fedge.mqtt.connection import BrokerSettings

log = logging.getLogger(__name__)

PAHO_V2 = hasattr(paho, "CallbackAPIVersion")

# CONNACK return codes of MQTT 3.1.1 (paho 1.6 passes them as ints).
_CONNACK = {1: "unacceptable protocol version", 2: "client id rejected", 3: "server unavailable",
            4: "bad user name or password", 5: "not authorized"}


@dataclass(frozen=True)
class Will:
    """The last-will message the broker publishes if this client vanishes."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class Received:
    """One message handed from paho's thread to the dispatcher."""

    topic: str
    payload: bytes
    retain: bool
    received: float  # unix seconds


@dataclass(frozen=True)
class Publication:
    """One QoS 1 publish handed to paho: done once the broker acknowledged it (PUBACK)."""

    topic: str
    mid: int
    acked: threading.Event

    @property
    def done(self) -> bool:
        return self.acked.is_set()


MessageHandler = Callable[[Received], None]
ConnectHandler = Callable[[bool], None]  # argument: session_present


def new_paho_client(client_id: str, clean_session: bool, *, mqtt5: bool = False) -> paho.Client:
    """A paho client speaking MQTT 3.1.1 (or MQTT 5 with ``mqtt5``: shared subscriptions), with the 2.x
    callback API where paho has one. MQTT 5 has no clean-session flag: :meth:`MqttClient.start` passes
    ``clean_start`` when it connects."""
    protocol = paho.MQTTv5 if mqtt5 else paho.MQTTv311
    session = None if mqtt5 else clean_session
    if PAHO_V2:
        return paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=session,
                           protocol=protocol)
    return paho.Client(client_id=client_id, clean_session=session, protocol=protocol)


def no_delay(client: paho.Client, userdata: Any, sock: Any) -> None:
    """Disable Nagle's algorithm: fedge's control messages are small, and paho leaves it on, which
    costs a delayed-ACK wait (~40 ms) per small publish."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _rc_value(rc: Any) -> int:
    """A CONNACK/DISCONNECT code as an int, from paho 1.6 (int) or 2.x (ReasonCode)."""
    value = getattr(rc, "value", rc)
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


class MqttClient:
    """One MQTT connection with queued callbacks, remembered subscriptions and a last-will.

    Handlers run on the dispatcher thread, in arrival order, never on paho's
    network thread. Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, settings: BrokerSettings, client_id: str, *, clean_session: bool = True,
                 will: Will | None = None, on_message: MessageHandler | None = None,
                 on_connect: ConnectHandler | None = None, on_disconnect: Callable[[], None] | None = None,
                 max_inflight: int = 100, mqtt5: bool = False) -> None:
        self.settings = settings
        self.client_id = client_id
        self.mqtt5 = mqtt5
        self._clean = clean_session
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._subs: dict[str, int] = {}
        self._subs_lock = threading.Lock()
        self._routes: list[tuple[str, MessageHandler]] = []  # (topic prefix, handler): see route()
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._refused: str | None = None
        self.last_error: str | None = None  # the latest failed connection attempt (TLS alerts, refused sockets)
        self._dispatcher: threading.Thread | None = None
        # PUBACK bookkeeping (paho's thread sets, publishers wait); see Publication.
        self._acks_lock = threading.Lock()
        self._pending: dict[int, threading.Event] = {}
        self._early_acks: set[int] = set()  # acknowledged before publish() registered the mid
        self.connects = 0  # successful connections so far (1 + reconnects)
        c = self._client = new_paho_client(client_id, clean_session, mqtt5=mqtt5)
        if settings.username is not None:
            c.username_pw_set(settings.username, settings.password)
        if settings.tls:
            ctx = ssl.create_default_context(cafile=settings.ca_file)
            if settings.cert_file is not None:
                ctx.load_cert_chain(settings.cert_file, settings.key_file)
            c.tls_set_context(ctx)
        if will is not None:
            c.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        # Jitter the first back-off step (min..2*min) so a fleet spreads its reconnects after a broker
        # restart. paho annotates the delays as int but computes with them as numbers.
        c.reconnect_delay_set(min_delay=cast(int, settings.reconnect_min_s * (1 + random.random())),
                              max_delay=cast(int, settings.reconnect_max_s))
        c.max_inflight_messages_set(max_inflight)
        c.max_queued_messages_set(0)  # 0 = unbounded: QoS 1 publishes queue while disconnected
        c.on_connect = self._paho_connect
        c.on_disconnect = self._paho_disconnect
        c.on_message = self._paho_message
        c.on_publish = self._paho_publish
        c.on_socket_open = no_delay
        c.on_connect_fail = self._paho_connect_fail
        c.on_log = self._paho_log

    # -- paho callbacks: run on paho's thread, never block -----------------------------------
    def _paho_connect(self, client: paho.Client, userdata: Any, flags: Any, rc: Any, *args: Any) -> None:
        code = _rc_value(rc)
        if code != 0:
            # paho 1.6 passes the MQTT 3.1.1 code, paho 2.x a ReasonCode whose str() is its name.
            self._refused = _CONNACK.get(code) if isinstance(rc, int) else f"{rc} (code {code})"
            self._refused = self._refused or f"refused with code {code}"
            self._events.put(("refused", self._refused))
            return
        self._refused = None
        with self._subs_lock:
            subs = list(self._subs.items())
        if subs:
            client.subscribe(subs)  # non-blocking: queues the SUBSCRIBE packet
        present = bool(flags.get("session present", 0)) if isinstance(flags, dict) else \
            bool(getattr(flags, "session_present", False))
        self._connected.set()
        self._events.put(("connect", present))

    def _paho_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        # Called inside paho's `except OSError` around the connection attempt: the exception is the reason
        # (a TLS alert such as "certificate revoked", a refused socket).
        exc = sys.exc_info()[1]
        if exc is not None:
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _paho_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        # A TLS 1.3 server refuses a client certificate after the handshake: paho sees it as a failed read.
        if level == paho.MQTT_LOG_ERR and "socket" in buf:
            self.last_error = buf

    def _paho_disconnect(self, client: paho.Client, userdata: Any, *args: Any) -> None:
        self._connected.clear()
        self._events.put(("disconnect", None))

    def _paho_publish(self, client: paho.Client, userdata: Any, mid: int, *args: Any) -> None:
        with self._acks_lock:
            ev = self._pending.pop(mid, None)
            if ev is None:
                self._early_acks.add(mid)
        if ev is not None:
            ev.set()

    def _paho_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        self._events.put(("message", Received(msg.topic, bytes(msg.payload), bool(msg.retain), time.time())))

    # -- dispatcher ------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            kind, arg = self._events.get()
            if kind == "stop":
                return
            try:
                if kind == "message":
                    handler = next((h for prefix, h in self._routes if arg.topic.startswith(prefix)), self._on_message)
                    if handler is not None:
                        handler(arg)
                elif kind == "connect":
                    self.connects += 1
                    log.info("%s connected to %s%s", self.client_id, self.settings.url,
                             " (reconnect)" if self.connects > 1 else "")
                    if self._on_connect is not None:
                        self._on_connect(arg)
                elif kind == "disconnect":
                    if not self._stopping.is_set():
                        log.warning("%s lost its connection to %s; reconnecting with back-off", self.client_id,
                                    self.settings.url)
                    if self._on_disconnect is not None:
                        self._on_disconnect()
                elif kind == "refused":
                    log.error("%s: broker %s refused the connection: %s", self.client_id, self.settings.url, arg)
            except Exception:  # a handler bug must not kill the connection
                log.exception("%s: handler for %s failed", self.client_id, kind)

    # -- public API ------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self, wait_s: float | None = 10.0) -> MqttClient:
        """Connect in the background; with ``wait_s``, wait that long for the first connection."""
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"mqtt-{self.client_id}", daemon=True)
        self._dispatcher.start()
        try:
            if self.mqtt5:
                self._client.connect_async(self.settings.host, self.settings.port, keepalive=self.settings.keepalive_s,
                                           clean_start=self._clean)
            else:
                self._client.connect_async(self.settings.host, self.settings.port,
                                           keepalive=self.settings.keepalive_s)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to {self.settings.url}: {exc}") from exc
        self._client.loop_start()
        if wait_s is not None:
            try:
                self.wait_connected(wait_s)
            except TransportError:
                self.stop()  # do not leave a retrying client behind
                raise
        return self

    def wait_connected(self, timeout_s: float) -> None:
        """Block until connected; a refusal or ``timeout_s`` becomes a :class:`TransportError`."""
        end = time.monotonic() + timeout_s
        while not self._connected.wait(0.05):
            if self._refused is not None:
                raise TransportError(f"broker {self.settings.url} refused {self.client_id}: {self._refused}",
                                     hint="check --username/--password and the broker's password file and ACL")
            if time.monotonic() > end:
                why = f" (last error: {self.last_error})" if self.last_error else ""
                hint = ("is the broker running and reachable? (fedge coordinator run starts an embedded one when "
                        "--broker is not given)")
                if self.last_error and any(w in self.last_error.lower() for w in ("certificate", "ssl", "tls")):
                    hint = ("the TLS handshake failed: a revoked, expired or foreign client certificate, or a CA "
                            "that did not sign the broker's; check --cert/--key/--ca (fedge broker rotate issues "
                            "a new certificate)")
                raise TransportError(f"no connection to {self.settings.url} after {timeout_s:.0f} s{why}",
                                     hint=hint)

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        """Subscribe now (if connected) and again after every reconnect."""
        with self._subs_lock:
            if self._subs.get(topic_filter) == qos:
                return
            self._subs[topic_filter] = qos
        if self.connected:
            self._client.subscribe(topic_filter, qos)

    def unsubscribe(self, topic_filter: str) -> None:
        """Stop receiving ``topic_filter`` (now, and after reconnects)."""
        with self._subs_lock:
            if self._subs.pop(topic_filter, None) is None:
                return
        if self.connected:
            self._client.unsubscribe(topic_filter)

    def resubscribe(self) -> None:
        """Send every subscription again (if connected): the broker delivers the retained messages of each once
        more (MQTT 3.1.1 section 3.8.4) — after a key rotation, what was refused under the old key."""
        with self._subs_lock:
            subs = list(self._subs.items())
        if subs and self.connected:
            self._client.subscribe(subs)

    def route(self, prefix: str, handler: MessageHandler) -> None:
        """Hand messages whose topic starts with ``prefix`` to ``handler`` instead of the client's ``on_message``
        (on the dispatcher thread): a second protocol — the OTA updates — shares the device's one connection."""
        self._routes.append((prefix, handler))

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> Publication:
        """Queue a publish (never blocks). Connected or not: paho keeps a QoS 1 message until the broker
        acknowledged it and sends it again after a reconnect."""
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc not in (paho.MQTT_ERR_SUCCESS, paho.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {paho.error_string(info.rc)}")
        ev = threading.Event()
        with self._acks_lock:
            if qos == 0 or info.mid in self._early_acks:
                self._early_acks.discard(info.mid)
                ev.set()  # QoS 0 has no acknowledgement: handed over is all there is
            else:
                self._pending[info.mid] = ev
        return Publication(topic, info.mid, ev)

    def wait_published(self, pubs: list[Publication], timeout_s: float) -> bool:
        """Wait (never from a handler!) until the broker acknowledged every publish in ``pubs``, across
        reconnections; False if ``timeout_s`` passed first."""
        end = time.monotonic() + timeout_s
        return all(p.acked.wait(max(end - time.monotonic(), 0.0)) for p in pubs)

    def require_published(self, pubs: list[Publication], timeout_s: float, what: str) -> None:
        """:meth:`wait_published`, or a :class:`TransportError` naming ``what`` and the broker."""
        if not self.wait_published(pubs, timeout_s):
            missing = sum(not p.done for p in pubs)
            state = "connected" if self.connected else "not connected"
            raise TransportError(
                f"{what}: the broker {self.settings.url} did not acknowledge {missing} of {len(pubs)} message(s) "
                f"within {timeout_s:.0f} s ({state})",
                hint="is the broker running and reachable? its log shows refused or oversized packets")

    def stop(self, *, final: tuple[str, bytes] | None = None, timeout_s: float = 5.0) -> None:
        """Disconnect cleanly (the last-will is *not* sent); ``final`` = (topic, payload) published retained first."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if final is not None and self.connected:
            self.wait_published([self.publish(final[0], final[1], retain=True)], timeout_s)
        self._client.disconnect()
        self._client.loop_stop()
        self._events.put(("stop", None))
        if self._dispatcher is not None:
            self._dispatcher.join(timeout_s)

    def abort(self) -> None:
        """Drop the connection without DISCONNECT, as a crash or power loss would (the will fires)."""
        self._stopping.set()
        sock = self._client.socket()
        self._client.loop_stop()
        if sock is not None:
            try:
                if isinstance(sock, socket.socket):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass
        self._events.put(("stop", None))

    def __enter__(self) -> MqttClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
