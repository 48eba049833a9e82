"""Mosquitto password hashes, written without ``mosquitto_passwd``.

Mosquitto 2.x stores ``user:$7$ITERATIONS$SALT$HASH`` where HASH is
PBKDF2-HMAC-SHA512(password, salt, ITERATIONS), SALT is 12 random bytes and
both are base64 (standard alphabet, padded). ``mosquitto_passwd`` uses 101
iterations by default; the count is part of the line, so a stronger one works
with the same broker. We generate the lines in Python rather than calling
``mosquitto_passwd -b``, which would put every password on a command line
(visible in the process table) and would need Mosquitto installed on the
machine that writes the config. ``tests/test_mqtt_broker_config.py`` checks
that Mosquitto accepts them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PBKDF2_ITERATIONS = 1000
SALT_BYTES = 12


def new_password() -> str:
    """A random password (32 URL-safe characters, 192 bits)."""
    return secrets.token_urlsafe(24)


def hash_password(password: str, *, iterations: int = PBKDF2_ITERATIONS, salt: bytes | None = None) -> str:
    """The ``$7$`` hash Mosquitto's password file accepts."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, line_hash: str) -> bool:
    """Whether ``password`` matches a ``$7$`` hash (also those written by ``mosquitto_passwd``)."""
    try:
        _, kind, iters, salt, digest = line_hash.split("$")
        if kind != "7":
            return False
        expect = base64.b64decode(digest)
        got = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(salt), int(iters))
    except ValueError:
        return False
    return hmac.compare_digest(expect, got)
