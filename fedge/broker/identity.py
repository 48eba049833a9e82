"""Client identities of a fleet's broker: one certificate (mutual TLS) or one password per account, and
``fedge broker revoke`` / ``fedge broker rotate`` of one device.

Where each account's secrets live under the broker directory ``OUT``:

================  ============================  ==========================================
account           mutual TLS                    password
================  ============================  ==========================================
a device ``ID``   bundles/ID/device.{crt,key}   bundles/ID/password
the coordinator   coordinator/client.{crt,key}  coordinator/password
the deploy tool   deploy/client.{crt,key}       deploy/password
================  ============================  ==========================================

A certificate's common name is its account name. Revoking lists its serial in ``tls/crl.pem`` (Mosquitto's
``crlfile``); rotating issues a new key and certificate and revokes the old one. With passwords, revoking
deletes the account's ``passwd`` line and rotating replaces its password.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from fedge.broker.passwords import PBKDF2_ITERATIONS, hash_password, new_password
from fedge.broker.pki import (
    CLIENT_DAYS,
    INDEX_NAME,
    CertificateAuthority,
    CertIndex,
    IssuedCert,
    cert_pem,
    key_pem,
    load_cert,
    utcnow,
    write_secret,
)
from fedge.errors import ConfigError
from fedge.mqtt.topics import check_name

log = logging.getLogger(__name__)

CRL_NAME = "crl.pem"
DEVICE_STEM = "device"
CLIENT_STEM = "client"


def ca_paths(out: Path) -> tuple[Path, Path]:
    """(CA key, CA certificate) of the broker directory ``out``."""
    return out / "ca" / "ca.key", out / "tls" / "ca.crt"


def is_mtls(out: Path) -> bool:
    """Whether the broker directory was written with ``--mtls`` (it has a CRL)."""
    return (out / "tls" / CRL_NAME).is_file()


def cert_problem(cert: x509.Certificate, ca: x509.Certificate, identity: str, index: CertIndex | None = None,
                 now: dt.datetime | None = None) -> str | None:
    """Why ``cert`` cannot serve as ``identity``'s client certificate under ``ca``, or None."""
    now = now or utcnow()
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as exc:  # InvalidSignature has no message
        return f"it was not issued by the fleet CA {ca.subject.rfc4514_string()} ({type(exc).__name__})"
    cns = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    cn = str(cns[0].value) if cns else ""
    if cn != identity:
        return f"it names {cn!r}, not {identity!r}"
    if cert.not_valid_after_utc <= now:
        return f"it expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if cert.not_valid_before_utc > now:
        return f"it is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    if index is not None and index.is_revoked(cert.serial_number):
        return f"it was revoked (serial {cert.serial_number:x})"
    return None


def ensure_client_cert(ca: CertificateAuthority, index: CertIndex, directory: Path, stem: str, identity: str, *,
                       rotate: bool = False, days: int = CLIENT_DAYS) -> bool:
    """Keep ``directory/{stem}.crt`` + ``.key`` if they are a valid certificate of ``identity``, else issue new
    ones (revoking the identity's older certificates); True if it issued."""
    crt, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    if not rotate and crt.is_file() and key.is_file():
        problem = cert_problem(load_cert(crt), ca.cert, identity, index)
        if problem is None:
            return False
        log.warning("%s: issuing a new certificate for %s: %s", crt, identity, problem)
    new_key, cert = ca.issue_client(identity, days)
    index.revoke(identity)  # what it had is superseded
    write_secret(key, key_pem(new_key), 0o600)
    write_secret(crt, cert_pem(cert), 0o644)
    index.add(cert)
    return True


def write_crl(ca: CertificateAuthority, index: CertIndex, tls_dir: Path) -> Path:
    """``tls/crl.pem`` listing every revoked certificate (readable by the broker: public data)."""
    path = tls_dir / CRL_NAME
    from cryptography.hazmat.primitives import serialization

    write_secret(path, ca.crl(index.revoked()).public_bytes(serialization.Encoding.PEM), 0o644)
    return path


@dataclass(frozen=True)
class Change:
    """What ``revoke`` or ``rotate`` did, for the command's report."""

    device: str
    mode: str  # "mtls" or "password"
    revoked: list[IssuedCert]
    issued: IssuedCert | None
    reload: str  # how to make the broker see it


