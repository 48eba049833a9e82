"""Chunking of large messages: frames with sha256 checksums, and bounded reassembly.

A message (safetensors bytes, see :mod:`fedge.common.messages`) larger than the
chunk size travels as ``count`` *chunk frames*; a retained global state is
committed by a *manifest frame* published after its parts. Frame layout::

    magic   8 bytes   b"FDGCHUNK" (chunk) or b"FDGMANIF" (manifest)
    hlen    4 bytes   little-endian uint32, length of the JSON header (<= 4096)
    header  hlen      UTF-8 JSON: {"v": 1, "id": transfer id (32 hex), "seq": i, "count": n,
                                   "total": message bytes, "sha256": hex digest of the whole message,
                                   "part_sha256": hex digest of this part (chunks only)}
    data    the rest  bytes [seq * chunk_size, ...) of the message (chunks only)

A whole message can never be mistaken for a frame: safetensors bytes start with
a little-endian uint64 header length, whose last byte would have to be ``'K'``
or ``'F'`` (a header longer than 2**56 bytes) to collide with a magic.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from fedge.common import boundedjson
from fedge.errors import PayloadError

CHUNK_MAGIC = b"FDGCHUNK"
MANIFEST_MAGIC = b"FDGMANIF"
FRAME_VERSION = 1
MAX_FRAME_HEADER = 4096
MAX_PARTS = 1 << 20  # seq and count: more parts than any message at the smallest chunk size has
MAX_TOTAL = 1 << 40  # bytes a frame may declare (receivers set their own, far lower, limits)
DEFAULT_CHUNK_BYTES = 256 * 1024
FrameKind = Literal["message", "chunk", "manifest"]


class ChunkError(PayloadError):
    """A frame or transfer was refused; ``reason`` is the counter key (``checksum``, ``oversize`` ...)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


@dataclass(frozen=True)
class FrameHeader:
    """The JSON header of a chunk or manifest frame."""

    transfer_id: str
    seq: int
    count: int
    total: int
    sha256: str
    part_sha256: str | None = None

    def to_json(self) -> bytes:
        d: dict[str, object] = {"v": FRAME_VERSION, "id": self.transfer_id, "seq": self.seq, "count": self.count,
                                "total": self.total, "sha256": self.sha256}
        if self.part_sha256 is not None:
            d["part_sha256"] = self.part_sha256
        return json.dumps(d, separators=(",", ":")).encode()


def frame_kind(payload: bytes) -> FrameKind:
    """What a received payload is: a whole message, a chunk frame or a manifest frame."""
    head = bytes(payload[:8])
    if head == CHUNK_MAGIC:
        return "chunk"
    if head == MANIFEST_MAGIC:
        return "manifest"
    return "message"


def _frame(magic: bytes, header: FrameHeader, data: bytes = b"") -> bytes:
    h = header.to_json()
    return b"".join((magic, struct.pack("<I", len(h)), h, data))


