"""Write a Mosquitto configuration for a fleet: accounts, hashed passwords, ACL, limits, TLS, bundles.

Layout of the output directory::

    mosquitto.conf            the broker config (run: mosquitto -c DIR/mosquitto.conf)
    passwd                    user:$7$... lines, one per device plus the coordinator
    acl                       who may read and write which topic
    coordinator/password      the coordinator's password (mode 0600); coordinator/ca.crt with TLS
    bundles/ID/               per device: bundle.toml, password (0600), fleet.toml, ca.crt with TLS
    tls/                      with --tls: ca.crt, ca.key, server.crt, server.key (keys 0600)
    data/                     Mosquitto persistence (retained state and the coordinator's session
                              survive a broker restart)

Running it again keeps existing passwords and the CA (devices keep working);
``rotate=True`` issues new passwords.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fedge.broker.passwords import PBKDF2_ITERATIONS, hash_password, new_password
from fedge.errors import ConfigError
from fedge.mqtt.topics import FleetTopics, check_name

log = logging.getLogger(__name__)

# Headroom over the largest message for the MQTT fixed header, topic and chunk frame header.
PACKET_OVERHEAD = 64 * 1024


@dataclass(frozen=True)
class BrokerOptions:
    """What ``fedge broker config`` writes."""

    port: int = 1883
    bind: str = "0.0.0.0"
    hostname: str = "localhost"  # the name devices use to reach the broker (URL in bundles, TLS name)
    tls: bool = False
    coordinator_user: str = "fedge-coordinator"
    max_message_bytes: int = 64 * 1024 * 1024
    bundles: bool = True
    run_as: str | None = None  # mosquitto's `user`: the account it drops to when started as root
    rotate: bool = False
    iterations: int = PBKDF2_ITERATIONS

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is out of range")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"--max-message-bytes {self.max_message_bytes} is too small")
        check_name(self.coordinator_user, "coordinator user name")


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


def acl_text(fleet: str, devices: list[str], coordinator: str) -> str:
    """The ACL: each device writes only below its own ``devices/ID/`` and reads rounds and globals."""
    t = FleetTopics(fleet)
    lines = [
        f"# fedge fleet {fleet}: written by `fedge broker config`. Mosquitto denies whatever is not granted.",
        "",
        f"user {coordinator}",
        f"topic read {t.base}/devices/#",
        f"topic readwrite {t.base}/rounds/#",
        f"topic readwrite {t.base}/global/#",
    ]
    for dev in devices:
        lines += [
            "",
            f"user {dev}",
            f"topic write {t.base}/devices/{dev}/#",
            f"topic read {t.base}/rounds/#",
            f"topic read {t.base}/global/#",
        ]
    return "\n".join(lines) + "\n"


def mosquitto_conf(out: Path, opts: BrokerOptions, *, tls_dir: Path | None) -> str:
    """The broker config; every path absolute so mosquitto can be started from anywhere."""
    lines = [
        "# Mosquitto config for a fedge fleet, written by `fedge broker config`.",
        "# Start: mosquitto -c " + str(out / "mosquitto.conf"),
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {out / 'passwd'}",
        f"acl_file {out / 'acl'}",
        "",
        f"listener {opts.port} {opts.bind}",
    ]
    if tls_dir is not None:
        lines += [
            f"cafile {tls_dir / 'ca.crt'}",
            f"certfile {tls_dir / 'server.crt'}",
            f"keyfile {tls_dir / 'server.key'}",
            "tls_version tlsv1.2",
        ]
    lines += [
        "",
        "# Size limits: the largest fedge message (chunked above the chunk size) plus headroom.",
        f"message_size_limit {opts.max_message_bytes + PACKET_OVERHEAD}",
        f"max_packet_size {opts.max_message_bytes + 2 * PACKET_OVERHEAD}",
        "# The coordinator's persistent session queues updates while it restarts: keep the queue generous.",
        "max_queued_messages 100000",
        "max_inflight_messages 100",
        "# Small messages (round descriptors, statistics) must not wait for Nagle's algorithm.",
        "set_tcp_nodelay true",
        "",
        "# Retained state (round descriptor, global state, device status) and sessions survive a restart.",
        "persistence true",
        f"persistence_location {out / 'data'}/",
        "autosave_interval 60",
        "",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
    ]
    if opts.run_as:
        lines += ["", "# The account mosquitto drops to when started as root: it must read passwd, acl and the keys.",
                  f"user {opts.run_as}"]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _password(path: Path, rotate: bool) -> str:
    """Keep an existing password file's password (devices keep working) unless rotating."""
    if path.is_file() and not rotate:
        existing = path.read_text().strip()
        if existing:
            return existing
    pw = new_password()
    _write(path, pw + "\n", 0o600)
    return pw


