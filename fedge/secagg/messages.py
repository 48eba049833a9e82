"""The stage messages of secure aggregation: versioned, bounded, validated, never pickled.

Every message is a JSON object read with :func:`fedge.common.boundedjson.loads` (size and depth checked before
parsing), except the masked input, a safetensors payload (:mod:`fedge.common.tensorcodec`) with one integer
tensor. Each carries ``v`` (:data:`VERSION`), ``stage``, ``round``, ``group`` and ``sender``; binary fields are
base64. Whatever does not fit is a :class:`Refusal` whose ``reason`` is one of :data:`REASONS` — the receiver
counts it and keeps serving.

The stages (device → coordinator, then coordinator → each device):

1. ``keys`` (two X25519 public keys)                → ``roster`` (its neighbours' public keys)
2. ``shares`` (a sealed share per neighbour)         → ``inbox`` (the shares sealed for it)
3. ``masked`` (the masked vector, safetensors)       → ``unmask-request`` (who survived, who dropped)
4. ``unmask`` (share values: survivors' seeds, dropped devices' mask keys)

Between a shard and the coordinator a relay forwards every stage message untouched except the masked inputs of
its devices, which it adds up modulo the field (:mod:`fedge.secagg.partial`) and sends as one ``masked-sum``
(relay → its parent): the same safetensors layout, the relay as sender, the field's bits and the devices whose
masked inputs it holds. A sum of masked inputs is as uniform as one masked input: the masks cancel only in the
group's total.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.common import boundedjson, tensorcodec
from fedge.errors import PayloadError
from fedge.secagg import crypto, shamir
from fedge.secagg.fixedpoint import FieldPlan, Segment

VERSION = 1
STAGES = ("keys", "roster", "shares", "inbox", "masked", "unmask-request", "unmask")
MASKED_SUM = "masked-sum"  # a relay's sum of its devices' masked inputs (not a device's stage)
# Every reason a stage message is refused for, as counted (docs/security.md#secure-aggregation).
REASONS = ("oversize", "malformed", "version", "stage", "round", "spoofed", "unknown-sender", "duplicate", "shape",
           "late", "forged", "inconsistent", "foreign")
MAX_DEPTH = 4
MASKED_TENSOR = "masked"
_SEALED_SHARE = crypto.NONCE_BYTES + 16 + 2 * shamir.VALUE_BYTES  # nonce, tag, two share values


class Refusal(PayloadError):
    """A stage message that is not accepted; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        super().__init__(f"secure aggregation {reason}: {message}")


