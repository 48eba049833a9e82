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

A sharded fleet's tree (``fedge broker config --shards N``, :mod:`fedge.broker.shards`) is one identity domain:
its root directory ``OUT`` holds the one CA key and the one certificate index (``OUT/ca/index.json``) for every
broker of the tree, and every broker directory (``OUT`` and each ``OUT/shards/shard-NAME``) has an identical copy
of the CRL. ``revoke`` and ``rotate`` take the root and act on every broker whose files hold the identity:

================  ================================================  =========================================
account           certificate (mutual TLS) or password              the brokers it has rights on (its ACL)
================  ================================================  =========================================
a device ``ID``   shards/shard-S/bundles/ID/, copied to bundles/ID  its shard's
relay ``relay-S`` relays/relay-S/, copied to shards/shard-S/        its parent's (root or shard) and shard S's
                  coordinator/
worker ``K``      workers/worker-K/                                 the root's
================  ================================================  =========================================
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
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


def write_crl(ca: CertificateAuthority, index: CertIndex, *tls_dirs: Path) -> list[Path]:
    """``tls/crl.pem`` in each of ``tls_dirs`` listing every revoked certificate (readable by the broker: public
    data). One CRL is signed and its bytes written everywhere: the brokers of a tree hold identical copies."""
    from cryptography.hazmat.primitives import serialization

    data = ca.crl(index.revoked()).public_bytes(serialization.Encoding.PEM)
    paths = [d / CRL_NAME for d in tls_dirs]
    for path in paths:
        write_secret(path, data, 0o644)
    return paths


@dataclass
class Issuer:
    """The client certificates of one ``fedge broker config`` run: one CA, one index, each identity issued (or
    kept) at most once per run. An identity whose certificate belongs in several directories — a relay's in
    ``relays/`` and as its shard's coordinator, the deploy account's on every broker of a tree — gets copies of
    that one certificate: issuing it a second time would revoke the first (:func:`ensure_client_cert`)."""

    ca: CertificateAuthority
    index: CertIndex
    rotate: bool = False
    days: int = CLIENT_DAYS
    placed: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # identity -> its (crt, key) of this run

    @classmethod
    def at(cls, out: Path, ca: CertificateAuthority, *, rotate: bool = False, days: int = CLIENT_DAYS) -> Issuer:
        """The issuer of the broker directory (or tree root) ``out``: its index ``out/ca/index.json``."""
        return cls(ca, CertIndex(out / "ca" / INDEX_NAME), rotate=rotate, days=days)

    def ensure(self, directory: Path, stem: str, identity: str) -> None:
        """``directory/{stem}.crt`` + ``.key``: ``identity``'s certificate (kept, issued, or a copy of the one this
        run already placed elsewhere)."""
        crt, key = directory / f"{stem}.crt", directory / f"{stem}.key"
        first = self.placed.get(identity)
        if first is None:
            ensure_client_cert(self.ca, self.index, directory, stem, identity, rotate=self.rotate, days=self.days)
            self.placed[identity] = (crt, key)
        elif first != (crt, key):
            write_secret(key, first[1].read_bytes(), 0o600)
            write_secret(crt, first[0].read_bytes(), 0o644)

    def finish(self, tls_dirs: list[Path]) -> list[Path]:
        """Write the one CRL into every broker's ``tls_dirs``, then save the index. In this order, a run cut
        short between the two is repeated whole (the index does not yet say the revocation happened), never
        left with a CRL that misses what the index calls revoked."""
        crls = write_crl(self.ca, self.index, *tls_dirs)
        self.index.save()
        return crls


@dataclass(frozen=True)
class Change:
    """What ``revoke`` or ``rotate`` did, for the command's report."""

    device: str  # the identity: a device, or in a tree also a relay or a worker
    mode: str  # "mtls" or "password"
    revoked: list[IssuedCert]
    issued: IssuedCert | None
    reload: str  # how to make the brokers see it
    secrets: list[Path] = field(default_factory=list)  # the directories of its secrets (the first: where issued)
    changed: list[Path] = field(default_factory=list)  # the files the brokers read that changed (CRLs or passwd)
    tree: bool = False  # a sharded fleet's tree (several brokers)
    stem: str = DEVICE_STEM  # its certificate's file stem: a device's bundle holds device.crt, others client.crt


