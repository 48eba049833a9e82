"""``fedge broker config``: a Mosquitto config with per-device accounts, an ACL, limits and optional TLS."""

from __future__ import annotations

import argparse

from fedge.broker.config import BrokerOptions


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
    c.add_argument("--tls", action="store_true", help="TLS listener with a generated CA (via openssl)")
    c.add_argument("--coordinator-user", default=d.coordinator_user, help="the coordinator's account name")
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
    c.add_argument("--rotate", action="store_true", help="issue new passwords for every account")
    c.set_defaults(func=_config)


def _config(args: argparse.Namespace) -> int:
    from fedge.broker.config import write_broker_config
    from fedge.fleet.config import device_ids, load_fleet

    cfg = load_fleet(args.fleet)
    ids = [i for i, _ in device_ids(cfg)]
    opts = BrokerOptions(port=args.port or (8883 if args.tls else 1883), bind=args.bind, hostname=args.hostname,
                         tls=args.tls, coordinator_user=args.coordinator_user,
                         max_message_bytes=args.max_message_bytes, chunk_bytes=args.chunk_bytes,
                         bundles=not args.no_bundles,
                         run_as=args.run_as, rotate=args.rotate)
    files = write_broker_config(cfg.run.fleet, ids, args.out, opts, fleet_config=args.fleet)
    print(f"wrote {files.config}, {files.passwd.name}, {files.acl.name} for fleet {cfg.run.fleet}: "
          f"{len(ids)} device accounts + {opts.coordinator_user}")
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
    print(f"start the broker: mosquitto -c {files.config}")
    coord = files.out / "coordinator"
    tls = f" --tls --ca {coord / 'ca.crt'}" if opts.tls else ""
    print(f"coordinator: fedge coordinator run --config {args.fleet} --broker "
          f"{'mqtts' if opts.tls else 'mqtt'}://{opts.hostname}:{opts.port} --username {opts.coordinator_user} "
          f"--password-file {coord / 'password'}{tls} --state-dir DIR")
    return 0