def split(data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[bytes]:
    """``[data]`` if it fits in ``chunk_bytes``, else its chunk frames in order."""
    if chunk_bytes < 1024:
        raise ValueError(f"chunk size {chunk_bytes} is too small (minimum 1024 bytes)")
    if len(data) <= chunk_bytes:
        return [data]
    return chunk_frames(data, chunk_bytes)[1]


def chunk_frames(data: bytes, chunk_bytes: int) -> tuple[bytes, list[bytes]]:
    """(manifest frame, chunk frames) of ``data`` under one fresh transfer id."""
    tid = uuid.uuid4().hex
    digest = hashlib.sha256(data).hexdigest()
    count = max(1, -(-len(data) // chunk_bytes))
    view = memoryview(data)
    frames = []
    for i in range(count):
        part = bytes(view[i * chunk_bytes : (i + 1) * chunk_bytes])
        frames.append(_frame(CHUNK_MAGIC, FrameHeader(tid, i, count, len(data), digest,
                                                      hashlib.sha256(part).hexdigest()), part))
    manifest = _frame(MANIFEST_MAGIC, FrameHeader(tid, -1, count, len(data), digest))
    return manifest, frames


def _field_int(h: dict[str, object], key: str, low: int, high: int) -> int:
    value = h.get(key)
    # JSON numbers only: 1e999 parses as a float (inf), "7" as a string; neither is a part number
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ChunkError("malformed", f"chunk frame {key} must be an integer in [{low}, {high}], "
                                      f"got {str(value)[:32]!r}")
    return value


def _field_hex(h: dict[str, object], key: str, length: int | None = None) -> str:
    value = h.get(key)
    if (not isinstance(value, str) or not 1 <= len(value) <= 64 or (length is not None and len(value) != length)
            or any(c not in "0123456789abcdef" for c in value)):
        raise ChunkError("malformed", f"chunk frame {key} must be lowercase hex, got {str(value)[:72]!r}")
    return value


def parse_frame(payload: bytes) -> tuple[FrameHeader, bytes]:
    """Split a chunk or manifest frame into (header, data); raises :class:`ChunkError` if malformed.

    Every header field is type- and range-checked (no exception but :class:`ChunkError`
    leaves here, whatever the bytes).
    """
    if len(payload) < 12 or frame_kind(payload) == "message":
        raise ChunkError("malformed", f"{len(payload)}-byte payload is not a chunk frame")
    (hlen,) = struct.unpack("<I", payload[8:12])
    if hlen > MAX_FRAME_HEADER or 12 + hlen > len(payload):
        raise ChunkError("malformed", f"chunk frame header length {hlen} is invalid")
    try:
        h = boundedjson.loads(payload[12 : 12 + hlen], max_bytes=MAX_FRAME_HEADER, max_depth=1,
                              what="chunk frame header")
    except PayloadError as exc:
        raise ChunkError("malformed", exc.message) from exc
    if not isinstance(h, dict):
        raise ChunkError("malformed", "chunk frame header is not a JSON object")
    if h.get("v") != FRAME_VERSION:
        raise ChunkError("malformed", f"chunk frame version {str(h.get('v'))[:16]!r} is not supported "
                                      f"(this is {FRAME_VERSION})")
    part = h.get("part_sha256")
    header = FrameHeader(_field_hex(h, "id"), _field_int(h, "seq", -1, MAX_PARTS), _field_int(h, "count", 1, MAX_PARTS),
                         _field_int(h, "total", 0, MAX_TOTAL), _field_hex(h, "sha256", 64),
                         None if part is None else _field_hex(h, "part_sha256", 64))
    if header.part_sha256 is not None and not 0 <= header.seq < header.count:
        raise ChunkError("malformed", f"chunk {header.seq}/{header.count} of {header.total} bytes is impossible")
    data = bytes(payload[12 + hlen :])
    if header.part_sha256 is not None and hashlib.sha256(data).hexdigest() != header.part_sha256:
        raise ChunkError("checksum", f"chunk {header.seq}/{header.count} of transfer {header.transfer_id[:8]} "
                                     "does not match its sha256")
    return header, data


@dataclass
class _Transfer:
    header: FrameHeader
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0
    started: float = 0.0


class Reassembler:
    """Collects chunk frames per source into whole messages, with bounded memory.

    * a transfer declaring more than ``max_bytes`` is refused at its first frame (``oversize``);
    * each source keeps at most ``max_transfers`` unfinished transfers (the oldest is dropped);
    * a transfer unfinished after ``timeout_s`` is dropped by :meth:`expire` (``incomplete``);
    * a part repeated by a QoS 1 redelivery is ignored; a finished message must match its sha256.
    """

    def __init__(self, max_bytes: int, *, max_transfers: int = 2, timeout_s: float = 300.0,
                 remember: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_transfers = max_transfers
        self.timeout_s = timeout_s
        self._open: dict[str, OrderedDict[str, _Transfer]] = {}
        # Transfer ids already finished or refused, so late repeats of their frames are ignored.
        self._closed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember

    def pending_bytes(self) -> int:
        """Bytes held in unfinished transfers."""
        return sum(t.size for per in self._open.values() for t in per.values())

    def _close(self, source: str, tid: str) -> None:
        self._closed[(source, tid)] = None
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
        per = self._open.get(source)
        if per is not None:
            per.pop(tid, None)
            if not per:
                del self._open[source]

    def add(self, source: str, payload: bytes, now: float | None = None) -> bytes | None:
        """Add one chunk frame from ``source``; returns the whole message once its last part arrived."""
        now = time.monotonic() if now is None else now
        try:
            header, data = parse_frame(payload)
        except ChunkError:
            # A bad frame poisons its transfer: drop what was collected for it and ignore its
            # later frames (if we can tell which), so a bad upload is counted once, not per frame.
            tid = _peek_id(payload)
            if tid is not None:
                if (source, tid) in self._closed:
                    return None
                self._close(source, tid)
            raise
        if header.part_sha256 is None:
            raise ChunkError("malformed", "a manifest frame is not valid on an update topic")
        tid = header.transfer_id
        if (source, tid) in self._closed:
            return None
        if header.total > self.max_bytes:
            self._close(source, tid)
            raise ChunkError("oversize", f"transfer of {header.total} bytes from {source} exceeds the limit "
                                         f"of {self.max_bytes} bytes")
        per = self._open.setdefault(source, OrderedDict())
        tr = per.get(tid)
        if tr is None:
            while len(per) >= self.max_transfers:
                old, _ = per.popitem(last=False)
                self._close(source, old)
            tr = per[tid] = _Transfer(header, started=now)
        elif (header.count, header.total, header.sha256) != (tr.header.count, tr.header.total, tr.header.sha256):
            self._close(source, tid)
            raise ChunkError("malformed", f"chunk {header.seq} of transfer {tid[:8]} disagrees with its first chunk")
        if header.seq in tr.parts:
            return None  # QoS 1 redelivery
        tr.size += len(data)
        if tr.size > header.total:
            self._close(source, tid)
            raise ChunkError("malformed", f"transfer {tid[:8]} from {source} sent more bytes than it declared")
        tr.parts[header.seq] = data
        if len(tr.parts) < header.count:
            return None
        self._close(source, tid)
        message = b"".join(tr.parts[i] for i in range(header.count))
        if len(message) != header.total or hashlib.sha256(message).hexdigest() != header.sha256:
            raise ChunkError("checksum", f"transfer {tid[:8]} from {source} does not match its sha256")
        return message

    def expire(self, now: float | None = None) -> list[tuple[str, str]]:
        """Drop transfers older than ``timeout_s``; returns their (source, transfer id)."""
        now = time.monotonic() if now is None else now
        dropped = [(src, tid) for src, per in self._open.items() for tid, tr in per.items()
                   if now - tr.started > self.timeout_s]
        for src, tid in dropped:
            self._close(src, tid)
        return dropped


def _peek_id(payload: bytes) -> str | None:
    """The transfer id of a frame whose header is otherwise bad, if it has a plausible one."""
    try:
        (hlen,) = struct.unpack("<I", payload[8:12])
        h = boundedjson.loads(payload[12 : 12 + min(hlen, MAX_FRAME_HEADER)], max_bytes=MAX_FRAME_HEADER,
                              max_depth=1)
        return _field_hex(h, "id")
    except Exception:  # any junk: no id to poison
        return None


class RetainedAssembler:
    """Rebuilds one retained global state from its root topic and part topics, in any arrival order.

    The coordinator publishes the parts first and the manifest last, but a
    subscriber receives retained messages in topic order, so parts may come
    after the manifest, and stale parts of an older transfer may linger.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.manifest: FrameHeader | None = None
        self.parts: dict[str, dict[int, bytes]] = {}

    def on_root(self, payload: bytes) -> bytes | None:
        """The root topic changed: a whole message (returned) or a manifest."""
        if frame_kind(payload) == "message":
            self.manifest = None
            self.parts.clear()
            return payload
        header, _ = parse_frame(payload)
        if frame_kind(payload) != "manifest":
            raise ChunkError("malformed", "a chunk frame on a global root topic")
        if header.total > self.max_bytes:
            raise ChunkError("oversize", f"global state of {header.total} bytes exceeds {self.max_bytes} bytes")
        self.manifest = header
        self.parts = {header.transfer_id: self.parts.get(header.transfer_id, {})}
        return self._complete()

    def on_part(self, payload: bytes) -> bytes | None:
        """A part topic changed (an empty payload clears a stale part)."""
        if not payload:
            return None
        header, data = parse_frame(payload)
        if self.manifest is not None and header.transfer_id != self.manifest.transfer_id:
            # A part of a transfer we have no manifest for: keep one such transfer, it may be the next.
            stale = [t for t in self.parts if t != self.manifest.transfer_id and t != header.transfer_id]
            for t in stale:
                del self.parts[t]
        if header.total > self.max_bytes:
            raise ChunkError("oversize", f"global state of {header.total} bytes exceeds {self.max_bytes} bytes")
        self.parts.setdefault(header.transfer_id, {})[header.seq] = data
        return self._complete()

    def _complete(self) -> bytes | None:
        m = self.manifest
        if m is None:
            return None
        parts = self.parts.get(m.transfer_id, {})
        if len(parts) < m.count:
            return None
        message = b"".join(parts[i] for i in range(m.count))
        self.parts.pop(m.transfer_id, None)
        if len(message) != m.total or hashlib.sha256(message).hexdigest() != m.sha256:
            raise ChunkError("checksum", f"global transfer {m.transfer_id[:8]} does not match its sha256")
        return message
