"""Rotating the fleet's signing key: the signed chain of keys, and what a device trusts after it.

``fedge broker rotate-fleet-key`` makes a new Ed25519 key and appends one **link** to the fleet's key chain:
a statement naming the new public key, signed by the old key (only the holder of the key devices trust can
name its successor) and cross-signed by the new one (whoever names a key holds its private half: no typo, no
key of someone else). The coordinator (and ``fedge deploy``) publish the whole chain retained on
``fedge/{fleet}/keys/fleet``; a device walks it from the key it trusts, verifying every link, persists the
newest key atomically and from then on accepts **only** that key: there is no grace window for the old one
(a rotation is what an operator does when the old key may have leaked; a grace window would hand that key's
holder the devices for its length). The chain, not only its last link, is published so that a device that
slept through several rotations follows them all (docs/protocol.md section 11, "Key rotation")::

    {"v": 1, "fleet": NAME, "links": [{"statement": S, "old_sig": B64, "new_sig": B64}, ...]}

    S (a JSON string, verified as the exact UTF-8 bytes received) =
      {"fleet": NAME, "n": k, "new": key id, "old": key id, "public": B64 of the raw 32-byte new key,
       "seq": nanoseconds since the epoch, "v": 1}
    old_sig = Ed25519(old key, b"fedge-key-rotation-v1\\x00" || S);  new_sig = Ed25519(new key, the same bytes)

Link ``k`` (1, 2, ...) names key ``k`` after key ``k - 1``; key 0 is the one ``fedge broker config`` wrote.
A device refuses (counted, logged, nothing changed): a chain that does not start from a key it knows
(``key``), one that ends at a key it retired (``replay``: an older chain shown again), a broken signature or
cross-signature (``signature``), and malformed JSON, keys or links (``malformed``) — including a link back to a
key retired earlier in the chain.

Standard library plus ``cryptography``; no torch, no paho.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.common import boundedjson
from fedge.common.atomicfile import write_atomic
from fedge.common.signing import MAX_SEQ, ReplayGuard, SignatureError, Verifier, key_id, load_public_key
from fedge.errors import ConfigError, PayloadError

log = logging.getLogger(__name__)

ROTATION_DOMAIN = b"fedge-key-rotation-v1\x00"
CHAIN_VERSION = 1
MAX_CHAIN_BYTES = 256 * 1024
MAX_LINKS = 256
MAX_STATEMENT = 1024
CHAIN_FILE = "fleet-keys.json"  # beside the signing key: the chain the coordinator and fedge deploy publish
KEY_STATE_FILE = "fleet-key.json"  # in a device's --state-dir: the key it trusts now, and the ones it retired
_STATEMENT_FIELDS = {"fleet", "n", "new", "old", "public", "seq", "v"}


def raw_public(key: Ed25519PublicKey) -> bytes:
    """The raw 32 bytes of an Ed25519 public key."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: Any, what: str, size: int) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * size:
        raise SignatureError("malformed", f"{what} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureError("malformed", f"{what} is not base64") from exc
    if len(raw) != size:
        raise SignatureError("malformed", f"{what} is {len(raw)} bytes, not {size}")
    return raw


@dataclass(frozen=True)
class Link:
    """One rotation: key ``old`` hands over to ``public`` (id ``new``), the ``n``-th key of the fleet."""

    statement: bytes  # exactly as signed
    fleet: str
    n: int
    old: str
    new: str
    public: Ed25519PublicKey
    seq: int
    old_sig: bytes
    new_sig: bytes

    @classmethod
    def make(cls, old_key: Ed25519PrivateKey, new_key: Ed25519PrivateKey, fleet: str, n: int,
             seq: int | None = None) -> Link:
        """A link from ``old_key`` to ``new_key``, signed by both."""
        public = new_key.public_key()
        statement = json.dumps({"fleet": fleet, "n": n, "new": key_id(public), "old": key_id(old_key.public_key()),
                                "public": _b64(raw_public(public)), "seq": seq if seq is not None else time.time_ns(),
                                "v": CHAIN_VERSION}, separators=(",", ":"), sort_keys=True).encode()
        return cls.parse(statement, old_key.sign(ROTATION_DOMAIN + statement),
                         new_key.sign(ROTATION_DOMAIN + statement))

    @classmethod
    def parse(cls, statement: bytes, old_sig: bytes, new_sig: bytes) -> Link:
        """Structural checks only (no signature): :class:`SignatureError` ``malformed`` naming what is wrong."""
        try:
            s = boundedjson.loads(statement, max_bytes=MAX_STATEMENT, max_depth=1, what="key rotation statement")
        except PayloadError as exc:
            raise SignatureError("malformed", exc.message) from exc
        if not isinstance(s, dict) or set(s) != _STATEMENT_FIELDS:
            raise SignatureError("malformed", f"a key rotation statement must have exactly the fields "
                                              f"{sorted(_STATEMENT_FIELDS)}")
        if s["v"] != CHAIN_VERSION:
            raise SignatureError("malformed", f"key rotation statement v{str(s['v'])[:8]} is not supported "
                                              f"(this is v{CHAIN_VERSION})")
        for name in ("fleet", "old", "new"):
            if not isinstance(s[name], str) or not 1 <= len(s[name]) <= 128:
                raise SignatureError("malformed", f"key rotation {name} must be a string of 1-128 characters")
        for name, top in (("n", MAX_LINKS), ("seq", MAX_SEQ)):
            if not isinstance(s[name], int) or isinstance(s[name], bool) or not 1 <= s[name] <= top:
                raise SignatureError("malformed", f"key rotation {name} must be an integer in [1, {top}]")
        try:
            public = Ed25519PublicKey.from_public_bytes(_unb64(s["public"], "the new public key", 32))
        except ValueError as exc:
            raise SignatureError("malformed", f"the new public key is not an Ed25519 key: {exc}") from exc
        if key_id(public) != s["new"]:
            raise SignatureError("malformed", f"the new public key's id is {key_id(public)}, the statement says "
                                              f"{s['new'][:16]!r}")
        if s["new"] == s["old"]:
            raise SignatureError("malformed", "a key rotation from a key to itself")
        return cls(statement, s["fleet"], s["n"], s["old"], s["new"], public, s["seq"], old_sig, new_sig)

    def verify(self, old: Ed25519PublicKey) -> None:
        """Both signatures: by the key it rotates from (``old``) and by the key it names."""
        for key, sig, who in ((old, self.old_sig, f"the old key {self.old}"),
                              (self.public, self.new_sig, f"the new key {self.new}")):
            try:
                key.verify(sig, ROTATION_DOMAIN + self.statement)
            except InvalidSignature as exc:
                raise SignatureError("signature", f"key rotation {self.n} ({self.old} -> {self.new}) is not signed "
                                                  f"by {who}") from exc

    def to_dict(self) -> dict[str, str]:
        return {"statement": self.statement.decode(), "old_sig": _b64(self.old_sig), "new_sig": _b64(self.new_sig)}


@dataclass(frozen=True)
class KeyChain:
    """The fleet's key rotations in order (each link's ``old`` is the previous link's ``new``)."""

    fleet: str
    links: tuple[Link, ...] = ()

    @property
    def last(self) -> str | None:
        """The id of the newest key (None: no rotation yet)."""
        return self.links[-1].new if self.links else None

    def extend(self, old_key: Ed25519PrivateKey, new_key: Ed25519PrivateKey) -> KeyChain:
        """This chain with one more link, from ``old_key`` (the newest key) to ``new_key``."""
        old_id = key_id(old_key.public_key())
        if self.links and self.last != old_id:
            raise ConfigError(f"the key chain ends at key {self.last}, but the signing key is {old_id}",
                              hint="the chain and the signing key belong to different fleets or rotations")
        n = self.links[-1].n + 1 if self.links else 1
        seq = max(time.time_ns(), self.links[-1].seq + 1) if self.links else None
        return KeyChain(self.fleet, (*self.links, Link.make(old_key, new_key, self.fleet, n, seq)))

    def to_bytes(self) -> bytes:
        return json.dumps({"v": CHAIN_VERSION, "fleet": self.fleet, "links": [lk.to_dict() for lk in self.links]},
                          indent=1).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes, fleet: str | None = None) -> KeyChain:
        """Structural checks of every link and of their order (no signature is checked here)."""
        try:
            d = boundedjson.loads(data, max_bytes=MAX_CHAIN_BYTES, max_depth=3, what="key chain")
        except PayloadError as exc:
            raise SignatureError("malformed", exc.message) from exc
        if not isinstance(d, dict) or set(d) != {"v", "fleet", "links"} or d["v"] != CHAIN_VERSION:
            raise SignatureError("malformed", f"a key chain is a JSON object {{v: {CHAIN_VERSION}, fleet, links}}")
        if not isinstance(d["fleet"], str) or (fleet is not None and d["fleet"] != fleet):
            raise SignatureError("key", f"a key chain of fleet {str(d['fleet'])[:64]!r}, not {fleet!r}")
        raw = d["links"]
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_LINKS:
            raise SignatureError("malformed", f"a key chain has 1-{MAX_LINKS} links")
        links: list[Link] = []
        for i, item in enumerate(raw, 1):
            if not isinstance(item, dict) or set(item) != {"statement", "old_sig", "new_sig"} \
                    or not isinstance(item["statement"], str):
                raise SignatureError("malformed", f"key chain link {i} must have exactly statement, old_sig, new_sig")
            link = Link.parse(item["statement"].encode(), _unb64(item["old_sig"], f"link {i}'s old_sig", 64),
                              _unb64(item["new_sig"], f"link {i}'s new_sig", 64))
            if link.fleet != d["fleet"] or link.n != i:
                raise SignatureError("malformed", f"key chain link {i} says fleet {link.fleet!r}, n = {link.n}")
            if links and (link.old != links[-1].new or link.seq <= links[-1].seq):
                raise SignatureError("malformed", f"key chain link {i} does not follow link {i - 1} (it rotates "
                                                  f"from {link.old}, not {links[-1].new}, or is older)")
            if link.new in {lk.old for lk in links} | {link.old}:
                raise SignatureError("malformed", f"key chain link {i} goes back to key {link.new}, retired before")
            links.append(link)
        return cls(d["fleet"], tuple(links))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyChain | None:
        """The chain in ``path`` (None if there is none); a :class:`ConfigError` if it is unreadable."""
        p = Path(path)
        if not p.is_file():
            return None
        try:
            return cls.parse(p.read_bytes())
        except (OSError, SignatureError) as exc:
            raise ConfigError(f"key chain {p} is unreadable: {exc}",
                              hint="restore it from a backup; devices trust only the newest key it names") from exc


