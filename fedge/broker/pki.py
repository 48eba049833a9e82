"""The fleet's certificate authority, with the ``cryptography`` library (no openssl command, no hand-rolled crypto).

What it issues (every key EC P-256, every certificate X.509 v3, SHA-256 signatures):

* the **fleet CA** (``CN=fedge CA {fleet}``, 10 years): its key stays in ``ca/ca.key`` (0600), never read
  by the broker; its certificate is what every party trusts;
* the **broker's server certificate** (825 days) for the name devices reach it at, plus localhost and
  127.0.0.1 (``serverAuth``);
* with mutual TLS, one **client certificate** per identity — every device, the coordinator and the
  deploy tool — whose common name (CN) *is* the identity: Mosquitto's ``use_identity_as_username``
  makes the CN the user name the ACL names (``clientAuth``, 825 days by default);
* the **certificate revocation list** (``tls/crl.pem``), signed by the CA, listing every revoked serial.

``ca/index.json`` records every client certificate issued (serial, CN, validity, revocation), so a
revocation finds the serials of an identity, and ``fedge flash`` can refuse a revoked or expired one.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import asdict, dataclass
from ipaddress import ip_address
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedge.broker.options import CLIENT_DAYS
from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError

log = logging.getLogger(__name__)

CA_DAYS = 3650
SERVER_DAYS = 825
# The CRL's nextUpdate. OpenSSL refuses every client once the CRL it checks against has expired, so it is
# long; every `fedge broker config`, `revoke` and `rotate` writes a fresh one.
CRL_DAYS = 3650
INDEX_NAME = "index.json"

Key = ec.EllipticCurvePrivateKey


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> Key:
    """A fresh EC P-256 key (what Raspberry Pi-class OpenSSL handles fastest among the common choices)."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: Key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_secret(path: Path, data: bytes, mode: int = 0o600, owner: tuple[int, int] | None = None) -> None:
    """Write ``data`` atomically, created with ``mode`` (default 0600) and ``owner`` before any byte."""
    write_atomic(path, data, mode, owner)


def load_key(path: Path) -> Key:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a readable PEM private key: {exc}",
                          hint="restore it from your backup, or start a new fleet CA in a new --out directory") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{path} is not an EC private key")
    return key


def load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable PEM certificate: {exc}") from exc


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey, days: int,
             now: dt.datetime) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days)))


@dataclass
class CertificateAuthority:
    """The fleet CA: its key and certificate, kept under ``ca_dir`` (key) and ``cert_path``."""

    key: Key
    cert: x509.Certificate

    @classmethod
    def load_or_create(cls, ca_key: Path, ca_crt: Path, fleet: str) -> CertificateAuthority:
        """The existing CA (devices that trust it keep working), or a new one."""
        if ca_key.is_file() and ca_crt.is_file():
            ca = cls(load_key(ca_key), load_cert(ca_crt))
            spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            if ca.cert.public_key().public_bytes(*spki) != ca.key.public_key().public_bytes(*spki):
                raise ConfigError(f"{ca_key} is not the key of {ca_crt}",
                                  hint="restore the matching pair, or write a new config into a new --out directory")
            return ca
        key = new_key()
        now = utcnow()
        cert = (_builder(f"fedge CA {fleet}", _name(f"fedge CA {fleet}"), key.public_key(), CA_DAYS, now)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        write_secret(ca_key, key_pem(key))
        write_secret(ca_crt, cert_pem(cert), 0o644)
        log.info("created the fleet CA %s", ca_crt)
        return cls(key, cert)

    def _leaf(self, cn: str, public: ec.EllipticCurvePublicKey, days: int, usage: x509.ObjectIdentifier,
              now: dt.datetime, sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
        b = (_builder(cn, self.cert.subject, public, days, now)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=True,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                          crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(self.key, hashes.SHA256())

    def issue_server(self, hostname: str, days: int = SERVER_DAYS) -> tuple[Key, x509.Certificate]:
        """The broker's key and certificate: ``hostname`` (a name or an IP), localhost and 127.0.0.1."""
        sans: list[x509.GeneralName] = []
        for name in dict.fromkeys([hostname, "localhost", "127.0.0.1"]):
            try:
                sans.append(x509.IPAddress(ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        key = new_key()
        return key, self._leaf(hostname, key.public_key(), days, ExtendedKeyUsageOID.SERVER_AUTH, utcnow(), sans)

    def issue_client(self, identity: str, days: int = CLIENT_DAYS, *,
                     now: dt.datetime | None = None) -> tuple[Key, x509.Certificate]:
        """A client key and certificate whose CN is ``identity`` (the broker's user name for it).

        ``now`` moves the validity window (tests issue already-expired certificates with it)."""
        key = new_key()
        return key, self._leaf(identity, key.public_key(), days, ExtendedKeyUsageOID.CLIENT_AUTH, now or utcnow())

    def crl(self, revoked: list[IssuedCert], days: int = CRL_DAYS) -> x509.CertificateRevocationList:
        """A CRL signed by this CA listing ``revoked`` (their ``revoked`` times)."""
        now = utcnow()
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
             .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=days)))
        for r in revoked:
            when = dt.datetime.fromisoformat(r.revoked) if r.revoked else now
            b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(int(r.serial, 16))
                                          .revocation_date(when).build())
        return b.sign(self.key, hashes.SHA256())


@dataclass
class IssuedCert:
    """One client certificate the CA issued (a line of ``ca/index.json``)."""

    serial: str  # hex
    cn: str
    not_after: str  # ISO 8601, UTC
    revoked: str | None = None  # ISO 8601 when revoked

    @classmethod
    def of(cls, cert: x509.Certificate) -> IssuedCert:
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        return cls(format(cert.serial_number, "x"), str(cn), cert.not_valid_after_utc.isoformat())


class CertIndex:
    """``ca/index.json``: every client certificate issued, for revocation and checks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.certs: list[IssuedCert] = []
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
                self.certs = [IssuedCert(**c) for c in raw["certs"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path} is damaged ({exc})",
                                  hint="restore it from your backup: it lists which certificates were revoked") from exc

    def add(self, cert: x509.Certificate) -> IssuedCert:
        entry = IssuedCert.of(cert)
        self.certs.append(entry)
        return entry

    def revoke(self, cn: str, *, keep_serial: str | None = None) -> list[IssuedCert]:
        """Mark every unrevoked certificate of ``cn`` revoked (except ``keep_serial``); returns them."""
        now = utcnow().isoformat()
        hit = [c for c in self.certs if c.cn == cn and c.revoked is None and c.serial != keep_serial]
        for c in hit:
            c.revoked = now
        return hit

    def revoked(self) -> list[IssuedCert]:
        return [c for c in self.certs if c.revoked is not None]

    def is_revoked(self, serial: int) -> bool:
        s = format(serial, "x")
        return any(c.serial == s and c.revoked is not None for c in self.certs)

    def save(self) -> None:
        write_secret(self.path, (json.dumps({"certs": [asdict(c) for c in self.certs]}, indent=1) + "\n").encode(),
                     0o600)
