"""``fedge broker config`` for a sharded fleet: one Mosquitto per shard, a root broker, relay and worker accounts.

The shards come from the fleet config's ``[[shards]]`` (:mod:`fedge.fleet.shards`: each shard's broker
address, its devices, its ``parent``) or from ``--shards N``, the shorthand for N shards of contiguous
devices in fleet order on ``--hostname`` ports ``--port + 1 ... --port + N``.

Layout of the output directory::

    mosquitto.conf, passwd, acl   the root broker: the coordinator, one account per relay whose parent is
                                  the root and per aggregation worker (worker-1 ... worker-K)
    coordinator/password          the coordinator's password
    relays/relay-NAME/password    shard NAME's relay's password (one account, on its shard's broker and on
                                  its parent's: the root's or its parent shard's)
    workers/worker-K/password     worker K's password
    shards/shard-NAME/            shard NAME's broker, written like a flat fleet's (its mosquitto.conf on the
                                  shard's port, passwd, acl, data/) with relay-NAME in the coordinator's place,
                                  the shard's own devices as its only device accounts, and the account of
                                  every child shard's relay
    bundles/ID/                   every device's bundle, whose broker URL is its shard's (what
                                  ``fedge flash --broker-dir DIR`` copies onto the device)

With ``--mtls`` every broker of the tree requires a client certificate of the root's one CA (its CN is the user
name the ACLs name; no ``passwd`` is written): ``client.crt`` + ``client.key`` replace ``password`` in
``coordinator/``, ``relays/relay-NAME/`` (one certificate, also in ``shards/shard-NAME/coordinator/``) and
``workers/worker-K/``; ``device.crt`` + ``device.key`` in every bundle. The tree has one certificate index
(``ca/index.json``) and one CA key, both at the root only (a shard's directory keeps no copy of the key), and one
CRL, copied into every broker's ``tls/crl.pem``: ``fedge broker revoke/rotate ID --out OUT`` act on all of them
(:mod:`fedge.broker.identity`).

ACLs (the same with passwords or certificates): on a shard a device has exactly the flat fleet's rights — and no
account at all on another shard or on the root, so it can publish into no other shard. On its parent's broker,
relay NAME may write the ``hello`` and ``status`` topics of the devices it reports (its shard's and its child
shards') only (it forwards them), its own ``partials/relay-NAME``, ``relays/relay-NAME/status`` and
``relays/relay-NAME/secagg`` (its sums of masked inputs), and read rounds, global state, model packages and its
devices' ``refused/{id}`` and OTA orders, and write their OTA statuses; in secure rounds it writes its devices'
``devices/{id}/secagg`` and reads their ``secagg/{id}`` (the stage messages it forwards); on its shard it also
writes ``ota/#`` (it forwards ``fedge deploy``'s updates); worker K may read updates and hellos (its shared
subscription) and rounds, and write ``partials/worker-K`` only. (Under mutual TLS a device's
certificate does connect to another broker of the tree — Mosquitto checks it against the CA, not against a list of
accounts — but that broker's ACL names it nowhere: it can publish and read nothing.)
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fedge.broker.config import (
    BrokerFiles,
    BrokerOptions,
    _password,
    _write,
    broker_account,
    open_ca,
    write_broker_config,
)
from fedge.broker.identity import CLIENT_STEM, Issuer
from fedge.broker.passwords import hash_password
from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError
from fedge.fleet.shards import Shard, even_shards, subtree
from fedge.mqtt.topics import FleetTopics

log = logging.getLogger(__name__)


@dataclass
class ShardedFiles:
    """What ``--shards`` wrote: the root broker and one broker per shard."""

    root: BrokerFiles
    shards: list[BrokerFiles] = field(default_factory=list)
    layout: list[Shard] = field(default_factory=list)  # the shards, in the order of ``shards``
    workers: list[str] = field(default_factory=list)

    @property
    def members(self) -> list[list[str]]:
        """Each shard's own devices, in fleet order."""
        return [list(s.devices) for s in self.layout]

    @property
    def relays(self) -> list[str]:
        return [s.relay for s in self.layout]


def split_devices(devices: list[str], shards: int) -> list[list[str]]:
    """``devices`` in ``shards`` contiguous, near-equal parts (fleet order kept): ``--shards N``."""
    return [list(s.devices) for s in even_shards(devices, shards, "localhost", 0)]