def chain_for_key(signing_key: str | os.PathLike[str], key: Ed25519PrivateKey) -> KeyChain | None:
    """The key chain beside ``signing_key`` (``fleet-keys.json``), checked to end at ``key``; None if there is
    none (the fleet's key was never rotated)."""
    path = Path(signing_key).with_name(CHAIN_FILE)
    chain = KeyChain.load(path)
    if chain is not None and chain.last != key_id(key.public_key()):
        raise ConfigError(f"{path} ends at key {chain.last}, but {signing_key} is key {key_id(key.public_key())}",
                          hint="a rotation was interrupted: run `fedge broker rotate-fleet-key` again to finish it")
    return chain


@dataclass
class FleetKeyTrust:
    """Which fleet key a device trusts, and the rotations it followed; persisted in ``STATE/fleet-key.json``.

    The verifier it holds is the one the device's transports use: after :meth:`accept` it verifies with the
    new key only."""

    verifier: Verifier
    fleet: str
    path: Path | None = None
    retired: list[str] = field(default_factory=list)
    seq: int = 0  # seq of the newest link followed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def current(self) -> str:
        return next(iter(self.verifier.keys))

    @classmethod
    def load(cls, fleet_pub: str | os.PathLike[str], fleet: str, *, state_dir: str | os.PathLike[str] | None = None,
             guard: ReplayGuard | None = None) -> FleetKeyTrust:
        """The device's trust: its bundle's ``fleet.pub``, unless ``state_dir`` holds a key it rotated to since.

        A state that names the bundle's key as current or retired wins (the device followed rotations after it
        was flashed); a bundle key the state never heard of wins over the state (the card was flashed again,
        with a newer key or for another fleet), with a warning."""
        bundle = load_public_key(fleet_pub)
        path = Path(state_dir) / KEY_STATE_FILE if state_dir is not None else None
        verifier = Verifier(bundle, guard=guard)
        trust = cls(verifier, fleet, path)
        if path is None or not path.is_file():
            return trust
        try:
            d = json.loads(path.read_text())
            public = Ed25519PublicKey.from_public_bytes(base64.b64decode(d["public"], validate=True))
            retired, seq = [str(k) for k in d["retired"]], int(d["seq"])
            if key_id(public) != d["key"] or d["fleet"] != fleet:
                raise ValueError(f"names key {d['key']!r} of fleet {d['fleet']!r}")
        except (OSError, ValueError, TypeError, KeyError, binascii.Error) as exc:
            log.warning("%s is unreadable (%s): trusting the bundle's fleet key %s; the retained key chain "
                        "brings the rotations again", path, exc, key_id(bundle))
            return trust
        if key_id(bundle) == key_id(public) or key_id(bundle) in retired:
            if key_id(bundle) != key_id(public):
                log.info("trusting fleet key %s (rotated to after this device was flashed; %s in %s is retired)",
                         key_id(public), key_id(bundle), fleet_pub)
            verifier.trust([public])
            trust.retired, trust.seq = retired, seq
            return trust
        log.warning("%s's fleet key %s is not one %s followed (it trusts %s): the device was flashed again; "
                    "trusting the bundle's key", fleet_pub, key_id(bundle), path, key_id(public))
        return trust

    def accept(self, data: bytes) -> bool:
        """Follow the key chain ``data``: True if the device now trusts a newer key (persisted first), False if it
        already trusts the chain's newest key; :class:`SignatureError` (nothing changed) for a chain it must not
        follow."""
        chain = KeyChain.parse(data, self.fleet)
        with self._lock:
            current = self.current
            last = chain.last
            if last == current:
                return False
            if last in self.retired:
                raise SignatureError("replay", f"a key chain ending at key {last}, which this device retired "
                                               f"(it trusts {current}): an older rotation shown again")
            start = next((i for i, lk in enumerate(chain.links) if lk.old == current), None)
            if start is None:
                raise SignatureError("key", f"a key chain from key {chain.links[0].old} to {last}: none of its links "
                                            f"rotates from the key this device trusts ({current})",
                                     hint="a chain of another fleet, or one that skips keys: publish the whole chain")
            key = self.verifier.keys[current]
            followed = chain.links[start:]
            for link in followed:
                if link.new in self.retired:
                    raise SignatureError("replay", f"key rotation {link.n} goes back to key {link.new}, retired here")
                link.verify(key)
                key = link.public
            retired = [*self.retired, *(lk.old for lk in followed)]
            if self.path is not None:
                write_atomic(self.path, json.dumps({
                    "v": 1, "fleet": self.fleet, "key": last, "public": _b64(raw_public(key)), "retired": retired,
                    "seq": followed[-1].seq}, indent=1).encode() + b"\n", 0o600)
            self.verifier.trust([key])
            self.retired, self.seq = retired, followed[-1].seq
        log.warning("fleet key rotated: now trusting key %s only (retired %s)%s", last,
                    ", ".join(lk.old for lk in followed), "" if self.path else " — not persisted: no --state-dir")
        return True
