"""t-of-n Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 − 1).

A secret s (a mask seed or an X25519 private key, 32 bytes, so s < 2^256 < p) is the constant term of a random
polynomial of degree t − 1; share i is (i, f(i)) for the holder numbered i ≥ 1. Any t shares give s by Lagrange
interpolation at 0; fewer say nothing about it (every s is equally likely). The prime is the Mersenne prime
M521, so a share's value fits 66 bytes; the polynomial's coefficients come from the OS's entropy.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

from fedge.errors import PayloadError

PRIME = (1 << 521) - 1
SECRET_BYTES = 32
VALUE_BYTES = 66  # ⌈521 / 8⌉

Share = tuple[int, int]  # (x ≥ 1, f(x) mod PRIME)


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> list[Share]:
    """Shares of ``secret`` for the holders numbered ``xs`` (distinct, ≥ 1); any ``threshold`` of them recover it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret has {SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs) or any(x < 1 or x >= PRIME for x in xs):
        raise ValueError("share numbers must be distinct integers >= 1")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must be in [1, {len(xs)}] (the number of shares)")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def combine(shares: Sequence[Share], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (the first ``threshold`` distinct ones are used).

    Fewer shares, repeated numbers or a result that is no 32-byte secret (shares of different secrets mixed,
    or altered) raise :class:`PayloadError`."""
    distinct: dict[int, int] = {}
    for x, y in shares:
        if x in distinct and distinct[x] != y:
            raise PayloadError(f"two different shares numbered {x}")
        distinct[x] = y
    if len(distinct) < threshold:
        raise PayloadError(f"{len(distinct)} shares cannot recover a secret shared {threshold}-of-n")
    points = list(distinct.items())[:threshold]
    # Lagrange at 0: secret = Σ y_i · Π_{j≠i} x_j / (x_j − x_i). Share numbers are small, so each product is
    # taken exactly and reduced once; one modular inverse serves all denominators (Montgomery's trick).
    xs = [x for x, _ in points]
    nums = [math.prod(xj for xj in xs if xj != xi) % PRIME for xi in xs]
    dens = [math.prod(xj - xi for xj in xs if xj != xi) % PRIME for xi in xs]
    prefix = [1]
    for d in dens:
        prefix.append(prefix[-1] * d % PRIME)
    inv = pow(prefix[-1], -1, PRIME)
    secret = 0
    for i in range(len(points) - 1, -1, -1):
        inv_i = inv * prefix[i] % PRIME  # 1 / dens[i]
        inv = inv * dens[i] % PRIME  # 1 / (dens[0] … dens[i-1])
        secret = (secret + points[i][1] * nums[i] % PRIME * inv_i) % PRIME
    if secret >> (8 * SECRET_BYTES):
        raise PayloadError("the shares do not recover a 32-byte secret (mixed or altered shares)")
    return secret.to_bytes(SECRET_BYTES, "big")


def value_bytes(y: int) -> bytes:
    """A share's value as :data:`VALUE_BYTES` big-endian bytes."""
    return y.to_bytes(VALUE_BYTES, "big")


def value_from(raw: bytes) -> int:
    """The inverse of :func:`value_bytes`; :class:`PayloadError` when it is no field element."""
    if len(raw) != VALUE_BYTES:
        raise PayloadError(f"a share value has {VALUE_BYTES} bytes, got {len(raw)}")
    y = int.from_bytes(raw, "big")
    if y >= PRIME:
        raise PayloadError("a share value is not below the field's prime")
    return y