def root_acl_extra(fleet: str, relays: dict[str, list[str]], workers: list[str]) -> str:
    """A parent broker's ACL lines for its relays (relay -> the devices it reports: its shard's and its child
    shards') and the root's for worker accounts, appended to what ``write_broker_config`` wrote."""
    t = FleetTopics(fleet)
    lines: list[str] = []
    for relay, devices in relays.items():
        lines += ["", f"user {relay}", f"topic write {t.partial(relay)}", f"topic readwrite {t.relay_status(relay)}",
                  f"topic write {t.relay_secagg(relay)}",  # its sums of masked inputs (secure rounds)
                  f"topic read {t.round}", f"topic read {t.base}/global/#", f"topic read {t.base}/ota/models/#",
                  f"topic read {t.fleet_keys}"]
        for dev in devices:  # secure rounds: it forwards their stage messages both ways
            lines += [f"topic write {t.hello(dev)}", f"topic write {t.status(dev)}", f"topic read {t.refused(dev)}",
                      f"topic read {t.ota_order(dev)}", f"topic write {t.ota_status(dev)}",
                      f"topic write {t.secagg(dev)}", f"topic read {t.secagg_to(dev)}"]
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
                         shards: int | list[Shard], workers: int = 0,
                         fleet_config: str | Path | None = None) -> ShardedFiles:
    """Write the root broker, one broker per shard and ``workers`` worker accounts (module docstring).

    ``shards``: the fleet config's checked ``[[shards]]`` (:attr:`FleetConfig.shard_layout`), or a count N
    (``--shards N``: :func:`~fedge.fleet.shards.even_shards` on ``opts.hostname``, ports ``opts.port + k``)."""
    opts = opts or BrokerOptions()
    outp = Path(out).resolve()
    layout = even_shards(devices, shards, opts.hostname, opts.port) if isinstance(shards, int) else list(shards)
    _check_layout(layout, devices, opts)
    worker_names = [f"worker-{k + 1}" for k in range(workers)]
    relays = [s.relay for s in layout]
    clash = sorted(set(devices) & (set(relays) | set(worker_names) | {opts.coordinator_user, opts.deploy_user}))
    if clash:
        raise ConfigError(f"device id(s) {clash[:3]} clash with relay, worker or coordinator accounts",
                          hint="rename those devices (id_prefix) or the shards")
    reports = {s.name: subtree(layout, s.name) for s in layout}  # what each relay reports up
    # Mutual TLS: one issuer for the whole tree (the root's CA and its one certificate index), so that
    # `fedge broker revoke/rotate OUT` find every certificate and write one CRL into every broker
    issuer = (Issuer.at(outp, open_ca(outp / "tls", fleet), rotate=opts.rotate, days=opts.client_days)
              if opts.mtls else None)
    # the root: the coordinator (no device account), then relay and worker accounts with their ACL lines
    root = write_broker_config(fleet, [], outp, dataclasses.replace(opts, bundles=False), fleet_config=fleet_config,
                               queue_devices=len(devices), issuer=issuer)
    account = broker_account(opts.run_as)
    secrets = {r: outp / "relays" / r for r in relays}
    secrets.update({w: outp / "workers" / w for w in worker_names})
    passwords = _identities(secrets, opts, issuer)
    top = {s.relay: reports[s.name] for s in layout if s.parent is None}
    _add_accounts(root, {u: passwords[u] for u in [*top, *worker_names] if u in passwords},
                  root_acl_extra(fleet, top, worker_names), opts, account)
    root.users += [*top, *worker_names]
    files = ShardedFiles(root, layout=layout, workers=worker_names)
    for shard in layout:
        sdir = outp / "shards" / shard.dirname
        # the relay's password (certificate) on its shard is its password on its parent: one account, two brokers
        if issuer is None:
            (sdir / "coordinator").mkdir(parents=True, exist_ok=True)
            _write(sdir / "coordinator" / "password", passwords[shard.relay] + "\n", 0o600)
        if root.ca is not None:
            _share_ca(outp, sdir)
        written = write_broker_config(fleet, list(shard.devices), sdir, dataclasses.replace(
            opts, port=shard.port, hostname=shard.host, coordinator_user=shard.relay, rotate=False),
            fleet_config=fleet_config, queue_devices=len(reports[shard.name]),
            fleet_pub=outp / "coordinator" / "fleet.pub" if root.signing_key is not None else None, issuer=issuer)
        # The shard's broker never reads the CA key: its copy was only make_tls's input for the server certificate.
        # Gone, a shard directory can be copied to its broker's host without the key that signs for the whole tree.
        shutil.rmtree(sdir / "ca", ignore_errors=True)
        children = {c.relay: reports[c.name] for c in layout if c.parent == shard.name}
        _add_accounts(written, {u: passwords[u] for u in children if u in passwords},
                      shard_acl_extra(fleet, shard.relay) + root_acl_extra(fleet, children, []), opts, account)
        written.users += list(children)
        files.shards.append(written)
        for bundle in written.bundles:  # every bundle where `fedge flash --broker-dir OUT` looks for it
            target = outp / "bundles" / bundle.name
            shutil.copytree(bundle, target, dirs_exist_ok=True)
            root.bundles.append(target)
    if issuer is not None:  # one index, and one CRL written into every broker of the tree
        issuer.finish([outp / "tls", *(f.out / "tls" for f in files.shards)])
    if root.ca is not None:  # the relays' and workers' CA file (one CA for the whole tree)
        for d in secrets.values():
            shutil.copyfile(root.ca, d / "ca.crt")
    log.info("wrote a root broker and %d shard brokers for fleet %s (%d devices, %d workers%s) to %s", len(layout),
             fleet, len(devices), workers, ", mutual TLS" if issuer is not None else "", outp)
    return files


