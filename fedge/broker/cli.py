"""``fedge broker config``: a Mosquitto config with per-device accounts, an ACL, limits and optional TLS."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedge.broker.options import BrokerOptions
from fedge.fleet.shards import Shard


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("broker", help="set up a Mosquitto broker for a fleet",
                       description="Broker set-up for real deployments.")
    bsub = b.add_subparsers(dest="broker_command", metavar="ACTION", required=True)
    c = bsub.add_parser(
        "config", help="write mosquitto.conf, hashed passwords, an ACL, device bundles (and TLS)",
        description="Write a Mosquitto config for a fleet: one account per device (hashed password), an ACL "
                    "with which a device writes only fedge/FLEET/devices/ITS-ID/# and reads the round and "
                    "global topics, a coordinator account, size limits, optionally TLS with a generated CA, "
                    "and one bundle per device for `fedge edge run --bundle`. Existing passwords and the CA "
                    "are kept unless --rotate.")
    d = BrokerOptions()
    c.add_argument("--fleet", required=True, metavar="FLEET.toml", help="the fleet config (devices, fleet name)")
    c.add_argument("--out", required=True, metavar="DIR", help="output directory")
    c.add_argument("--port", type=int, help="listener port (default 1883, or 8883 with --tls)")
    c.add_argument("--bind", default=d.bind, help=f"listener address (default {d.bind})")
    c.add_argument("--hostname", default=d.hostname,
                   help="name or IP devices reach the broker at: the URL in bundles and the TLS certificate name")
    c.add_argument("--tls", action="store_true", help="TLS listener with a generated CA")
    c.add_argument("--mtls", action="store_true",
                   help="mutual TLS: one client certificate per device, the coordinator and the deploy account (CN = "
                        "account name; Mosquitto's require_certificate and use_identity_as_username) instead of "
                        "passwords, a CRL for `fedge broker revoke`; implies --tls and --sign")
    c.add_argument("--sign", action="store_true",
                   help="the fleet's Ed25519 signing key (coordinator/signing.key) and its public key in every bundle: "
                        "devices then accept only round descriptors and global state the coordinator signed")
    c.add_argument("--cert-days", type=int, default=d.client_days,
                   help=f"validity of client certificates in days (default {d.client_days})")
    c.add_argument("--coordinator-user", default=d.coordinator_user, help="the coordinator's account name")
    c.add_argument("--deploy-user", default=d.deploy_user, help="the account `fedge deploy` publishes models with")
    c.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="the fleet's largest message: sizes the broker's per-client queues (default: derived "
                        "from the fleet's largest model, x2 for generative methods, plus headroom)")
    c.add_argument("--chunk-bytes", type=int, default=d.chunk_bytes,
                   help="the chunk size the coordinator and devices use (their --chunk-bytes, default "
                        f"{d.chunk_bytes}): the broker refuses packets above it plus headers")
    c.add_argument("--no-bundles", action="store_true", help="do not write device bundles")
    c.add_argument("--run-as", metavar="USER",
                   help="account mosquitto drops to when started as root (default: mosquitto); run as root, "
                        "this command hands passwd, acl, the server key and data/ to it")
    c.add_argument("--rotate", action="store_true", help="issue new passwords (or certificates) for every account")
    c.add_argument("--shards", type=int, default=0, metavar="N",
                   help="split the devices over N shard brokers (ports --port+1 ... --port+N) with one relay "
                        "account each (fedge relay); the root broker (--port) serves the coordinator and the relays; "
                        "every device's bundle names its shard. The shorthand of the fleet config's [[shards]] "
                        "tables (each shard's broker address, devices and parent), which need no flag "
                        "(docs/scale.md)")
    c.add_argument("--workers", type=int, default=0, metavar="K",
                   help="K aggregation worker accounts on the root broker (fedge coordinator worker)")
    c.set_defaults(func=_config)

    for name, helptext in (("revoke", "revoke one device: its certificate into the CRL (or its password removed); "
                                      "on a sharded tree's root also a relay or worker, in every broker of the tree"),
                           ("rotate", "a new certificate (the old one revoked) or password for one device; on a "
                                      "sharded tree's root also a relay or worker")):
        a = bsub.add_parser(name, help=helptext,
                            description=helptext[0].upper() + helptext[1:] + ". Then reload or restart Mosquitto as "
                                        "the command says, and (rotate) flash the device again.")
        a.add_argument("device", metavar="DEVICE", help="the device id (in a sharded tree: or relay-NAME, worker-K)")
        a.add_argument("--out", required=True, metavar="DIR",
                       help="the broker directory `fedge broker config` wrote (a sharded fleet: its root, the --out)")
        if name == "rotate":
            a.add_argument("--cert-days", type=int, default=d.client_days,
                           help=f"validity of the new certificate in days (default {d.client_days})")
        a.set_defaults(func=_identity, action=name)

    k = bsub.add_parser(
        "rotate-fleet-key", help="a new fleet signing key, handed over by the old one (devices follow it)",
        description="Make a new Ed25519 fleet key and append a link to the fleet's key chain "
                    "(coordinator/fleet-keys.json): signed by the current key, cross-signed by the new one. The "
                    "coordinator publishes the chain retained on fedge/FLEET/keys/fleet when it starts (and fedge "
                    "deploy when it runs); each device verifies it against the key it trusts, persists the new key "
                    "in its --state-dir and accepts only the new key from then on (no grace window). Every "
                    "fleet.pub under DIR gets the new key, so devices flashed later trust it directly. Then restart "
                    "the coordinator: it signs with the new key.")
    k.add_argument("--fleet", required=True, metavar="FLEET.toml", help="the fleet config (its fleet name)")
    k.add_argument("--out", required=True, metavar="DIR", help="the broker directory `fedge broker config` wrote")
    k.set_defaults(func=_rotate_fleet_key)


def _rotate_fleet_key(args: argparse.Namespace) -> int:
    from fedge.broker.fleetkey import rotate_fleet_key
    from fedge.fleet.config import load_fleet

    r = rotate_fleet_key(args.out, load_fleet(args.fleet).run.fleet)
    print(f"rotated the fleet key: {r.old} -> {r.new} (key {r.n} of the chain {r.chain}); the old private key is "
          f"deleted, the new one is {r.signing_key}")
    print(f"updated {len(r.public_keys)} fleet.pub files (coordinator, deploy account, device bundles)")
    print("now restart the coordinator (it resumes from its --state-dir, publishes the key chain, then signs with "
          "the new key); devices switch when they receive the chain and accept only the new key from then on")
    print("fedge deploy publishes the chain too; give it the new --signing-key. A deployment order of the old key "
          "still pending on a device is refused now: deploy it again")
    return 0


def _identity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedge.broker import identity
    from fedge.broker.identity import DEVICE_STEM

    out = Path(args.out)
    change = (identity.revoke(out, args.device) if args.action == "revoke"
              else identity.rotate(out, args.device, days=args.cert_days))
    where = ", ".join(str(p) for p in change.changed)
    if change.tree:
        print(f"{change.device}: the sharded tree {out.resolve()} ({len(identity.tree_brokers(out.resolve()))} "
              f"brokers); its {'certificate' if change.mode == 'mtls' else 'password'} lives in "
              f"{', '.join(str(d) for d in change.secrets)}")
    if change.mode == "mtls":
        for c in change.revoked:
            print(f"revoked certificate {c.serial} of {c.cn} (valid until {c.not_after[:10]}): listed in {where}")
        if change.issued is not None:
            print(f"issued certificate {change.issued.serial} for {change.device}, valid until "
                  f"{change.issued.not_after[:10]}: {change.secrets[0] / change.stem}.crt")
    elif args.action == "revoke":
        print(f"removed {change.device}'s account from {where}")
    else:
        print(f"new password for {change.device} in {change.secrets[0]}/password (its account in {where})")
    print(f"now {change.reload}")
    if args.action == "rotate" and change.stem == DEVICE_STEM:
        print(f"then flash the device again: fedge flash {change.device} --broker-dir {out} ...")
    elif args.action == "rotate":
        print(f"then restart {change.device} with its new credentials from {change.secrets[0]}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from fedge.broker.config import write_broker_config
    from fedge.fleet.config import device_ids, load_fleet

    cfg = load_fleet(args.fleet)
    ids = [i for i, _ in device_ids(cfg)]
    opts = BrokerOptions(port=args.port or (8883 if args.tls or args.mtls else 1883), bind=args.bind,
                         hostname=args.hostname,
                         tls=args.tls or args.mtls, mtls=args.mtls, sign=args.sign, client_days=args.cert_days,
                         coordinator_user=args.coordinator_user, deploy_user=args.deploy_user,
                         max_message_bytes=args.max_message_bytes, chunk_bytes=args.chunk_bytes,
                         bundles=not args.no_bundles,
                         run_as=args.run_as, rotate=args.rotate)
    if cfg.shard_layout and args.shards:
        from fedge.errors import ConfigError

        raise ConfigError(f"--shards {args.shards} and the [[shards]] tables of {args.fleet} both say how to shard "
                          "the fleet", hint="drop --shards (the fleet config's [[shards]] decide), or remove the "
                                            "[[shards]] tables to split the fleet evenly")
    if cfg.shard_layout or args.shards or args.workers:
        from fedge.common.asyncmode import refuse_in_parts

        what = "[[shards]]" if cfg.shard_layout else "--shards" if args.shards else "--workers"
        refuse_in_parts(cfg.asynchronous, what, source=cfg.source)
        return _sharded(args, cfg.run.fleet, ids, opts, cfg.shard_layout)
    files = write_broker_config(cfg.run.fleet, ids, args.out, opts, fleet_config=args.fleet)
    secrets = "client certificates" if opts.mtls else files.passwd.name
    print(f"wrote {files.config}, {secrets}, {files.acl.name} for fleet {cfg.run.fleet}: "
          f"{len(ids)} device accounts + {opts.coordinator_user} + {opts.deploy_user}")
    if files.limits is not None:
        lim = files.limits
        print(f"limits: packets up to {lim.max_packet_size} B; per client at most {lim.max_queued_messages} "
              f"queued messages, {lim.max_queued_bytes} B")
    for warning in files.warnings:
        print(f"warning: {warning}")
    if files.bundles:
        print(f"device bundles in {files.out / 'bundles'}/ID (fedge edge run --bundle DIR)")
    if files.ca is not None:
        print(f"TLS: CA {files.ca}; the coordinator connects with --tls --ca {files.out / 'coordinator' / 'ca.crt'}")
    if files.signing_key is not None:
        print(f"signing: the fleet key {files.signing_key} (keep it secret; its public half is fleet.pub in every "
              "bundle)")
    print(f"start the broker: mosquitto -c {files.config}")
    coord = files.out / "coordinator"
    tls = f" --tls --ca {coord / 'ca.crt'}" if opts.uses_tls else ""
    creds = (f" --cert {coord / 'client.crt'} --key {coord / 'client.key'}" if opts.mtls
             else f" --username {opts.coordinator_user} --password-file {coord / 'password'}")
    sign = f" --signing-key {files.signing_key}" if files.signing_key is not None else ""
    print(f"coordinator: fedge coordinator run --config {args.fleet} --broker "
          f"{'mqtts' if opts.uses_tls else 'mqtt'}://{opts.hostname}:{opts.port}{creds}{tls}{sign} --state-dir DIR")
    return 0


def _sharded(args: argparse.Namespace, fleet: str, ids: list[str], opts: BrokerOptions, layout: list[Shard]) -> int:
    from fedge.broker.shards import write_sharded_config

    files = write_sharded_config(fleet, ids, args.out, opts, shards=layout or max(args.shards, 1),
                                 workers=args.workers, fleet_config=args.fleet)
    out = files.root.out
    scheme = "mqtts" if opts.uses_tls else "mqtt"
    root_url = f"{scheme}://{opts.hostname}:{opts.port}"
    urls = {s.name: f"{scheme}://{s.host}:{s.port}" for s in files.layout}

    def ca(d: Path) -> str:
        return f" --ca {d / 'ca.crt'}" if opts.uses_tls else ""

    def creds(user: str, d: Path) -> str:
        """An account's credentials on the command line: its certificate (--mtls) or its password file."""
        if opts.mtls:
            return f" --cert {d / 'client.crt'} --key {d / 'client.key'}{ca(d)}"
        return f" --username {user} --password-file {d / 'password'}{ca(d)}"

    print(f"root broker: mosquitto -c {files.root.config} (coordinator, "
          f"{sum(1 for s in files.layout if s.parent is None)} relay and {len(files.workers)} worker accounts)")
    for shard, written in zip(files.layout, files.shards, strict=True):
        members = shard.devices
        below = "" if shard.parent is None else f", under shard {shard.parent}"
        print(f"shard {shard.name}: mosquitto -c {written.config} ({urls[shard.name]}{below}; {len(members)} devices: "
              f"{members[0]} ... {members[-1]})" if members else f"shard {shard.name}: mosquitto -c {written.config}")
        parent = root_url if shard.parent is None else urls[shard.parent]
        print(f"  relay: fedge relay --config {args.fleet} --name {shard.relay}"
              f"{creds(shard.relay, out / 'relays' / shard.relay)} --broker {parent} --shard {urls[shard.name]}")
    for w in files.workers:
        # an aggregator's name is its account: with a certificate there is no --username to take it from
        name = f" --name {w}" if opts.mtls else ""
        print(f"worker: fedge coordinator worker --config {args.fleet}{name}{creds(w, out / 'workers' / w)} "
              f"--broker {root_url}")
    coord = out / "coordinator"
    sign = ""
    if files.root.signing_key is not None:
        sign = f" --signing-key {files.root.signing_key}"
        print(f"signing: the fleet key {files.root.signing_key} (keep it secret); relays forward the signed state "
              "unchanged, every bundle holds fleet.pub")
    print(f"coordinator: fedge coordinator run --config {args.fleet} --broker {root_url}"
          f"{creds(opts.coordinator_user, coord)}{sign}{' --workers' if files.workers else ''} --state-dir DIR")
    print(f"device bundles (each naming its shard) in {out / 'bundles'}/ID")
    if opts.mtls:
        print(f"mutual TLS: every broker requires a certificate of the one CA {files.root.ca}; one certificate index "
              f"for the tree ({out / 'ca' / 'index.json'}) and its CRL copied into every broker's tls/crl.pem: "
              f"fedge broker revoke|rotate ID --out {out} acts on them all")
    return 0