SHARDS_DIR = "shards"


def tree_brokers(out: Path) -> list[Path]:
    """The broker directories ``fedge broker config`` wrote to ``out``: ``out`` itself and, when it is a sharded
    fleet's root, every shard's (``shards/shard-NAME``), root first."""
    shards = out / SHARDS_DIR
    if not shards.is_dir():
        return [out]
    return [out, *sorted(d for d in shards.iterdir() if (d / "mosquitto.conf").is_file())]


def tree_root(out: Path) -> Path | None:
    """The root of the sharded broker tree whose shard directory (``ROOT/shards/shard-NAME``) ``out`` is, else
    None: the tree's certificate index and CA key live at its root only."""
    if out.parent.name == SHARDS_DIR and (out.parent.parent / "mosquitto.conf").is_file():
        return out.parent.parent
    return None


@dataclass(frozen=True)
class _Account:
    """Where one identity lives in a broker directory or tree."""

    name: str
    stem: str  # DEVICE_STEM or CLIENT_STEM
    dirs: list[Path]  # the directories of its secrets, the first where its certificate is issued
    brokers: list[Path]  # the broker directories whose ACL names it: those it has rights on


def _acl_names(broker: Path, name: str) -> bool:
    acl = broker / "acl"
    return acl.is_file() and f"user {name}" in acl.read_text().splitlines()


def _account(out: Path, name: str) -> tuple[_Account, list[Path]]:
    """``name``'s account in the broker directory or tree ``out``, and the tree's broker directories."""
    check_name(name, "device id")
    if not out.is_dir():
        raise ConfigError(f"broker directory {out} does not exist", hint="pass the --out of `fedge broker config`")
    root = tree_root(out)
    if root is not None:
        # a shard's directory alone would miss the tree's index, the other brokers' CRLs and the bundle copies
        raise ConfigError(f"{out} is a shard's broker directory of the tree at {root}: the tree has one certificate "
                          "index and CA key, at its root", hint=f"pass --out {root}: revoke and rotate act on every "
                                                                "broker of the tree")
    brokers = tree_brokers(out)
    shards = brokers[1:]
    # a device's secrets: written in its shard's bundle (a flat broker's own), copied to the root's bundles/
    dirs = [b / "bundles" / name for b in [*shards, out] if (b / "bundles" / name).is_dir()]
    stem = DEVICE_STEM
    if not dirs and shards and (out / "relays" / name).is_dir():
        shard = out / SHARDS_DIR / f"shard-{name.removeprefix('relay-')}" / "coordinator"  # its shard's coordinator
        dirs, stem = [out / "relays" / name, *([shard] if shard.is_dir() else [])], CLIENT_STEM
    elif not dirs and shards and (out / "workers" / name).is_dir():
        dirs, stem = [out / "workers" / name], CLIENT_STEM
    if not dirs:
        known = sorted({p.name for b in [*shards, out] if (b / "bundles").is_dir() for p in (b / "bundles").iterdir()})
        if not shards:
            raise ConfigError(f"{out} has no device {name!r}", hint=f"its devices are {', '.join(known[:8]) or 'none'}")
        others = sorted(p.name for sub in ("relays", "workers") if (out / sub).is_dir() for p in (out / sub).iterdir())
        raise ConfigError(f"the sharded broker tree {out} has no device, relay or worker {name!r}",
                          hint=f"its devices are {', '.join(known[:8]) or 'none'}"
                               f"{'; its relays and workers ' + ', '.join(others) if others else ''}")
    return _Account(name, stem, dirs, [b for b in brokers if _acl_names(b, name)]), brokers


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


