"""Over-the-air model updates on the wire: the signed model package, the signed per-device order, the device's
status, and the device's resumable download (``docs/protocol.md`` section 12).

Topics (:class:`~fedge.mqtt.topics.FleetTopics`)::

    fedge/{fleet}/ota/models/{n}           retained  the signed package of version n, or its chunk manifest
    fedge/{fleet}/ota/models/{n}/part/{i}  retained  chunk i of it (chunk frames of fedge.mqtt.chunking)
    fedge/{fleet}/ota/devices/{id}         retained  a signed order: install version n (JSON)
    fedge/{fleet}/devices/{id}/ota         retained  the device's status (JSON): version in use, update state

The device keeps every chunk it received on disk (``STORE/incoming/{transfer id}/{i}``) and subscribes only
to the parts it lacks, one topic each, unsubscribing as they arrive: a download cut by a lost link, a reboot or
a crash resumes where it stopped. The package is verified as a whole (the order's sha256, then the fleet's
signature) before the store sees it; the installing and checking (:mod:`fedge.runtime.ota`) run on a worker
thread, never on the MQTT dispatcher.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedge.common import boundedjson
from fedge.common.atomicfile import write_atomic
from fedge.common.signing import SignatureError, Signer, Verifier
from fedge.errors import FedgeError, PayloadError
from fedge.mqtt.chunking import ChunkError, FrameHeader, chunk_frames, frame_kind, parse_frame
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.topics import FleetTopics

log = logging.getLogger(__name__)

ORDER_VERSION = 1
MAX_ORDER_BYTES = 8 * 1024
DEFAULT_THRESHOLD = 0.02  # a new model may lose at most 2 points of local accuracy
# Update states a device reports; the last four end an update.
STATES = ("downloading", "checking", "installed", "rolled-back", "refused", "failed")
FINAL_STATES = ("installed", "rolled-back", "refused", "failed")


@dataclass(frozen=True)
class Order:
    """What ``fedge deploy`` asks of one device (the body of the signed order, JSON)."""

    fleet: str
    device: str
    version: int
    deployment: str  # id of this rollout (32 hex)
    sha256: str  # of the signed package frame, as published
    size: int  # bytes of the signed package frame
    threshold: float = DEFAULT_THRESHOLD
    v: int = ORDER_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> Order:
        """Strictly: every field, of its type and range; :class:`PayloadError` naming the one that is wrong."""
        d = boundedjson.loads(data, max_bytes=MAX_ORDER_BYTES, max_depth=1, what="OTA order")
        if not isinstance(d, dict) or set(d) != {f for f in cls.__dataclass_fields__}:
            raise PayloadError(f"OTA order must have exactly the fields {sorted(cls.__dataclass_fields__)}")
        if d["v"] != ORDER_VERSION:
            raise PayloadError(f"OTA order version {str(d['v'])[:8]!r} is not supported (this is {ORDER_VERSION})")
        for key in ("fleet", "device", "deployment", "sha256"):
            if not isinstance(d[key], str) or not 1 <= len(d[key]) <= 128:
                raise PayloadError(f"OTA order {key} must be a string of 1-128 characters")
        for key in ("version", "size"):
            if not isinstance(d[key], int) or isinstance(d[key], bool) or not 1 <= d[key] <= 2**53:
                raise PayloadError(f"OTA order {key} must be a positive integer, got {str(d[key])[:32]!r}")
        t = d["threshold"]
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= 1:
            raise PayloadError(f"OTA order threshold must be a fraction in [0, 1], got {str(t)[:32]!r}")
        return cls(**{**d, "threshold": float(t)})


@dataclass(frozen=True)
class Release:
    """A model version as published: what the orders name."""

    version: int
    sha256: str
    size: int  # bytes of the signed package frame
    parts: int
    publications: list[tuple[str, bytes]]  # (topic, payload), retained, in publishing order


def release(topics: FleetTopics, signer: Signer, package: bytes, version: int, chunk_bytes: int) -> Release:
    """The retained publications of a model package: signed whole for its topic, then chunked (parts first,
    the manifest last), like a global state (protocol section 5)."""
    root = topics.ota_model(version)
    signed = signer.seal(root, package)
    digest = hashlib.sha256(signed).hexdigest()
    if len(signed) <= chunk_bytes:
        return Release(version, digest, len(signed), 0, [(root, signed)])
    manifest, frames = chunk_frames(signed, chunk_bytes)
    pubs = [(topics.ota_model_part(version, i), f) for i, f in enumerate(frames)] + [(root, manifest)]
    return Release(version, digest, len(signed), len(frames), pubs)


def parse_status(payload: bytes) -> dict[str, Any] | None:
    """A device's status message, or None if it is not one (bounded JSON object)."""
    try:
        d = boundedjson.loads(payload, max_bytes=16 * 1024, max_depth=4, what="OTA status")
    except PayloadError:
        return None
    return d if isinstance(d, dict) else None


