"""The cryptographic primitives of secure aggregation, all from the ``cryptography`` package.

* X25519 key agreement, its shared secret stretched by HKDF-SHA256 with a label that binds it to a purpose,
  the round and the pair (a pairwise mask seed and a share-encryption key from one agreement never coincide);
* ChaCha20-Poly1305 (AEAD) for the Shamir shares a device sends a neighbour through the coordinator: the
  associated data binds each ciphertext to (round, group, sender, receiver), so a share cannot be moved to
  another round or pair, and the coordinator that carries it cannot read or change it;
* AES-256 in counter mode as the pseudo-random generator that expands a 32-byte seed into a mask vector of
  words mod 2^k (the cipher of NIST SP 800-90A's CTR_DRBG; three times ChaCha20's speed here, with AES-NI).
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from fedge.errors import PayloadError
from fedge.secagg.fixedpoint import word_dtype

PROTOCOL_LABEL = b"fedge-secagg/v1"
KEY_BYTES = 32
NONCE_BYTES = 12


class DecryptError(PayloadError):
    """A ciphertext failed authentication: forged, altered, or meant for another pair or round."""


def new_private_key() -> bytes:
    """A fresh X25519 private key (32 raw bytes, from the OS's entropy)."""
    return X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_key(private: bytes) -> bytes:
    """The 32-byte X25519 public key of ``private``."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_key(raw: bytes) -> X25519PrivateKey:
    """The key object of 32 raw bytes (made once per key: building it costs more than an agreement)."""
    return X25519PrivateKey.from_private_bytes(raw)


def public_bytes(private: X25519PrivateKey) -> bytes:
    """The 32-byte public key of a key object."""
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def agree(private: X25519PrivateKey, peer_public: bytes, purpose: str, context: str) -> bytes:
    """A 32-byte key both ends of an X25519 pair derive: HKDF over the shared secret, labelled by ``purpose``
    (``mask`` or ``share``) and ``context`` (round, group and the pair, in an order both ends agree on)."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # a low-order point (all-zero shared secret) or a malformed key
        raise PayloadError(f"key agreement failed: {exc}") from exc
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=PROTOCOL_LABEL + b"|" + purpose.encode() + b"|" + context.encode())
    return hkdf.derive(shared)


def share_context(round_: int, group: str, sender: str, receiver: str) -> str:
    """The associated data of a share sent from ``sender`` to ``receiver``: round, group and the ordered pair."""
    return f"{round_}|{group}|{sender}->{receiver}"


def pair_context(round_: int, group: str, a: str, b: str) -> str:
    """The HKDF context of the pair {a, b}: the same whichever end derives it."""
    lo, hi = sorted((a, b))
    return f"{round_}|{group}|{lo}|{hi}"


def seal(key: bytes, plaintext: bytes, associated: str) -> bytes:
    """Encrypt and authenticate ``plaintext`` under ``key`` bound to ``associated``: nonce + ciphertext + tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated.encode())


def open_sealed(key: bytes, sealed: bytes, associated: str) -> bytes:
    """The plaintext of :func:`seal`'s output; :class:`DecryptError` when it was not sealed under ``key`` for
    exactly ``associated``."""
    if len(sealed) < NONCE_BYTES + 16:
        raise DecryptError(f"ciphertext of {len(sealed)} bytes is shorter than a nonce and a tag")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated.encode())
    except InvalidTag as exc:
        raise DecryptError("share failed authentication (forged, altered, or meant for another device)") from exc


@lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    """The plaintext whose encryption is the key stream (kept: a vector's length repeats every round)."""
    return bytes(nbytes)


def expand(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` pseudo-random words uniform in Z_{2^bits}: the AES-256-CTR key stream of ``seed`` (counter 0).

    Every seed is used for one vector only (seeds are per round and pair), so a fixed initial counter is safe.
    The array is read-only (it is the key stream's buffer): add it into another, do not change it."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a mask seed has {KEY_BYTES} bytes, got {len(seed)}")
    dtype = word_dtype(bits)
    nbytes = length * np.dtype(dtype).itemsize
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(_zeros(nbytes))
    words = np.frombuffer(stream, dtype=dtype)
    if bits not in (32, 64):
        words = words & dtype((1 << bits) - 1)
    return words
