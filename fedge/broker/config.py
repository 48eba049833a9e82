"""Write a Mosquitto configuration for a fleet: accounts, hashed passwords or certificates, ACL, limits, TLS,
bundles, the fleet's signing key.

Layout of the output directory::

    mosquitto.conf            the broker config (run: mosquitto -c DIR/mosquitto.conf)
    passwd                    user:$7$... lines, one per device plus the coordinator and deploy accounts
                              (not with --mtls: certificates replace passwords)
    acl                       who may read and write which topic (user = account = certificate CN)
    coordinator/              password (0600), or with --mtls client.crt + client.key (0600); ca.crt with TLS;
                              with --sign or --mtls: signing.key (the fleet's Ed25519 key, 0600) and fleet.pub
    deploy/                   the same for `fedge deploy`'s account (fleet-deploy), and fleet.pub
    bundles/ID/               per device: bundle.toml, fleet.toml, password (0600) or device.crt + device.key
                              (0600), ca.crt with TLS, fleet.pub when the fleet signs
    tls/                      with --tls/--mtls, what the broker reads: ca.crt, server.crt, server.key (0600),
                              crl.pem (--mtls: the revoked client certificates)
    ca/ca.key, ca/index.json  with TLS, the CA's private key (0600; the broker never reads it) and, with
                              --mtls, every client certificate issued (for revoke / rotate)
    data/                     Mosquitto persistence (retained state and the coordinator's session
                              survive a broker restart)

Identity: ``use_username_as_clientid`` makes every client's id its user name, so
device A's password (or certificate) can neither connect as device B (kicking B off,
firing its last-will) nor as the coordinator (wiping its persistent session). With
``--mtls`` the user name is the CN of the client's certificate (``use_identity_as_username``).

Ownership: Mosquitto started as root reads the password file, the ACL and the
server key only after dropping to its ``user`` (default ``mosquitto``). Written
as root, those files and ``data/`` are handed to that account; written as
another user, Mosquitto must run as that user (see :func:`ownership_warnings`).

Running it again keeps existing passwords, certificates, the CA and the signing key
(devices keep working); ``rotate=True`` issues new passwords or certificates.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fedge.broker.identity import CLIENT_STEM, CRL_NAME, DEVICE_STEM, Issuer
from fedge.broker.limits import QueueLimits, largest_model_bytes, queue_limits
from fedge.broker.options import BrokerOptions
from fedge.broker.passwords import hash_password, new_password
from fedge.broker.pki import CertificateAuthority, cert_pem, key_pem, write_secret
from fedge.common.atomicfile import rename_atomic, write_atomic
from fedge.common.families import GEFL_FAMILY
from fedge.common.signing import generate_key, load_private_key, public_pem
from fedge.errors import ConfigError
from fedge.mqtt.topics import DEVICE_KINDS, FleetTopics, check_name

log = logging.getLogger(__name__)

# Mosquitto's default ``user``: the account it drops to when started as root ("nobody" if absent).
MOSQUITTO_USER = "mosquitto"
# Without a fleet config: a fleet of the largest tier's FedAvg updates.
DEFAULT_LARGEST_MESSAGE = largest_model_bytes([None]) + 64 * 1024


@dataclass
class BrokerFiles:
    """Paths written (and the accounts created)."""

    out: Path
    config: Path
    passwd: Path
    acl: Path
    users: list[str] = field(default_factory=list)
    bundles: list[Path] = field(default_factory=list)
    ca: Path | None = None
    signing_key: Path | None = None  # the coordinator's Ed25519 key (with --sign or --mtls)
    limits: QueueLimits | None = None
    warnings: list[str] = field(default_factory=list)  # what may stop `mosquitto -c` from working


def acl_text(fleet: str, devices: list[str], coordinator: str, deploy: str | None = None) -> str:
    """The ACL: each device writes exactly its own status, hello, update, health, secure-aggregation and OTA status
    topics and reads rounds, globals, model packages, its own deployment order and its own secure-aggregation
    stage messages; the coordinator reads every device topic
    and may clear (write) their retained copies; the deploy account writes ``ota/#`` and reads the devices'
    OTA statuses. Under mutual TLS the user name is the certificate's CN.

    Mosquitto's ACL cannot refuse the retain flag per topic, so a device could keep a retained
    message on each topic it may write: five exact topics (no ``#``) bound that to five messages
    of at most ``max_packet_size`` per device, and the coordinator deletes a retained update or a
    malformed retained status as soon as it sees one (:mod:`fedge.mqtt.coordinator_transport`).
    """
    t = FleetTopics(fleet)
    lines = [
        f"# fedge fleet {fleet}: written by `fedge broker config`. Mosquitto denies whatever is not granted.",
        "",
        f"user {coordinator}",
        *(f"topic readwrite {t.device_filter(kind)}" for kind in DEVICE_KINDS),  # type: ignore[arg-type]
        f"topic readwrite {t.base}/rounds/#",
        f"topic readwrite {t.base}/global/#",
        f"topic readwrite {t.base}/refused/+",
        f"topic readwrite {t.base}/secagg/+",  # secure aggregation's stage messages to each device
        f"topic readwrite {t.fleet_keys}",  # the fleet key's rotations (the key chain)
        # partial aggregates of aggregation workers and relays (docs/scale.md), and the relays' statuses
        f"topic readwrite {t.partial_filter}",
        f"topic read {t.base}/relays/+/status",
        f"topic read {t.relay_secagg_filter}",  # relays' sums of their devices' masked inputs (secure rounds)
    ]
    if deploy is not None:
        lines += ["", f"user {deploy}", f"topic readwrite {t.base}/ota/#", f"topic read {t.ota_status_filter()}",
                  f"topic readwrite {t.fleet_keys}"]
    for dev in devices:
        lines += ["", f"user {dev}"]
        lines += [f"topic write {t.device(dev, kind)}" for kind in DEVICE_KINDS]  # type: ignore[arg-type]
        lines += [f"topic read {t.base}/rounds/#", f"topic read {t.base}/global/#", f"topic read {t.refused(dev)}",
                  f"topic read {t.secagg_to(dev)}", f"topic read {t.fleet_keys}"]
        if deploy is not None:
            lines += [f"topic write {t.ota_status(dev)}", f"topic read {t.ota_order(dev)}",
                      f"topic read {t.base}/ota/models/#"]
    return "\n".join(lines) + "\n"


def mosquitto_conf(out: Path, opts: BrokerOptions, *, tls_dir: Path | None, limits: QueueLimits) -> str:
    """The broker config (Mosquitto 2 option names); every path absolute so mosquitto can be started
    from anywhere."""
    lines = [
        "# Mosquitto config for a fedge fleet, written by `fedge broker config`.",
        "# Start: mosquitto -c " + str(out / "mosquitto.conf"),
        "per_listener_settings false",
        "allow_anonymous false",
        *([] if opts.mtls else [f"password_file {out / 'passwd'}"]),
        f"acl_file {out / 'acl'}",
        "",
        f"listener {opts.port} {opts.bind}",
        "# A client's id is its user name: one device's password cannot take over another's connection",
        "# or the coordinator's persistent session. (A listener option: it must follow `listener`, or",
        "# Mosquitto opens a second, default listener on 1883 for it.)",
        "use_username_as_clientid true",
    ]
    if tls_dir is not None:
        lines += [
            f"cafile {tls_dir / 'ca.crt'}",
            f"certfile {tls_dir / 'server.crt'}",
            f"keyfile {tls_dir / 'server.key'}",
            "tls_version tlsv1.2",
        ]
    if tls_dir is not None and opts.mtls:
        lines += [
            "# Mutual TLS: a client must present a certificate of the fleet CA; its CN is its user name (the",
            "# ACL's `user`), no password is read. Revoked certificates are listed in crlfile, which Mosquitto",
            "# re-reads on SIGHUP (for new connections; an open connection stays until it drops: restart to cut it).",
            "require_certificate true",
            "use_identity_as_username true",
            f"crlfile {tls_dir / CRL_NAME}",
        ]
    lines += [
        "",
        f"# One packet: a chunk (--chunk-bytes {opts.chunk_bytes}; fedge chunks every larger message) or a small",
        "# message, plus headers. A larger packet disconnects its sender.",
        f"max_packet_size {limits.max_packet_size}",
        "# Per-client queues (QoS 1, while a client is offline or slow): every device's update, twice,",
        "# for the coordinator's persistent session while it restarts. Beyond them messages are dropped.",
        f"max_queued_messages {limits.max_queued_messages}",
        f"max_queued_bytes {limits.max_queued_bytes}",
        f"max_inflight_messages {limits.max_inflight_messages}",
        "# Small messages (round descriptors, statistics) must not wait for Nagle's algorithm.",
        "set_tcp_nodelay true",
        "",
        "# Retained state (round descriptor, global state, device status) and the coordinator's session",
        "# survive a restart. Saved at shutdown (SIGTERM) and every autosave_interval seconds: a SIGKILL",
        "# loses what changed since the last save, which the coordinator republishes on reconnecting.",
        "persistence true",
        f"persistence_location {out / 'data'}/",
        "autosave_interval 30",
        "",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "",
        "# The account mosquitto drops to when started as root: it reads passwd, acl, the server key and",
        "# writes data/ (`fedge broker config` run as root hands these files to it).",
        f"user {opts.run_as or MOSQUITTO_USER}",
    ]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Write atomically; the file is created with ``mode`` (never the umask's) and ``owner`` before
    any byte is in it, then renamed over ``path``."""
    write_atomic(path, text.encode(), mode, owner)


def broker_account(run_as: str | None) -> tuple[int, int] | None:
    """(uid, gid) Mosquitto will run as when started by the current user, or None if that is us.

    Started as root it drops to ``run_as`` (default ``mosquitto``, or ``nobody`` when that account
    does not exist, as Mosquitto itself does); started as anyone else it stays that user.
    """
    if os.geteuid() != 0:
        return None
    names = [run_as] if run_as else [MOSQUITTO_USER, "nobody"]
    for name in names:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        return pw.pw_uid, pw.pw_gid
    raise ConfigError(f"--run-as {run_as!r} is not an account on this machine",
                      hint="name an existing user (Mosquitto drops to it when started as root)")


def ownership_warnings(out: Path, account: tuple[int, int] | None, run_as: str | None) -> list[str]:
    """What would stop the broker's account from reaching the files it reads."""
    warnings = []
    if account is None and run_as and run_as != pwd.getpwuid(os.geteuid()).pw_name:
        warnings.append(f"not root: passwd, acl and the keys stay owned by {pwd.getpwuid(os.geteuid()).pw_name}; "
                        f"before starting mosquitto as root run: chown -R {run_as} {out}/passwd {out}/acl "
                        f"{out}/data{' ' + str(out / 'tls') if (out / 'tls').exists() else ''}")
    if account is not None and account[0] != 0:
        # Every directory above the config must be searchable by the broker's account.
        for parent in [out, *out.parents]:
            st = parent.stat()
            if st.st_uid != account[0] and not st.st_mode & 0o001:
                warnings.append(f"{parent} is not searchable by the broker's account (uid {account[0]}): "
                                f"chmod o+x {parent}, or write the config elsewhere (e.g. /etc/fedge/broker)")
                break
    return warnings


def _password(path: Path, rotate: bool) -> str:
    """Keep an existing password file's password (devices keep working) unless rotating."""
    if path.is_file() and not rotate:
        existing = path.read_text().strip()
        if existing:
            return existing
    pw = new_password()
    _write(path, pw + "\n", 0o600)
    return pw


def make_tls(tls_dir: Path, hostname: str, fleet: str, *, ca_dir: Path | None = None,
             owner: tuple[int, int] | None = None) -> CertificateAuthority:
    """The fleet CA and a server certificate for ``hostname`` (also valid for localhost/127.0.0.1).

    The CA key goes to ``ca_dir`` (default: ``tls_dir/../ca``), apart from what the broker reads; an
    existing CA is reused so that devices which already trust it keep working (a CA key left in
    ``tls_dir`` by an older fedge is moved there). ``owner``: the broker's account, given the server key.
    """
    ca = open_ca(tls_dir, fleet, ca_dir=ca_dir)
    key, crt = ca.issue_server(hostname)
    write_secret(tls_dir / "server.key", key_pem(key), 0o600, owner=owner)
    write_secret(tls_dir / "server.crt", cert_pem(crt), 0o644)
    return ca


def open_ca(tls_dir: Path, fleet: str, *, ca_dir: Path | None = None) -> CertificateAuthority:
    """The fleet CA of a broker directory (created if it has none): its key in ``ca_dir`` (default
    ``tls_dir/../ca``, 0700), its certificate ``tls_dir/ca.crt`` (0644)."""
    tls_dir.mkdir(parents=True, exist_ok=True)
    ca_dir = ca_dir or tls_dir.parent / "ca"
    ca_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(ca_dir, 0o700)
    ca_key, ca_crt = ca_dir / "ca.key", tls_dir / "ca.crt"
    if (tls_dir / "ca.key").is_file() and not ca_key.exists():
        rename_atomic(tls_dir / "ca.key", ca_key)
    ca = CertificateAuthority.load_or_create(ca_key, ca_crt, fleet)
    os.chmod(ca_crt, 0o644)
    return ca


def _largest_message(opts: BrokerOptions, fleet_config: str | Path | None) -> int:
    if opts.max_message_bytes is not None:
        return opts.max_message_bytes
    if fleet_config is None:
        return DEFAULT_LARGEST_MESSAGE
    from fedge.broker.limits import largest_message_bytes
    from fedge.fleet.config import load_fleet

    cfg = load_fleet(fleet_config)
    archs = [a for g in cfg.devices for a in ((g.arch,) if g.arch or not g.archs else g.archs)]
    family = None
    if cfg.model.family != GEFL_FAMILY:
        from fedge.fleet.slots import family_specs

        specs = family_specs(cfg) or {}  # measured: needs the device side (fedge.edge.models) loaded
        family = max(s.num_params() for s in specs.values())
    return largest_message_bytes(archs, cfg.run.method, embed_dim=cfg.run.embed_dim, family_params=family)


def write_broker_config(fleet: str, devices: list[str], out: str | Path, opts: BrokerOptions | None = None, *,
                        fleet_config: str | Path | None = None, queue_devices: int | None = None,
                        fleet_pub: Path | None = None, issuer: Issuer | None = None) -> BrokerFiles:
    """Write everything for ``fleet`` with ``devices`` to ``out`` (see the module docstring).

    ``queue_devices``: how many devices' messages the queues must hold, when not ``len(devices)`` (a
    sharded fleet's root broker has no device account but carries every device's hello and status).
    ``fleet_pub``: when the fleet signs, the public key to put in the bundles instead of a signing key of
    this directory's own (a shard's broker: the root coordinator signs).
    ``issuer``: with ``opts.mtls``, the certificates' issuer of a whole tree (its one CA and index; the caller
    saves the index and writes every broker's CRL, :meth:`Issuer.finish`) instead of this directory's own."""
    opts = opts or BrokerOptions()
    account = broker_account(opts.run_as)
    _check_names(fleet, devices, opts)
    outp = Path(out).resolve()
    outp.mkdir(parents=True, exist_ok=True)
    (outp / "data").mkdir(exist_ok=True)
    if account is not None:
        os.chown(outp / "data", *account)  # mosquitto writes its database as this account
    limits = queue_limits(queue_devices or len(devices), _largest_message(opts, fleet_config), opts.chunk_bytes)
    tls_dir = outp / "tls" if opts.uses_tls else None
    ca = make_tls(tls_dir, opts.hostname, fleet, owner=account) if tls_dir is not None else None

    users = [opts.coordinator_user, opts.deploy_user, *devices]
    secrets_dir = {opts.coordinator_user: outp / "coordinator", opts.deploy_user: outp / "deploy"}
    secrets_dir.update({d: outp / "bundles" / d for d in devices})
    files = BrokerFiles(outp, outp / "mosquitto.conf", outp / "passwd", outp / "acl", users=users,
                        ca=None if tls_dir is None else tls_dir / "ca.crt", limits=limits)
    _write_credentials(files, opts, secrets_dir, ca, issuer, owner=account)
    _write(files.acl, acl_text(fleet, devices, opts.coordinator_user, opts.deploy_user), 0o600, owner=account)
    _write(files.config, mosquitto_conf(outp, opts, tls_dir=tls_dir, limits=limits))
    files.warnings = ownership_warnings(outp, account, opts.run_as)
    for w in files.warnings:
        log.warning("%s", w)
    if files.ca is not None:
        for user in (opts.coordinator_user, opts.deploy_user):
            secrets_dir[user].mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files.ca, secrets_dir[user] / "ca.crt")
    if opts.signs and fleet_pub is None:
        files.signing_key, fleet_pub = _signing_key(outp / "coordinator")
    if opts.signs:
        assert fleet_pub is not None
        for user in users[1:]:  # the deploy account and every device: what they verify signatures with
            secrets_dir[user].mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fleet_pub, secrets_dir[user] / "fleet.pub")

    if opts.bundles and fleet_config is None:
        log.info("no fleet config given: passwords are in bundles/ID/password, but no bundle.toml is written")
    if opts.bundles and fleet_config is not None:
        files.bundles += [_write_bundle(outp / "bundles" / dev, dev, opts, Path(fleet_config), files.ca, fleet_pub)
                          for dev in devices]
    log.info("wrote a Mosquitto config for fleet %s (%d devices) to %s", fleet, len(devices), outp)
    return files


