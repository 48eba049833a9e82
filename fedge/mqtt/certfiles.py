"""A client's certificate and key files, checked before they are used to connect (mutual TLS).

An expired, not yet valid or mismatched certificate would otherwise surface as a TLS alert from the broker
("certificate expired", "handshake failure") on every reconnect attempt; checked here, it is one error that
names the file, the date and the fix, before anything connects.
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

from fedge.errors import ConfigError

log = logging.getLogger(__name__)


def check_client_files(cert_file: str, key_file: str, *, now: dt.datetime | None = None) -> str:
    """The certificate's common name (the account it connects as), after checking both files; a
    :class:`ConfigError` naming the file and the fix otherwise."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    cert_path, key_path = Path(cert_file), Path(key_file)
    fix = "issue a new certificate: fedge broker rotate DEVICE --out BROKER_DIR, then flash the device again"
    for what, p in (("client certificate", cert_path), ("client key", key_path)):
        if not p.is_file():
            raise ConfigError(f"{what} {p} does not exist", hint="give the files `fedge broker config --mtls` wrote "
                                                                  "(a device bundle has device.crt and device.key)")
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError as exc:
        raise ConfigError(f"client certificate {cert_path} is not a PEM certificate: {exc}", hint=fix) from exc
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"client key {key_path} is not an unencrypted PEM private key: {exc}", hint=fix) from exc
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = str(cns[0].value) if cns else ""
    now = now or dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc <= now:
        raise ConfigError(f"client certificate {cert_path} ({cn}) expired on "
                          f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: the broker refuses it", hint=fix)
    if cert.not_valid_before_utc > now:
        raise ConfigError(f"client certificate {cert_path} ({cn}) is not valid before "
                          f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this machine's clock right?)",
                          hint="set the clock (NTP), or issue a new certificate")
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (cert.public_key().public_bytes(serialization.Encoding.DER, pub)
            != key.public_key().public_bytes(serialization.Encoding.DER, pub)):
        raise ConfigError(f"client key {key_path} is not the key of certificate {cert_path}", hint=fix)
    if key_path.stat().st_mode & 0o077:
        log.warning("client key %s is readable by others (mode %o): chmod 600 it", key_path,
                    key_path.stat().st_mode & 0o777)
    return cn