def _device_dir(out: Path, device: str) -> Path:
    check_name(device, "device id")
    if not out.is_dir():
        raise ConfigError(f"broker directory {out} does not exist", hint="pass the --out of `fedge broker config`")
    bdir = out / "bundles" / device
    if not bdir.is_dir():
        known = sorted(p.name for p in (out / "bundles").iterdir()) if (out / "bundles").is_dir() else []
        raise ConfigError(f"{out} has no device {device!r}",
                          hint=f"its devices are {', '.join(known[:8]) or 'none'}")
    return bdir


def _load_ca(out: Path) -> CertificateAuthority:
    ca_key, ca_crt = ca_paths(out)
    if not ca_key.is_file():
        raise ConfigError(f"{ca_key} is missing: this machine cannot sign for the fleet",
                          hint="run revoke/rotate where the CA key is kept (the broker directory you configured)")
    return CertificateAuthority.load_or_create(ca_key, ca_crt, "")


# Measured with Mosquitto 2.0.11 (tests/test_identity_mtls.py): SIGHUP re-reads crlfile, so *new* connections
# of a revoked certificate are refused; a connection it already has stays up until it drops. A restart
# drops every connection (devices reconnect; the coordinator's session survives with persistence).
MTLS_RELOAD = ("reload Mosquitto (kill -HUP its pid, or systemctl reload mosquitto) so new connections are checked "
               "against the CRL; a connection the device already has stays up until it drops: restart Mosquitto "
               "(systemctl restart mosquitto) to cut it now")
PASSWORD_RELOAD = "reload Mosquitto (kill -HUP its pid, or systemctl reload mosquitto): it re-reads passwd on SIGHUP"


def revoke(out: Path, device: str) -> Change:
    """Revoke ``device``: its certificate into the CRL (mTLS) or its passwd line removed; its secrets deleted
    from its bundle, so it cannot be flashed again until :func:`rotate` gives it a new identity."""
    out = out.resolve()
    bdir = _device_dir(out, device)
    if is_mtls(out):
        ca = _load_ca(out)
        index = CertIndex(out / "ca" / INDEX_NAME)
        revoked = index.revoke(device)
        if not revoked:
            raise ConfigError(f"{device} has no valid certificate to revoke (already revoked?)",
                              hint=f"issue a new one with `fedge broker rotate {device} --out {out}`")
        index.save()
        write_crl(ca, index, out / "tls")
        for stem in (f"{DEVICE_STEM}.crt", f"{DEVICE_STEM}.key"):
            (bdir / stem).unlink(missing_ok=True)
        return Change(device, "mtls", revoked, None, MTLS_RELOAD)
    _set_passwd(out, device, None)
    (bdir / "password").unlink(missing_ok=True)
    return Change(device, "password", [], None, PASSWORD_RELOAD)


def rotate(out: Path, device: str, *, days: int = CLIENT_DAYS, iterations: int = PBKDF2_ITERATIONS) -> Change:
    """A new identity for ``device``: a new key and certificate (the old one revoked), or a new password."""
    out = out.resolve()
    bdir = _device_dir(out, device)
    if is_mtls(out):
        ca = _load_ca(out)
        index = CertIndex(out / "ca" / INDEX_NAME)
        before = {c.serial for c in index.revoked()}
        ensure_client_cert(ca, index, bdir, DEVICE_STEM, device, rotate=True, days=days)
        index.save()
        write_crl(ca, index, out / "tls")
        revoked = [c for c in index.revoked() if c.serial not in before]
        return Change(device, "mtls", revoked, index.certs[-1], MTLS_RELOAD)
    pw = new_password()
    write_secret(bdir / "password", (pw + "\n").encode(), 0o600)
    _set_passwd(out, device, hash_password(pw, iterations=iterations))
    return Change(device, "password", [], None, PASSWORD_RELOAD)


def _set_passwd(out: Path, user: str, line_hash: str | None) -> None:
    """Replace (or, with None, delete) ``user``'s line of ``out/passwd``, keeping its owner and mode."""
    path = out / "passwd"
    if not path.is_file():
        raise ConfigError(f"{path} is missing", hint="write the broker config first: fedge broker config")
    st = path.stat()
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith(f"{user}:")]
    if line_hash is not None:
        lines.append(f"{user}:{line_hash}")
    write_secret(path, ("\n".join(lines) + "\n").encode(), 0o600, owner=(st.st_uid, st.st_gid))
