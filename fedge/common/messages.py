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
``kind``        ``update`` | ``global`` | ``round`` | ``hello``
``info``        JSON object with method-specific scalars (sample counts, phase, ...)
==============  =============================================================
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from fedge.common.tensorcodec import Payload, decode, encode
from fedge.errors import PayloadError

PROTOCOL_VERSION = "1"
Kind = Literal["update", "global", "round", "hello"]
KINDS: tuple[str, ...] = ("update", "global", "round", "hello")


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
    def from_bytes(cls, data: bytes, *, max_bytes: int | None = None) -> Message:
        """Decode and validate the envelope; raises :class:`PayloadError` naming the bad field."""
        payload = decode(data, max_bytes=max_bytes)
        meta = payload.meta
        missing = [k for k in ("fedge.v", "round", "msg_id", "sender", "kind") if k not in meta]
        if missing:
            raise PayloadError(f"message envelope lacks {', '.join(missing)}")
        if meta["fedge.v"] != PROTOCOL_VERSION:
            raise PayloadError(
                f"protocol version {meta['fedge.v']!r} is not supported (this is {PROTOCOL_VERSION})",
                hint="run the same fedge release on the devices and the coordinator",
            )
        if meta["kind"] not in KINDS:
            raise PayloadError(f"unknown message kind {meta['kind']!r}; expected one of {KINDS}")
        try:
            rnd = int(meta["round"])
        except ValueError as exc:
            raise PayloadError(f"envelope round {meta['round']!r} is not an integer") from exc
        try:
            info = json.loads(meta.get("info", "{}"))
        except json.JSONDecodeError as exc:
            raise PayloadError(f"envelope info is not JSON: {exc}") from exc
        if not isinstance(info, dict):
            raise PayloadError("envelope info must be a JSON object")
        return cls(
            kind=meta["kind"],  # type: ignore[arg-type]
            sender=meta["sender"],
            round=rnd,
            fleet=meta.get("fleet", "default"),
            tensors=payload.tensors,
            info=info,
            msg_id=meta["msg_id"],
        )
