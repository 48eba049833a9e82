"""``fedge broker rotate-fleet-key``: a new fleet signing key, handed over by the old one.

In the broker directory ``OUT`` that ``fedge broker config --sign`` (or ``--mtls``) wrote:

1. ``coordinator/signing-next.key`` (0600): the new Ed25519 key;
2. ``coordinator/fleet-keys.json``: the key chain (:mod:`fedge.common.keyrotation`) with one more link, signed by
   the old key and cross-signed by the new one — what the coordinator and ``fedge deploy`` publish retained;
3. ``signing-next.key`` renamed over ``coordinator/signing.key`` (the old private key is gone: if it leaked, no
   copy of it is worth keeping);
4. every ``fleet.pub`` under ``OUT`` that held the old public key (the coordinator's, the deploy account's, every
   bundle's): a device flashed from now on trusts the new key from the start.

Each step is atomic; an interrupted run is finished by running the command again (step 1's key is reused when
step 2 already names it). Devices switch when they receive the chain, and accept only the new key after that;
the coordinator must be restarted to sign with the new key (it resumes from its ``--state-dir`` and publishes the
chain before anything it signs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.broker.pki import write_secret
from fedge.common.atomicfile import rename_atomic
from fedge.common.keyrotation import CHAIN_FILE, KeyChain
from fedge.common.signing import generate_key, key_id, load_private_key, load_public_key, public_pem
from fedge.errors import ConfigError
from fedge.mqtt.topics import check_name

log = logging.getLogger(__name__)

NEXT_KEY = "signing-next.key"


@dataclass(frozen=True)
class KeyRotation:
    """What ``rotate-fleet-key`` did, for the command's report."""

    old: str  # key ids
    new: str
    n: int  # the new key's number in the chain (the first key is 0)
    chain: Path
    signing_key: Path
    public_keys: list[Path] = field(default_factory=list)  # fleet.pub files now holding the new key


def rotate_fleet_key(out: str | os.PathLike[str], fleet: str) -> KeyRotation:
    """Rotate the fleet key of the broker directory ``out`` (see the module's docstring)."""
    outp = Path(out).resolve()
    check_name(fleet, "fleet name")
    coord = outp / "coordinator"
    key_path, chain_path, next_path = coord / "signing.key", coord / CHAIN_FILE, coord / NEXT_KEY
    if not key_path.is_file():
        raise ConfigError(f"{key_path} does not exist: this broker directory has no fleet signing key",
                          hint="pass the --out of `fedge broker config --sign` (or --mtls), on the machine that keeps "
                               "the signing key")
    old = load_private_key(key_path)
    chain = KeyChain.load(chain_path) or KeyChain(fleet)
    if chain.fleet != fleet:
        raise ConfigError(f"{chain_path} is the key chain of fleet {chain.fleet!r}, not {fleet!r}")
    new: Ed25519PrivateKey | None = None
    if next_path.is_file():  # an interrupted rotation
        pending = load_private_key(next_path)
        if chain.last == key_id(pending.public_key()):
            log.warning("finishing an interrupted rotation to key %s", chain.last)
            new, old_id = pending, chain.links[-1].old
        else:
            next_path.unlink()  # never published: a new key is made below
    if new is None:
        old_id = key_id(old.public_key())
        if chain.links and chain.last != old_id:
            raise ConfigError(f"{chain_path} ends at key {chain.last}, but {key_path} is key {old_id}",
                              hint="the chain and the signing key do not belong together: restore both from the "
                                   "same backup")
        new = generate_key(next_path)
        chain = chain.extend(old, new)
        write_secret(chain_path, chain.to_bytes(), 0o644)
    rename_atomic(next_path, key_path)  # the rotation's commit: durable before a device is told
    new_pem = public_pem(new.public_key())
    old_ids = {lk.old for lk in chain.links}  # every retired key: a file an interrupted run did not reach too
    updated = []
    for pub in sorted(outp.rglob("fleet.pub")):
        try:
            if key_id(load_public_key(pub)) in old_ids:
                write_secret(pub, new_pem, 0o644)
                updated.append(pub)
        except ConfigError as exc:
            log.warning("left %s alone: %s", pub, exc)
    log.info("rotated the fleet key of %s: %s -> %s (%d fleet.pub files)", outp, old_id, chain.last, len(updated))
    assert chain.last is not None
    return KeyRotation(old_id, chain.last, chain.links[-1].n, chain_path, key_path, updated)
