"""``fedge broker config --shards N [--workers K]``: one Mosquitto per shard, a root broker, relay and worker accounts.

Layout of the output directory::

    mosquitto.conf, passwd, acl   the root broker: the coordinator, one account per relay (relay-1 ...
                                  relay-N) and per aggregation worker (worker-1 ... worker-K)
    coordinator/password          the coordinator's password
    relays/relay-K/password       relay K's password (the same account on the root and on shard K)
    workers/worker-K/password     worker K's password
    shards/shard-K/               shard K's broker, written like a flat fleet's (its mosquitto.conf on
                                  port --port + K, passwd, acl, data/) with relay-K in the coordinator's
                                  place and the devices of shard K as its only device accounts
    bundles/ID/                   every device's bundle, whose broker URL is its shard's (what
                                  ``fedge flash --broker-dir DIR`` copies onto the device)

Devices are split into N contiguous shards in fleet order. ACLs: on a shard a device has exactly the
flat fleet's rights — and no account at all on another shard or on the root, so it can publish into
no other shard. On the root, relay K may write the ``hello`` and ``status`` topics of its shard's
devices only (it forwards them), its own ``partials/relay-K`` and ``relays/relay-K/status``, and read
rounds, global state, model packages and its devices' ``refused/{id}`` and OTA orders, and write
their OTA statuses; on its shard it also writes ``ota/#`` (it forwards ``fedge deploy``'s updates);
worker K may read updates and hellos (its shared subscription) and rounds, and write
``partials/worker-K`` only.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fedge.broker.config import BrokerFiles, BrokerOptions, _password, _write, broker_account, write_broker_config
from fedge.broker.passwords import hash_password
from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError
from fedge.mqtt.topics import FleetTopics

log = logging.getLogger(__name__)


@dataclass
class ShardedFiles:
    """What ``--shards`` wrote: the root broker and one broker per shard."""

    root: BrokerFiles
    shards: list[BrokerFiles] = field(default_factory=list)
    members: list[list[str]] = field(default_factory=list)  # devices of each shard, in fleet order
    relays: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)


def split_devices(devices: list[str], shards: int) -> list[list[str]]:
    """``devices`` in ``shards`` contiguous, near-equal parts (fleet order kept)."""
    if shards < 1:
        raise ConfigError(f"--shards {shards} must be at least 1")
    if shards > len(devices):
        raise ConfigError(f"--shards {shards} is more than the fleet's {len(devices)} devices",
                          hint="use at most one shard per device")
    size, extra = divmod(len(devices), shards)
    out, pos = [], 0
    for k in range(shards):
        n = size + (1 if k < extra else 0)
        out.append(devices[pos : pos + n])
        pos += n
    return out


def root_acl_extra(fleet: str, relays: dict[str, list[str]], workers: list[str]) -> str:
    """The root ACL's lines for relay and worker accounts (appended to the coordinator's)."""
    t = FleetTopics(fleet)
    lines: list[str] = []
    for relay, devices in relays.items():
        lines += ["", f"user {relay}", f"topic write {t.partial(relay)}", f"topic readwrite {t.relay_status(relay)}",
                  f"topic read {t.round}", f"topic read {t.base}/global/#", f"topic read {t.base}/ota/models/#",
                  f"topic read {t.fleet_keys}"]
        for dev in devices:
            lines += [f"topic write {t.hello(dev)}", f"topic write {t.status(dev)}", f"topic read {t.refused(dev)}",
                      f"topic read {t.ota_order(dev)}", f"topic write {t.ota_status(dev)}"]
    for worker in workers:
        lines += ["", f"user {worker}", f"topic read {t.device_filter('update')}",
                  f"topic read {t.device_filter('hello')}", f"topic read {t.round}", f"topic write {t.partial(worker)}"]
    return "\n".join(lines) + "\n"


def shard_acl_extra(fleet: str, relay: str) -> str:
    """A shard ACL's lines for its relay beyond the coordinator's (it stands in its place): it republishes
    ``fedge deploy``'s model packages and orders on the shard and reads the devices' OTA statuses. Mosquitto
    adds a second ``user`` block of the same name to the first."""
    t = FleetTopics(fleet)
    lines = ["", f"user {relay}", f"topic readwrite {t.base}/ota/#", f"topic read {t.ota_status_filter()}"]
    return "\n".join(lines) + "\n"


def write_sharded_config(fleet: str, devices: list[str], out: str | Path, opts: BrokerOptions | None = None, *,
                         shards: int, workers: int = 0, fleet_config: str | Path | None = None) -> ShardedFiles:
    """Write the root broker, ``shards`` shard brokers and ``workers`` worker accounts (module docstring)."""
    opts = opts or BrokerOptions()
    if opts.mtls:
        raise ConfigError("--mtls cannot be combined with --shards or --workers yet: relays and aggregation workers "
                          "have password accounts only, and `fedge broker revoke/rotate` know one broker",
                          hint="use --sign (signed state: relays forward it unchanged, devices verify it) with "
                               "passwords, and --tls for encryption; or a single broker with --mtls (docs/scale.md, "
                               "'Identity and signed state')")
    outp = Path(out).resolve()
    members = split_devices(devices, shards)
    relays = {f"relay-{k + 1}": m for k, m in enumerate(members)}
    worker_names = [f"worker-{k + 1}" for k in range(workers)]
    clash = sorted(set(devices) & (set(relays) | set(worker_names) | {opts.coordinator_user}))
    if clash:
        raise ConfigError(f"device id(s) {clash[:3]} clash with relay or worker accounts",
                          hint="rename those devices (id_prefix) or write the config without --shards")
    if opts.port + shards >= 65536:
        raise ConfigError(f"--port {opts.port} + {shards} shards runs past port 65535")
    # the root: the coordinator (no device account), then relay and worker accounts with their ACL lines
    root = write_broker_config(fleet, [], outp, dataclasses.replace(opts, bundles=False), fleet_config=fleet_config,
                               queue_devices=len(devices))
    account = broker_account(opts.run_as)
    lines = root.passwd.read_text().splitlines()
    secrets = {r: outp / "relays" / r / "password" for r in relays}
    secrets.update({w: outp / "workers" / w / "password" for w in worker_names})
    passwords = {user: _password(path, opts.rotate) for user, path in secrets.items()}
    lines += [f"{user}:{hash_password(pw, iterations=opts.iterations)}" for user, pw in passwords.items()]
    _write(root.passwd, "\n".join(lines) + "\n", 0o600, owner=account)
    _write(root.acl, root.acl.read_text() + root_acl_extra(fleet, relays, worker_names), 0o600, owner=account)
    root.users += list(secrets)
    files = ShardedFiles(root, members=members, relays=list(relays), workers=worker_names)
    for k, (relay, shard_devices) in enumerate(relays.items()):
        sdir = outp / "shards" / f"shard-{k + 1}"
        # the relay's password on its shard is its root password (one account, two brokers)
        (sdir / "coordinator").mkdir(parents=True, exist_ok=True)
        _write(sdir / "coordinator" / "password", passwords[relay] + "\n", 0o600)
        if root.ca is not None:
            _share_ca(outp, sdir)
        shard = write_broker_config(fleet, shard_devices, sdir, dataclasses.replace(
            opts, port=opts.port + k + 1, coordinator_user=relay, rotate=False), fleet_config=fleet_config,
            fleet_pub=outp / "coordinator" / "fleet.pub" if root.signing_key is not None else None)
        _write(shard.acl, shard.acl.read_text() + shard_acl_extra(fleet, relay), 0o600, owner=account)
        files.shards.append(shard)
        for bundle in shard.bundles:  # every bundle where `fedge flash --broker-dir OUT` looks for it
            target = outp / "bundles" / bundle.name
            shutil.copytree(bundle, target, dirs_exist_ok=True)
            root.bundles.append(target)
    if root.ca is not None:  # the relays' and workers' CA file (one CA for the whole tree)
        for d in [outp / "relays" / r for r in relays] + [outp / "workers" / w for w in worker_names]:
            shutil.copyfile(root.ca, d / "ca.crt")
    log.info("wrote a root broker and %d shard brokers for fleet %s (%d devices, %d workers) to %s", shards, fleet,
             len(devices), workers, outp)
    return files


def _share_ca(root: Path, shard: Path) -> None:
    """Shard brokers get their server certificate from the root's CA (one CA for the tree: a relay verifies
    both of its brokers with one ``ca.crt``), by finding the root's CA where ``make_tls`` looks for its own."""
    (shard / "ca").mkdir(mode=0o700, parents=True, exist_ok=True)
    (shard / "tls").mkdir(parents=True, exist_ok=True)
    write_atomic(shard / "ca" / "ca.key", (root / "ca" / "ca.key").read_bytes(), 0o600)
    shutil.copyfile(root / "tls" / "ca.crt", shard / "tls" / "ca.crt")