Apply = Callable[[bytes, Order], dict[str, Any]]
"""Install a verified package (the signed frame's body) for an order; returns the status fields to report."""


class OtaDevice:
    """A device's side: follows its order topic, downloads (resumably), verifies, hands the package to ``apply``
    on a worker thread and reports its status. Shares the device's MQTT connection (:meth:`MqttClient.route`)."""

    def __init__(self, client: MqttClient, fleet: str, device_id: str, verifier: Verifier, incoming: Path,
                 apply: Apply, status: Callable[[], dict[str, Any]], *, max_bytes: int = 256 * 1024 * 1024,
                 precheck: Callable[[int], None] | None = None) -> None:
        self.client = client
        self.topics = FleetTopics(fleet)
        self.device_id = device_id
        self.verifier = verifier
        self.incoming = incoming
        self.apply = apply
        self.store_status = status
        self.precheck = precheck  # raises FedgeError for a version the device refuses before downloading
        self.max_bytes = max_bytes
        self.parts_received = 0  # chunk frames received (a resumed download receives only the missing ones)
        self.rejected: dict[str, int] = {}
        self._order: Order | None = None
        self._manifest: FrameHeader | None = None
        self._wanted: set[int] = set()
        self._lock = threading.Lock()
        self._work: queue.Queue[tuple[bytes, Order, dict[str, Any]] | None] = queue.Queue()
        # The download of the current order: when it was asked for (monotonic) and the bytes received since.
        self._download_t0 = 0.0
        self._download_bytes = 0
        self._worker = threading.Thread(target=self._run, name=f"ota-{device_id}", daemon=True)
        self.incoming.mkdir(parents=True, exist_ok=True)
        client.route(f"{self.topics.base}/ota/", self._on_message)

    def start(self) -> OtaDevice:
        self._worker.start()
        self.client.subscribe(self.topics.ota_order(self.device_id))
        self.report({})
        return self

    def stop(self) -> None:
        self._work.put(None)
        self._worker.join(10)

    # -- status -----------------------------------------------------------------------------
    def report(self, fields: dict[str, Any]) -> None:
        """Publish the retained status: the store's versions plus ``fields`` (state, reason, figures)."""
        order = self._order
        doc = {"device": self.device_id, **self.store_status(), "time": time.time(),
               **({"target": order.version, "deployment": order.deployment} if order else {}), **fields}
        self.client.publish(self.topics.ota_status(self.device_id), json.dumps(doc, sort_keys=True).encode(),
                            retain=True)
        self.last_status = doc

    def _refuse(self, reason: str, message: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("%s: OTA: %s", self.device_id, message)

    # -- dispatcher thread --------------------------------------------------------------------
    def _on_message(self, m: Received) -> None:
        if not m.payload:
            return
        if m.topic == self.topics.ota_order(self.device_id):
            self._on_order(m.topic, m.payload)
            return
        order = self._order
        if order is None or not m.topic.startswith(self.topics.ota_model(order.version)):
            return
        try:
            if m.topic == self.topics.ota_model(order.version):
                self._on_root(order, m.payload)
            else:
                self._on_part(order, m.topic, m.payload)
        except (ChunkError, OSError) as exc:
            self._refuse("malformed", f"bad chunk of model version {order.version}: {exc}")

    def _on_order(self, topic: str, payload: bytes) -> None:
        try:
            order = Order.parse(self.verifier.open(topic, payload))
            if order.fleet != self.topics.fleet or order.device != self.device_id:
                raise PayloadError(f"the order is for {order.device} of fleet {order.fleet}, not this device")
        except SignatureError as exc:
            self._refuse(exc.reason, f"refused an order: {exc.message}")
            return
        except PayloadError as exc:
            self._refuse("malformed", f"refused an order: {exc.message}")
            self.report({"state": "refused", "reason": f"unreadable order: {exc.message}"})
            return
        with self._lock:
            if self._order is not None and self._order.deployment == order.deployment:
                return  # the same order again (retained redelivery)
            self._order, self._manifest, self._wanted = order, None, set()
        known = self.store_status()
        if known.get("version") == order.version:
            self.report({"state": "installed"})  # already done (a restart reads its order again)
            return
        if str(order.version) in (known.get("rolled_back") or {}):
            self.report({"state": "rolled-back", "reason": known["rolled_back"][str(order.version)]})
            return
        if self.precheck is not None:
            try:
                self.precheck(order.version)
            except FedgeError as exc:
                log.warning("%s: OTA: %s", self.device_id, exc.message)
                self.report({"state": "refused", "reason": exc.message})
                return
        log.info("%s: OTA: order for model version %d (deployment %s)", self.device_id, order.version,
                 order.deployment[:8])
        self.report({"state": "downloading"})
        self._download_t0, self._download_bytes = time.monotonic(), 0
        self.client.subscribe(self.topics.ota_model(order.version))

    def _on_root(self, order: Order, payload: bytes) -> None:
        self._download_bytes += len(payload)
        if frame_kind(payload) == "message":  # a small package, whole
            self._finish(order, payload)
            return
        header, _ = parse_frame(payload)
        if header.part_sha256 is not None or header.sha256 != order.sha256 or header.total != order.size:
            raise ChunkError("malformed", f"the manifest of model version {order.version} does not match its order")
        if header.total > self.max_bytes:
            raise ChunkError("oversize", f"model version {order.version} is {header.total} bytes, over the limit")
        parts = self.incoming / header.transfer_id
        parts.mkdir(parents=True, exist_ok=True)
        for stale in self.incoming.iterdir():  # parts of other downloads can never complete now
            if stale != parts:
                shutil.rmtree(stale, ignore_errors=True)
        with self._lock:
            self._manifest = header
            self._wanted = {i for i in range(header.count) if not (parts / str(i)).is_file()}
            wanted = sorted(self._wanted)
        log.info("%s: OTA: version %d in %d parts, %d to download", self.device_id, order.version, header.count,
                 len(wanted))
        for i in wanted:
            self.client.subscribe(self.topics.ota_model_part(order.version, i))
        self._maybe_complete(order)

    def _on_part(self, order: Order, topic: str, payload: bytes) -> None:
        manifest = self._manifest
        if manifest is None:
            return
        header, data = parse_frame(payload)  # checks the part's own sha256
        if header.transfer_id != manifest.transfer_id or header.part_sha256 is None:
            return  # a part of another publication of this version
        self.parts_received += 1
        self._download_bytes += len(payload)
        path = self.incoming / manifest.transfer_id / str(header.seq)
        write_atomic(path, data, durable=False)  # a part lost to a power cut is fetched again
        self.client.unsubscribe(topic)
        with self._lock:
            self._wanted.discard(header.seq)
        self._maybe_complete(order)

    def _maybe_complete(self, order: Order) -> None:
        with self._lock:
            manifest, done = self._manifest, not self._wanted
        if manifest is None or not done:
            return
        parts = self.incoming / manifest.transfer_id
        data = b"".join((parts / str(i)).read_bytes() for i in range(manifest.count))
        shutil.rmtree(parts, ignore_errors=True)
        self.client.unsubscribe(self.topics.ota_model(order.version))
        self._finish(order, data)

    def _finish(self, order: Order, signed: bytes) -> None:
        if hashlib.sha256(signed).hexdigest() != order.sha256 or len(signed) != order.size:
            self._refuse("checksum", f"model version {order.version} does not match its order's sha256")
            self.report({"state": "failed", "reason": "the downloaded package does not match the order's sha256"})
            return
        # How long the download took here, from subscribing to the package to holding all of it (a resumed one:
        # since this process asked again, and only the parts it still lacked): on the device's link, the time
        # the bytes took (docs/results.md, OTA over an emulated link).
        download = {"seconds": round(time.monotonic() - self._download_t0, 3), "bytes": len(signed),
                    "bytes_received": self._download_bytes}
        log.info("%s: OTA: model version %d downloaded: %d bytes in %.1f s", self.device_id, order.version,
                 len(signed), download["seconds"])
        self._work.put((signed, order, download))

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            signed, order, download = item
            try:
                body = self.verifier.open(self.topics.ota_model(order.version), signed)
            except SignatureError as exc:
                self._refuse(exc.reason, f"model version {order.version}: {exc.message}")
                self.report({"state": "refused", "reason": f"the package's signature: {exc.message}"})
                continue
            self.report({"state": "checking", "download": download})
            try:
                fields = self.apply(body, order)
            except FedgeError as exc:
                fields = {"state": "refused", "reason": exc.message}
            except Exception as exc:  # the agent keeps running; the device reports what broke
                log.exception("%s: OTA: installing version %d failed", self.device_id, order.version)
                fields = {"state": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(Exception):
                self.report({**fields, "download": download})