@dataclass(frozen=True)
class RoundSetup:
    """What every member of one group's secure sum must agree on; the coordinator puts it in the round."""

    round: int
    group: str
    members: tuple[str, ...]  # sorted; a device's share number is its index here + 1
    degree: int  # neighbours per device (fedge.secagg.graph)
    threshold: int  # shares that recover a device's secrets (its own share counts)
    plan: FieldPlan
    seed: bytes  # the round seed the neighbour graph is drawn from

    @property
    def sum_id(self) -> str:
        """Which secure sum of the round a message belongs to (the graph seed's first 8 bytes, hex): a coordinator
        restarted mid-round plans the round's sum afresh, and a stage message of the sum before must not pass."""
        return self.seed[:8].hex()

    def number(self, device: str) -> int:
        """The Shamir share number of ``device`` (1-based)."""
        return self._numbers[device]

    @functools.cached_property
    def _numbers(self) -> dict[str, int]:
        return {m: i + 1 for i, m in enumerate(self.members)}

    @functools.cached_property
    def _id_bytes(self) -> float:
        """Mean bytes a member's id takes in a JSON object (quotes, colon, comma, escaping slack)."""
        return sum(len(m.encode()) + 8 for m in self.members) / max(len(self.members), 1)

    def to_dict(self) -> dict[str, Any]:
        return {"v": VERSION, "round": self.round, "group": self.group, "members": list(self.members),
                "degree": self.degree, "threshold": self.threshold, "bits": self.plan.bits,
                "group_size": self.plan.group_size, "segments": [s.to_dict() for s in self.plan.segments],
                "seed": self.seed.hex()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoundSetup:
        """The setup of a round descriptor; :class:`Refusal` (``malformed``/``version``) when it is not one."""
        try:
            if d.get("v") != VERSION:
                raise Refusal("version", f"setup version {d.get('v')!r}, this device speaks {VERSION}")
            segs = tuple(Segment(str(s["name"]), tuple(int(n) for n in s["shape"]), float(s["clip"]))
                         for s in d["segments"])
            plan = FieldPlan(int(d["bits"]), int(d["group_size"]), segs)
            setup = cls(int(d["round"]), str(d["group"]), tuple(str(m) for m in d["members"]), int(d["degree"]),
                        int(d["threshold"]), plan, bytes.fromhex(d["seed"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise Refusal("malformed", f"round setup: {exc}") from exc
        if list(setup.members) != sorted(set(setup.members)) or not 1 <= setup.threshold <= len(setup.members):
            raise Refusal("malformed", "round setup: members must be sorted and distinct, 1 <= threshold <= members")
        if not 16 <= plan.bits <= 64 or plan.group_size < len(setup.members):
            raise Refusal("malformed", f"round setup: a {plan.bits}-bit field for {plan.group_size} devices")
        return setup

    def limit(self, stage: str) -> int:
        """The most bytes a valid ``stage`` message of this setup can have (headers and base64 included)."""
        ids = self._id_bytes
        per_peer = {"keys": 0, "roster": 2 * 48, "shares": math.ceil(_SEALED_SHARE * 4 / 3),
                    "inbox": math.ceil(_SEALED_SHARE * 4 / 3), "unmask-request": 0,
                    "unmask": math.ceil(shamir.VALUE_BYTES * 4 / 3) + 8}
        base = 1024 + 2 * len(self.group.encode())
        if stage == "masked":
            return base + 8 * self.plan.length + 4096
        if stage == "unmask-request":
            return base + int(len(self.members) * ids)
        if stage == "keys":
            return base + 2 * 48
        return base + int((self.degree + 1) * (per_peer[stage] + ids))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def unb64(text: object, what: str, size: int | None = None) -> bytes:
    """Bytes of a base64 field; :class:`Refusal` ``malformed`` unless it decodes (to ``size`` bytes)."""
    if not isinstance(text, str):
        raise Refusal("malformed", f"{what} is not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Refusal("malformed", f"{what} is not base64") from exc
    if size is not None and len(raw) != size:
        raise Refusal("malformed", f"{what} has {len(raw)} bytes, expected {size}")
    return raw


def encode(setup: RoundSetup, stage: str, sender: str, body: dict[str, Any]) -> bytes:
    """A JSON stage message (every stage but ``masked``)."""
    doc = {"v": VERSION, "stage": stage, "round": setup.round, "group": setup.group, "sum": setup.sum_id,
           "sender": sender, **body}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def check_envelope(setup: RoundSetup, doc: dict[str, Any], stage: str, sender: str) -> None:
    """The common fields: version, stage, round and group of ``setup``, the sender the transport named."""
    if doc.get("v") != VERSION:
        raise Refusal("version", f"message version {str(doc.get('v'))[:16]!r}, expected {VERSION}")
    if doc.get("stage") != stage:
        raise Refusal("stage", f"a {str(doc.get('stage'))[:20]!r} message where {stage!r} is expected")
    if doc.get("round") != setup.round or doc.get("group") != setup.group:
        raise Refusal("round", f"a message of round {str(doc.get('round'))[:12]} group {str(doc.get('group'))[:40]!r}"
                               f" in round {setup.round} group {setup.group!r} (replayed or misrouted)")
    if doc.get("sum") != setup.sum_id:
        raise Refusal("round", f"a message of another secure sum of round {setup.round} group {setup.group!r} "
                               "(from before the coordinator restarted, or replayed)")
    if doc.get("sender") != sender:
        raise Refusal("spoofed", f"message names sender {str(doc.get('sender'))[:64]!r} but came from {sender!r}")


def decode(setup: RoundSetup, data: bytes, stage: str, sender: str) -> dict[str, Any]:
    """A JSON stage message from ``sender``, bounded and its envelope checked (:class:`Refusal` otherwise)."""
    limit = setup.limit(stage)
    if len(data) > limit:
        raise Refusal("oversize", f"{stage} message of {len(data)} bytes exceeds {limit}")
    try:
        doc = boundedjson.loads(data, max_bytes=limit, max_depth=MAX_DEPTH, what=f"{stage} message")
    except PayloadError as exc:
        raise Refusal("malformed", exc.message) from exc
    if not isinstance(doc, dict):
        raise Refusal("malformed", f"{stage} message is not a JSON object")
    check_envelope(setup, doc, stage, sender)
    return doc


def str_map(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """``doc[key]`` as an object with string keys (:class:`Refusal` ``malformed`` otherwise)."""
    value = doc.get(key)
    if not isinstance(value, dict):
        raise Refusal("malformed", f"{key!r} must be an object")
    return value


def str_list(doc: dict[str, Any], key: str) -> list[str]:
    value = doc.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(set(value)) != len(value):
        raise Refusal("malformed", f"{key!r} must be a list of distinct device ids")
    return value


def encode_masked(setup: RoundSetup, sender: str, words: np.ndarray) -> bytes:
    """The masked input: one integer tensor (the words' bits as int32 / int64) in a safetensors payload."""
    return _encode_words(setup, "masked", sender, words, {})


def encode_masked_sum(setup: RoundSetup, sender: str, devices: list[str], words: np.ndarray) -> bytes:
    """A relay's sum of the masked inputs of ``devices`` (mod the field), as :func:`encode_masked` lays out a
    device's, with the field's bits and the devices in its metadata."""
    return _encode_words(setup, MASKED_SUM, sender, words, {
        "secagg.bits": str(setup.plan.bits), "secagg.devices": json.dumps(sorted(devices), separators=(",", ":"))})


def _encode_words(setup: RoundSetup, stage: str, sender: str, words: np.ndarray, extra: dict[str, str]) -> bytes:
    signed = words.view(np.int32 if words.dtype == np.uint32 else np.int64)
    meta = {"secagg.v": str(VERSION), "secagg.stage": stage, "secagg.round": str(setup.round),
            "secagg.group": setup.group, "secagg.sum": setup.sum_id, "secagg.sender": sender, **extra}
    return tensorcodec.encode(tensorcodec.Payload({MASKED_TENSOR: signed}, meta))


def decode_masked(setup: RoundSetup, data: bytes, sender: str) -> np.ndarray:
    """The words of a masked input from ``sender`` (:class:`Refusal` unless it is exactly one of this setup)."""
    return _decode_words(setup, data, "masked", sender, setup.limit("masked"))[0]


def masked_sum_limit(setup: RoundSetup) -> int:
    """The most bytes a valid ``masked-sum`` of this setup can have (every member listed)."""
    return setup.limit("masked") + int(len(setup.members) * setup._id_bytes) + 64


def decode_masked_sum(setup: RoundSetup, data: bytes, sender: str) -> tuple[list[str], np.ndarray]:
    """(devices, words) of relay ``sender``'s ``masked-sum``: :class:`Refusal` for another field (``shape``), a
    device list that is not a non-empty list of distinct members (``malformed``, ``duplicate``,
    ``unknown-sender``), or anything :func:`decode_masked` refuses."""
    words, meta = _decode_words(setup, data, MASKED_SUM, sender, masked_sum_limit(setup))
    if meta.get("secagg.bits") != str(setup.plan.bits):
        raise Refusal("shape", f"{sender!r} sums in a {str(meta.get('secagg.bits'))[:8]}-bit field, the round's has "
                               f"{setup.plan.bits} bits")
    try:
        devices = json.loads(meta.get("secagg.devices", ""))
    except ValueError as exc:
        raise Refusal("malformed", f"{sender!r}'s masked sum lists its devices in no JSON list") from exc
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) for d in devices):
        raise Refusal("malformed", f"{sender!r}'s masked sum must list its devices (a non-empty list of ids)")
    if len(set(devices)) != len(devices):
        raise Refusal("duplicate", f"{sender!r}'s masked sum counts a device twice")
    outside = sorted(set(devices) - set(setup.members))
    if outside:
        raise Refusal("unknown-sender", f"{sender!r}'s masked sum holds {outside[0][:64]!r}, not a member of group "
                                        f"{setup.group!r}")
    return devices, words


def masked_group(data: bytes) -> str:
    """The group a ``masked`` or ``masked-sum`` payload names (:class:`Refusal` ``malformed`` if none): which
    group's sum to check it against."""
    try:
        _, meta = tensorcodec.read_header(data)
    except PayloadError as exc:
        raise Refusal("malformed", exc.message) from exc
    group = meta.get("secagg.group")
    if not group:
        raise Refusal("malformed", "a masked payload that names no group")
    return group


def _decode_words(setup: RoundSetup, data: bytes, stage: str, sender: str, limit: int
                  ) -> tuple[np.ndarray, dict[str, str]]:
    """The words and metadata of a ``stage`` payload (``masked`` or ``masked-sum``) from ``sender``."""
    if len(data) > limit:
        raise Refusal("oversize", f"{stage} of {len(data)} bytes exceeds {limit}")
    try:
        header, meta = tensorcodec.read_header(data)
        doc = {"v": int(meta.get("secagg.v", "0")) if meta.get("secagg.v", "").isdigit() else None,
               "stage": meta.get("secagg.stage"), "group": meta.get("secagg.group"),
               "round": int(meta["secagg.round"]) if meta.get("secagg.round", "").isdigit() else None,
               "sum": meta.get("secagg.sum"),
               "sender": meta.get("secagg.sender")}
        check_envelope(setup, doc, stage, sender)
        spec = {MASKED_TENSOR: ((setup.plan.length,), "int")}
        entries = tensorcodec.check_layout(header, len(data) - 8 - tensorcodec.header_length(data))
        try:
            tensorcodec.check_spec(entries, spec, sender)
        except tensorcodec.SchemaError as exc:
            raise Refusal("shape", exc.message) from exc
        want = "I32" if setup.plan.dtype == np.uint32 else "I64"
        if entries[MASKED_TENSOR].dtype != want:
            raise Refusal("shape", f"{stage} of dtype {entries[MASKED_TENSOR].dtype}, the field needs {want}")
        tensors = tensorcodec.load_tensors(data, header, spec, sender)
    except Refusal:
        raise
    except PayloadError as exc:
        raise Refusal("malformed", exc.message) from exc
    words = np.ascontiguousarray(tensors[MASKED_TENSOR]).view(setup.plan.dtype)
    if setup.plan.bits not in (32, 64) and bool((words >> setup.plan.dtype(setup.plan.bits)).any()):
        raise Refusal("shape", f"{stage} from {sender!r} holds words outside the {setup.plan.bits}-bit field")
    return words, meta
