"""Signed messages: the fleet's Ed25519 key, the signed frame, and replay protection.

The coordinator signs every round descriptor and global state it publishes (and ``fedge deploy`` every
model version and deployment order); a device verifies them against the fleet's public key from its
bundle. The signature travels in a frame around the message bytes, so the message itself (safetensors,
``docs/protocol.md`` section 3) is unchanged and the transports only wrap and unwrap::

    8 bytes   magic b"FDGSIGN1"
    4 bytes   H = header length, uint32 little-endian (at most 1024)
    H bytes   JSON header, UTF-8: {"alg": "ed25519", "key": key id, "seq": n, "sha256": hex digest of the body,
                                   "topic": the MQTT topic it is published on, "v": 1}
    64 bytes  Ed25519 signature of b"fedge-signed-v1\\x00" followed by the H header bytes
    rest      the body: the message

* The signature covers the header bytes exactly as sent (a verifier never re-serialises JSON), and the
  header covers the body through its sha256.
* ``topic`` binds the message to where it was published: a global state replayed on another artifact's
  topic, or as a round descriptor, is refused.
* ``seq`` grows with every message the signer signs (nanoseconds since the epoch, strictly increasing);
  a receiver refuses a message whose ``seq`` is below the newest it accepted on that topic (a *replay* of
  an older one). The same message again (equal ``seq`` and ``sha256``: a retained redelivery) is fine.
* ``key`` = the first 8 bytes of sha256(the raw 32-byte public key), hex: which key signed it.

Standard library plus ``cryptography`` (OpenSSL's Ed25519); no torch, no paho.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.common import boundedjson
from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError, PayloadError

log = logging.getLogger(__name__)

MAGIC = b"FDGSIGN1"
VERSION = 1
ALG = "ed25519"
DOMAIN = b"fedge-signed-v1\x00"
MAX_HEADER = 1024
SIG_BYTES = 64
MAX_SEQ = (1 << 63) - 1


class SignatureError(PayloadError):
    """A signed message was refused; ``reason`` is the counter key (``unsigned``, ``signature``, ``replay`` ...)."""

    def __init__(self, reason: str, message: str, *, hint: str | None = None) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}", hint=hint)


def key_id(public: Ed25519PublicKey) -> str:
    """16 hex characters naming a public key: sha256 of its raw 32 bytes, first 8 bytes."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate_key(path: str | os.PathLike[str], public_path: str | os.PathLike[str] | None = None) -> Ed25519PrivateKey:
    """A new Ed25519 key written to ``path`` (PKCS#8 PEM, mode 0600) and its public key to ``public_path``."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_atomic(path, pem, 0o600)
    if public_path is not None:
        write_atomic(public_path, public_pem(key.public_key()), 0o644)
    return key


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The fleet's signing key from a PEM file; a clear :class:`ConfigError` for anything else."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"signing key {p} does not exist",
                          hint="write one with `fedge broker config --sign` (or --mtls): coordinator/signing.key")
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"signing key {p} is not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {p} is a {type(key).__name__}, not an Ed25519 key",
                          hint="use the coordinator/signing.key that `fedge broker config` wrote")
    if p.stat().st_mode & 0o077:
        log.warning("signing key %s is readable by others (mode %o): chmod 600 it", p, p.stat().st_mode & 0o777)
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """A fleet public key from a PEM file (``fleet.pub`` in a device bundle)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"fleet public key {p} does not exist",
                          hint="copy fleet.pub from the broker directory (coordinator/fleet.pub) or re-flash")
    try:
        key = serialization.load_pem_public_key(p.read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"fleet public key {p} is not a PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"fleet public key {p} is a {type(key).__name__}, not an Ed25519 key")
    return key


@dataclass(frozen=True)
class SignedHeader:
    """The JSON header of a signed frame."""

    key: str
    seq: int
    sha256: str
    topic: str
    alg: str = ALG
    v: int = VERSION

    def to_json(self) -> bytes:
        return json.dumps({"alg": self.alg, "key": self.key, "seq": self.seq, "sha256": self.sha256,
                           "topic": self.topic, "v": self.v}, separators=(",", ":"), sort_keys=True).encode()


def is_signed(data: bytes) -> bool:
    """Whether ``data`` is a signed frame (by its magic)."""
    return bytes(data[:8]) == MAGIC


class Signer:
    """Signs messages with the fleet key; thread-safe, ``seq`` strictly increasing."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.key_id = key_id(key.public_key())
        self._lock = threading.Lock()
        self._last = 0

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Signer:
        return cls(load_private_key(path))

    def next_seq(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns())
            return self._last

    def seal(self, topic: str, body: bytes) -> bytes:
        """The signed frame of ``body`` for ``topic``."""
        header = SignedHeader(self.key_id, self.next_seq(), hashlib.sha256(body).hexdigest(), topic).to_json()
        sig = self.key.sign(DOMAIN + header)
        return b"".join((MAGIC, struct.pack("<I", len(header)), header, sig, body))

    def sign_detached(self, data: bytes) -> dict[str, str]:
        """A detached signature record of ``data`` (model manifests): alg, key id, base64 signature."""
        return {"alg": ALG, "key": self.key_id,
                "value": base64.b64encode(self.key.sign(DOMAIN + data)).decode()}


def parse_signed(data: bytes) -> tuple[SignedHeader, bytes, bytes, bytes]:
    """(header, raw header bytes, signature, body) of a signed frame; :class:`SignatureError` if malformed."""
    if not is_signed(data):
        raise SignatureError("unsigned", "the message is not signed")
    if len(data) < 12:
        raise SignatureError("malformed", "signed frame is truncated")
    (hlen,) = struct.unpack("<I", data[8:12])
    if hlen > MAX_HEADER or 12 + hlen + SIG_BYTES > len(data):
        raise SignatureError("malformed", f"signed frame header length {hlen} is invalid")
    raw = bytes(data[12 : 12 + hlen])
    try:
        h = boundedjson.loads(raw, max_bytes=MAX_HEADER, max_depth=1, what="signed frame header")
    except PayloadError as exc:
        raise SignatureError("malformed", exc.message) from exc
    if not isinstance(h, dict):
        raise SignatureError("malformed", "signed frame header is not a JSON object")
    try:
        header = SignedHeader(key=_str(h, "key", 64), seq=_int(h, "seq"), sha256=_str(h, "sha256", 64),
                              topic=_str(h, "topic", 1024), alg=_str(h, "alg", 32), v=_int(h, "v"))
    except (KeyError, TypeError, ValueError) as exc:
        raise SignatureError("malformed", f"signed frame header field {exc}") from exc
    if header.v != VERSION or header.alg != ALG:
        raise SignatureError("malformed", f"signed frame v{header.v} / {header.alg[:16]!r} is not supported "
                                          f"(this is v{VERSION} / {ALG})")
    sig = bytes(data[12 + hlen : 12 + hlen + SIG_BYTES])
    return header, raw, sig, bytes(data[12 + hlen + SIG_BYTES :])


def unwrap(data: bytes) -> bytes:
    """The message inside ``data`` when it is a signed frame, else ``data`` as it is — **without verifying** it:
    for the nodes that only route signed state and read the round descriptor (relays, aggregation workers);
    they forward the signed bytes unchanged and the devices verify them. :class:`SignatureError`
    (``malformed``) for a broken frame."""
    return parse_signed(data)[3] if is_signed(data) else data


def _str(h: Mapping[str, Any], key: str, limit: int) -> str:
    value = h[key]
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{key!r} must be a string of at most {limit} characters")
    return value


def _int(h: Mapping[str, Any], key: str) -> int:
    value = h[key]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEQ:
        raise ValueError(f"{key!r} must be a non-negative integer")
    return value


class ReplayGuard:
    """The newest ``seq`` accepted per topic; optionally kept in a JSON file across restarts."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._seen: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self._fd: int | None = None
        if self.path is not None and self.path.is_file():
            try:
                raw = json.loads(self.path.read_text())
                self._seen = {str(t): (int(v[0]), str(v[1])) for t, v in raw.items()}
            except (OSError, ValueError, TypeError, IndexError, AttributeError) as exc:
                log.warning("%s is unreadable (%s): replay protection starts from nothing", self.path, exc)

    def check(self, header: SignedHeader) -> bool:
        """Record ``header``; True if it is new, False if it is the message already accepted last; raises
        :class:`SignatureError` (``replay``) for an older one."""
        with self._lock:
            last = self._seen.get(header.topic)
            if last is not None:
                if header.seq == last[0] and header.sha256 == last[1]:
                    return False
                if header.seq <= last[0]:
                    raise SignatureError("replay", f"a message on {header.topic} signed at seq {header.seq}, older "
                                                   f"than the newest accepted ({last[0]})")
            self._seen[header.topic] = (header.seq, header.sha256)
            if self.path is not None:
                self._persist(json.dumps(self._seen).encode())
            return True

    def _persist(self, data: bytes) -> None:
        """Rewrite the file in place (one open file, no new inode per message, no fsync): a few hundred bytes,
        within one page. Creating and renaming a file per message cost 2-7 ms on this loaded machine, an fsync
        ~7 ms more. A power cut may keep the previous version (the predecessor of the newest message could be
        accepted once more) or, at worst, tear it: then the guard starts from nothing, with a warning."""
        assert self.path is not None
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.fchmod(self._fd, 0o600)
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))