def _check_names(fleet: str, devices: list[str], opts: BrokerOptions) -> None:
    """The fleet name and device ids as topic levels and accounts: refused when one could not be, or when a device
    would take the coordinator's or the deploy account's name."""
    check_name(fleet, "fleet name")
    for d in devices:
        check_name(d, "device id")
    for special in (opts.coordinator_user, opts.deploy_user):
        if special in devices:
            raise ConfigError(f"a device is named {special!r}, like the coordinator or deploy account",
                              hint="choose another --coordinator-user / --deploy-user")


def _write_credentials(files: BrokerFiles, opts: BrokerOptions, secrets_dir: dict[str, Path],
                       ca: CertificateAuthority | None, issuer: Issuer | None, *,
                       owner: tuple[int, int] | None) -> None:
    """Every account's credentials in its directory of ``secrets_dir``: client certificates under mutual TLS (from
    ``issuer``, else this directory's own), else a password each and the broker's ``passwd`` of their hashes."""
    users = files.users
    if opts.mtls:
        assert ca is not None and files.ca is not None
        own = issuer is None
        if issuer is None:
            issuer = Issuer.at(files.out, ca, rotate=opts.rotate, days=opts.client_days)
        for user in users:
            stem = CLIENT_STEM if user in (opts.coordinator_user, opts.deploy_user) else DEVICE_STEM
            issuer.ensure(secrets_dir[user], stem, user)
        if own:
            issuer.finish([files.ca.parent])
        files.passwd.unlink(missing_ok=True)  # no passwords under mutual TLS: nothing to leak
        return
    lines = []
    for user in users:
        pw = _password(secrets_dir[user] / "password", opts.rotate)
        lines.append(f"{user}:{hash_password(pw, iterations=opts.iterations)}")
    # passwd/acl: readable by the broker's account only (Mosquitto reads them after dropping root).
    _write(files.passwd, "\n".join(lines) + "\n", 0o600, owner=owner)