def _brokers_text(brokers: list[Path]) -> str:
    return ", ".join(f"`mosquitto -c {b / 'mosquitto.conf'}`" for b in brokers) or "none"


def _reload(mode: str, account: _Account, brokers: list[Path]) -> str:
    """How to make the brokers see a change of ``account``: the one-broker text, or which brokers of a tree."""
    if len(brokers) == 1:
        return MTLS_RELOAD if mode == "mtls" else PASSWORD_RELOAD
    if mode == "mtls":
        # every broker's CRL changed: a certificate of the tree's CA connects to any broker of the tree (the ACL
        # then grants it nothing outside its own), so each must re-read the CRL; only those it has rights on need
        # a restart to cut a connection it has now
        return (f"reload every broker of the tree so new connections are checked against the CRL (kill -HUP the pid "
                f"of each: {_brokers_text(brokers)}); a connection {account.name} already has stays up until it "
                f"drops: restart {_brokers_text(account.brokers)} to cut it now")
    return (f"reload {_brokers_text(account.brokers)} (kill -HUP its pid): Mosquitto re-reads passwd on SIGHUP; "
            "the tree's other brokers have no account for it")


def revoke(out: Path, device: str) -> Change:
    """Revoke ``device`` (in a tree also a relay or worker): its certificate into the CRL of every broker (mTLS)
    or its passwd lines removed; its secrets deleted from every directory holding them, so it cannot be flashed
    again until :func:`rotate` gives it a new identity."""
    out = out.resolve()
    account, brokers = _account(out, device)
    tree = len(brokers) > 1
    if is_mtls(out):
        issuer = Issuer.at(out, _load_ca(out))
        revoked = issuer.index.revoke(device)
        if not revoked:
            raise ConfigError(f"{device} has no valid certificate to revoke (already revoked?)",
                              hint=f"issue a new one with `fedge broker rotate {device} --out {out}`")
        crls = issuer.finish([b / "tls" for b in brokers])
        for d in account.dirs:
            for suffix in (".crt", ".key"):
                (d / f"{account.stem}{suffix}").unlink(missing_ok=True)
        return Change(device, "mtls", revoked, None, _reload("mtls", account, brokers), account.dirs, crls, tree,
                      account.stem)
    targets = account.brokers if tree else brokers
    for b in targets:
        _set_passwd(b, device, None)
    for d in account.dirs:
        (d / "password").unlink(missing_ok=True)
    return Change(device, "password", [], None, _reload("password", account, brokers), account.dirs,
                  [b / "passwd" for b in targets], tree, account.stem)


def rotate(out: Path, device: str, *, days: int = CLIENT_DAYS, iterations: int = PBKDF2_ITERATIONS) -> Change:
    """A new identity for ``device`` (in a tree also a relay or worker): a new key and certificate (the old one
    revoked, in the CRL of every broker), or a new password; written into every directory of its secrets."""
    out = out.resolve()
    account, brokers = _account(out, device)
    tree = len(brokers) > 1
    if is_mtls(out):
        issuer = Issuer.at(out, _load_ca(out), rotate=True, days=days)
        before = {c.serial for c in issuer.index.revoked()}
        for d in account.dirs:  # issued into the first, copied into the others
            issuer.ensure(d, account.stem, device)
        crls = issuer.finish([b / "tls" for b in brokers])
        revoked = [c for c in issuer.index.revoked() if c.serial not in before]
        return Change(device, "mtls", revoked, issuer.index.certs[-1], _reload("mtls", account, brokers),
                      account.dirs, crls, tree, account.stem)
    pw = new_password()
    for d in account.dirs:
        write_secret(d / "password", (pw + "\n").encode(), 0o600)
    # the brokers whose ACL names it (a line revoked before comes back); a flat broker's own passwd as before
    targets = account.brokers if tree else brokers
    for b in targets:
        _set_passwd(b, device, hash_password(pw, iterations=iterations))
    return Change(device, "password", [], None, _reload("password", account, brokers), account.dirs,
                  [b / "passwd" for b in targets], tree, account.stem)


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