class Verifier:
    """Verifies signed frames against the fleet's public key(s), with replay protection per topic."""

    def __init__(self, keys: Ed25519PublicKey | list[Ed25519PublicKey], *, guard: ReplayGuard | None = None) -> None:
        keys = keys if isinstance(keys, list) else [keys]
        self.keys = {key_id(k): k for k in keys}
        self.guard = guard if guard is not None else ReplayGuard()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, state: str | os.PathLike[str] | None = None) -> Verifier:
        """A verifier of ``path`` (PEM); ``state``: a file keeping the replay guard across restarts."""
        return cls(load_public_key(path), guard=ReplayGuard(state))

    def trust(self, keys: list[Ed25519PublicKey]) -> None:
        """Verify with ``keys`` only from now on (a key rotation: :mod:`fedge.common.keyrotation`)."""
        self.keys = {key_id(k): k for k in keys}

    def _check_signature(self, key_name: str, raw: bytes, sig: bytes, what: str) -> None:
        key = self.keys.get(key_name)
        if key is None:
            raise SignatureError("key", f"{what} is signed by key {key_name[:16]!r}, not the fleet key "
                                        f"({', '.join(self.keys)})",
                                 hint="a message from another fleet, one signed with a key this device retired, or "
                                      "a key rotation it has not seen yet (the retained key chain on "
                                      "fedge/FLEET/keys/fleet brings it)")
        try:
            key.verify(sig, DOMAIN + raw)
        except InvalidSignature as exc:
            raise SignatureError("signature", f"the signature of {what} does not verify") from exc

    def open(self, topic: str, data: bytes) -> bytes:
        """The body of a signed frame received on ``topic``, after every check; :class:`SignatureError` otherwise."""
        header, raw, sig, body = parse_signed(data)
        self._check_signature(header.key, raw, sig, f"a message on {topic}")
        if hashlib.sha256(body).hexdigest() != header.sha256:
            raise SignatureError("signature", f"the body of a message on {topic} does not match its signed sha256 "
                                              "(tampered)")
        if header.topic != topic:
            raise SignatureError("topic", f"a message signed for {header.topic[:128]!r} arrived on {topic!r}")
        self.guard.check(header)
        return body

    def verify_detached(self, data: bytes, record: Any, what: str) -> None:
        """Check a :meth:`Signer.sign_detached` record of ``data``; :class:`SignatureError` naming ``what``."""
        if not isinstance(record, dict) or set(record) != {"alg", "key", "value"}:
            raise SignatureError("unsigned", f"{what} carries no signature (expected alg, key, value)",
                                 hint="sign it with the fleet key (fedge export --signing-key)")
        if record["alg"] != ALG or not isinstance(record["value"], str) or not isinstance(record["key"], str):
            raise SignatureError("malformed", f"{what}: signature record is not an {ALG} signature")
        try:
            sig = base64.b64decode(record["value"], validate=True)
        except ValueError as exc:
            raise SignatureError("malformed", f"{what}: signature value is not base64") from exc
        self._check_signature(record["key"], data, sig, what)
