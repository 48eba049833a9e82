"""Typed messages exchanged by a method's device half and coordinator half.

Every message, in-process or over MQTT, is encoded with :mod:`fedge.common.tensorcodec`;
the envelope travels in the safetensors metadata so that a message is one
self-contained byte string. Envelope keys (all strings):

==============  =============================================================
``fedge.v``     protocol version (:data:`PROTOCOL_VERSION`)
``fleet``       fleet name
``round``       round number (decimal)
``msg_id``      sender-unique id; the pair (sender, msg_id) is never reused
``sender``      device id, or ``coordinator``
``kind``        ``update`` | ``global`` | ``round`` | ``hello`` | ``refused`` | ``health`` | ``partial``
``info``        JSON object with method-specific scalars (sample counts, phase, ...)
==============  =============================================================
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from fedge.common import boundedjson
from fedge.common.tensorcodec import Payload, TensorSpec, check_size, encode, load_tensors, read_header
from fedge.errors import PayloadError

PROTOCOL_VERSION = "1"
Kind = Literal["update", "global", "round", "hello", "refused", "health", "partial"]
KINDS: tuple[str, ...] = ("update", "global", "round", "hello", "refused", "health", "partial")
# Limits on the envelope's ``info`` JSON: methods put scalars there, a hello one level more.
MAX_INFO_BYTES = 64 * 1024
MAX_INFO_DEPTH = 8
MAX_FIELD_CHARS = 256  # sender, fleet, msg_id, round


def new_msg_id() -> str:
    """A fresh, globally unique message id."""
    return uuid.uuid4().hex


@dataclass
class Message:
    """One protocol message: an envelope plus named tensors and JSON info."""

    kind: Kind
    sender: str
    round: int
    fleet: str = "default"
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    msg_id: str = field(default_factory=new_msg_id)

    def to_bytes(self, precision: str = "fp32") -> bytes:
        """Encode this message (tensors at ``precision``)."""
        meta = {
            "fedge.v": PROTOCOL_VERSION,
            "fleet": self.fleet,
            "round": str(int(self.round)),
            "msg_id": self.msg_id,
            "sender": self.sender,
            "kind": self.kind,
            "info": json.dumps(self.info, sort_keys=True),
        }
        return encode(Payload(self.tensors, meta), precision)

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int | None = None,
                   expect: Callable[[Message], TensorSpec | None] | None = None,
                   max_info_bytes: int = MAX_INFO_BYTES) -> Message:
        """Decode and validate the envelope; raises :class:`PayloadError` naming the bad field.

        ``expect`` sees the envelope (a message without tensors yet) before any tensor is
        read: it may refuse it by raising, or return the exact tensors it must hold (see
        :func:`fedge.common.tensorcodec.load_tensors`); None reads whatever is declared.
        ``max_info_bytes``: the bound on the envelope's ``info`` (a ``partial`` lists many devices).
        """
        check_size(data, max_bytes)
        header, meta = read_header(data)
        msg = cls._envelope(meta, max_info_bytes)
        spec = expect(msg) if expect is not None else None
        msg.tensors = load_tensors(data, header, spec, msg.sender)
        return msg

    @classmethod
    def _envelope(cls, meta: dict[str, str], max_info_bytes: int = MAX_INFO_BYTES) -> Message:
        missing = [k for k in ("fedge.v", "round", "msg_id", "sender", "kind") if k not in meta]
        if missing:
            raise PayloadError(f"message envelope lacks {', '.join(missing)}")
        if meta["fedge.v"] != PROTOCOL_VERSION:
            raise PayloadError(
                f"protocol version {meta['fedge.v'][:16]!r} is not supported (this is {PROTOCOL_VERSION})",
                hint="run the same fedge release on the devices and the coordinator",
            )
        if meta["kind"] not in KINDS:
            raise PayloadError(f"unknown message kind {meta['kind'][:16]!r}; expected one of {KINDS}")
        for key in ("round", "msg_id", "sender", "fleet"):
            if len(meta.get(key, "")) > MAX_FIELD_CHARS:
                raise PayloadError(f"envelope {key} is longer than {MAX_FIELD_CHARS} characters")
        text = meta["round"]
        if not (text.isascii() and text.lstrip("-").isdigit() and len(text) <= 12):
            raise PayloadError(f"envelope round {text[:16]!r} is not an integer")
        info = boundedjson.loads(meta.get("info", "{}"), max_bytes=max_info_bytes, max_depth=MAX_INFO_DEPTH,
                                 what="envelope info")
        if not isinstance(info, dict):
            raise PayloadError("envelope info must be a JSON object")
        return cls(
            kind=meta["kind"],  # type: ignore[arg-type]
            sender=meta["sender"],
            round=int(text),
            fleet=meta.get("fleet", "default"),
            info=info,
            msg_id=meta["msg_id"],
        )