def _write_bundle(bdir: Path, dev: str, opts: BrokerOptions, fleet_config: Path, ca: Path | None,
                  fleet_pub: Path | None) -> Path:
    """Device ``dev``'s bundle (``bundle.toml`` beside its credentials, the fleet config, the CA and the fleet's
    public key) in ``bdir``; returns ``bdir``."""
    scheme = "mqtts" if opts.uses_tls else "mqtt"
    lines = [f'device_id = "{dev}"', 'fleet_config = "fleet.toml"', f'broker = "{scheme}://{opts.hostname}:{opts.port}"']
    if opts.mtls:
        lines += [f'cert_file = "{DEVICE_STEM}.crt"', f'key_file = "{DEVICE_STEM}.key"']
        (bdir / "password").unlink(missing_ok=True)
    else:
        lines += [f'username = "{dev}"', 'password_file = "password"']
    shutil.copyfile(fleet_config, bdir / "fleet.toml")
    if ca is not None:
        shutil.copyfile(ca, bdir / "ca.crt")
        lines.append('ca_file = "ca.crt"')
    if fleet_pub is not None:
        lines.append('fleet_key = "fleet.pub"')
    _write(bdir / "bundle.toml", "\n".join(lines) + "\n")
    return bdir


def _signing_key(coord: Path) -> tuple[Path, Path]:
    """The fleet's Ed25519 key (kept if it exists: devices already trust its public key) and ``fleet.pub``."""
    key, pub = coord / "signing.key", coord / "fleet.pub"
    if key.is_file():
        write_atomic(pub, public_pem(load_private_key(key).public_key()), 0o644)
    else:
        generate_key(key, pub)
        log.info("created the fleet's signing key %s", key)
    return key, pub