def make_tls(tls_dir: Path, hostname: str, fleet: str) -> Path:
    """A CA and a server certificate for ``hostname`` (also valid for localhost/127.0.0.1), via openssl.

    An existing CA is reused so that devices which already trust it keep working.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("--tls needs the openssl command", hint="apt-get install openssl")
    tls_dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = tls_dir / "ca.key", tls_dir / "ca.crt"
    key, crt = tls_dir / "server.key", tls_dir / "server.crt"

    def run(*args: str) -> None:
        proc = subprocess.run([openssl, *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ConfigError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    if not (ca_key.is_file() and ca_crt.is_file()):
        run("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_crt), "-days", "3650",
            "-subj", f"/CN=fedge CA {fleet}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    sans = [f"DNS:{hostname}" if not hostname.replace(".", "").isdigit() else f"IP:{hostname}",
            "DNS:localhost", "IP:127.0.0.1"]
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "server.csr", Path(tmp) / "ext.cnf"
        ext.write_text(f"subjectAltName={','.join(dict.fromkeys(sans))}\nbasicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
        run("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={hostname}")
        run("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(crt), "-days", "825", "-extfile", str(ext))
    (tls_dir / "ca.srl").unlink(missing_ok=True)
    for p in (ca_key, key):
        os.chmod(p, 0o600)
    return ca_crt


def write_broker_config(fleet: str, devices: list[str], out: str | Path, opts: BrokerOptions | None = None, *,
                        fleet_config: str | Path | None = None) -> BrokerFiles:
    """Write everything for ``fleet`` with ``devices`` to ``out`` (see the module docstring)."""
    opts = opts or BrokerOptions()
    check_name(fleet, "fleet name")
    for d in devices:
        check_name(d, "device id")
    if opts.coordinator_user in devices:
        raise ConfigError(f"a device is named {opts.coordinator_user!r}, like the coordinator account",
                          hint="choose another --coordinator-user")
    outp = Path(out).resolve()
    outp.mkdir(parents=True, exist_ok=True)
    (outp / "data").mkdir(exist_ok=True)
    tls_dir = outp / "tls" if opts.tls else None
    ca = make_tls(tls_dir, opts.hostname, fleet) if tls_dir is not None else None

    users = [opts.coordinator_user, *devices]
    secrets_dir = {opts.coordinator_user: outp / "coordinator"}
    secrets_dir.update({d: outp / "bundles" / d for d in devices})
    lines = []
    for user in users:
        pw = _password(secrets_dir[user] / "password", opts.rotate)
        lines.append(f"{user}:{hash_password(pw, iterations=opts.iterations)}")
    files = BrokerFiles(outp, outp / "mosquitto.conf", outp / "passwd", outp / "acl", users=users, ca=ca)
    # passwd/acl: readable by the broker's account, never world-writable.
    _write(files.passwd, "\n".join(lines) + "\n", 0o640)
    _write(files.acl, acl_text(fleet, devices, opts.coordinator_user), 0o640)
    _write(files.config, mosquitto_conf(outp, opts, tls_dir=tls_dir))
    if ca is not None:
        shutil.copyfile(ca, outp / "coordinator" / "ca.crt")

    scheme = "mqtts" if opts.tls else "mqtt"
    if opts.bundles and fleet_config is None:
        log.info("no fleet config given: passwords are in bundles/ID/password, but no bundle.toml is written")
    if opts.bundles and fleet_config is not None:
        for dev in devices:
            bdir = outp / "bundles" / dev
            lines = [f'device_id = "{dev}"', 'fleet_config = "fleet.toml"',
                     f'broker = "{scheme}://{opts.hostname}:{opts.port}"', f'username = "{dev}"',
                     'password_file = "password"']
            shutil.copyfile(fleet_config, bdir / "fleet.toml")
            if ca is not None:
                shutil.copyfile(ca, bdir / "ca.crt")
                lines.append('ca_file = "ca.crt"')
            _write(bdir / "bundle.toml", "\n".join(lines) + "\n")
            files.bundles.append(bdir)
    log.info("wrote a Mosquitto config for fleet %s (%d devices) to %s", fleet, len(devices), outp)
    return files