def _identities(secrets: dict[str, Path], opts: BrokerOptions, issuer: Issuer | None) -> dict[str, str]:
    """The relays' and workers' identities, each in its directory of ``secrets``: a password (returned, for the
    passwd lines), or with ``issuer`` a client certificate (``client.crt``, ``client.key``; no password left)."""
    if issuer is None:
        return {user: _password(d / "password", opts.rotate) for user, d in secrets.items()}
    for user, d in secrets.items():
        issuer.ensure(d, CLIENT_STEM, user)
        (d / "password").unlink(missing_ok=True)  # a tree rewritten with --mtls: no password to leak
    return {}


def _check_layout(layout: list[Shard], devices: list[str], opts: BrokerOptions) -> None:
    """What only the broker options can tell: a shard on the root's address, a scheme against --tls; and a
    layout that does not cover the devices exactly once (the fleet config checked its own already)."""
    if not layout:
        raise ConfigError("a sharded broker config needs at least one shard",
                          hint="add [[shards]] tables to the fleet config or pass --shards N")
    scheme = "mqtts" if opts.uses_tls else "mqtt"
    for s in layout:
        if (s.host, s.port) == (opts.hostname, opts.port):
            raise ConfigError(f"[[shards]] {s.name!r}: broker {s.host}:{s.port} is the root broker's address "
                              "(--hostname, --port)", hint="give the shard another port or host, or the root "
                                                           "another --port")
        if s.scheme is not None and s.scheme != scheme:
            raise ConfigError(f"[[shards]] {s.name!r}: broker is {s.scheme}://{s.host}:{s.port} but the brokers are "
                              f"written {'with' if opts.uses_tls else 'without'} TLS",
                              hint=f"write broker = \"{scheme}://{s.host}:{s.port}\" (or HOST:PORT), or "
                                   f"{'drop' if opts.uses_tls else 'pass'} --{'mtls' if opts.mtls else 'tls'}")
    listed = [d for s in layout for d in s.devices]
    if sorted(listed) != sorted(devices):
        raise ConfigError("the shards do not hold every device of the fleet exactly once",
                          hint="check [[shards]] devices against the fleet's device ids")


def _add_accounts(files: BrokerFiles, passwords: dict[str, str], acl: str, opts: BrokerOptions,
                  account: tuple[int, int] | None) -> None:
    """Relay and worker accounts added to a broker ``write_broker_config`` wrote: passwd lines (none under mutual
    TLS: the certificate's CN is the user name) and ACL lines."""
    if not opts.mtls:
        lines = files.passwd.read_text().splitlines()
        lines += [f"{user}:{hash_password(pw, iterations=opts.iterations)}" for user, pw in passwords.items()]
        _write(files.passwd, "\n".join(lines) + "\n", 0o600, owner=account)
    _write(files.acl, files.acl.read_text() + acl, 0o600, owner=account)


def _share_ca(root: Path, shard: Path) -> None:
    """Shard brokers get their server certificate from the root's CA (one CA for the tree: a relay verifies
    both of its brokers with one ``ca.crt``), by finding the root's CA where ``make_tls`` looks for its own."""
    (shard / "ca").mkdir(mode=0o700, parents=True, exist_ok=True)
    (shard / "tls").mkdir(parents=True, exist_ok=True)
    write_atomic(shard / "ca" / "ca.key", (root / "ca" / "ca.key").read_bytes(), 0o600)
    shutil.copyfile(root / "tls" / "ca.crt", shard / "tls" / "ca.crt")
