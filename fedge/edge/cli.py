"""``fedge edge run``: the device agent as a service, from a bundle or from a fleet config.

The command layer: it builds the device (its model and method half) from the
fleet config exactly as ``fedge simulate`` does — same seeds, same plan. Its data
is either its own folder (``--data DIR``, see :mod:`fedge.edge.own_data`) or, for
benchmarks and reproductions, its share of the fleet's data set rebuilt from the
same partition, so a fleet of real devices reproduces a simulated run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.errors import ConfigError, FedgeError, ProfileError

if TYPE_CHECKING:
    from fedge.common.keyrotation import FleetKeyTrust
    from fedge.edge.agent import DeviceAgent

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fedge.mqtt.flags import add_broker_arguments

    e = sub.add_parser("edge", help="run the device agent", description="The device side of a fleet.")
    esub = e.add_subparsers(dest="edge_command", metavar="ACTION", required=True)
    r = esub.add_parser(
        "run", help="join a fleet: announce, train each round, upload, apply the global state",
        description="Run one device until the run's final round. Either --bundle DIR (written by "
                    "`fedge broker config --bundles`), or --config FLEET.toml --device-id ID --broker URL. With "
                    "--data DIR the device trains on its own images (one sub-folder per class, named as in the "
                    "fleet config's [data] classes); without it, on its share of the fleet's benchmark data set, "
                    "rebuilt deterministically from the fleet config.")
    r.add_argument("--bundle", metavar="DIR", help="device bundle (bundle.toml, fleet config, credentials, CA)")
    r.add_argument("--config", metavar="FLEET.toml", help="the fleet config the device takes its method and plan from")
    r.add_argument("--data", metavar="DIR",
                   help="the device's own data: one sub-folder of PNG/JPEG images per class (or .npz files with x "
                        "and y); rescanned before every round")
    r.add_argument("--status-file", metavar="PATH",
                   help="with --data: write what the last scan found (counts, skipped files) to this JSON file")
    r.add_argument("--device-id", help="this device's id in the fleet config (e.g. rpi4-2gb-1)")
    r.add_argument("--profile", help="expected profile of the device (checked against the fleet config)")
    add_broker_arguments(r)
    r.add_argument("--fleet-key", metavar="FILE",
                   help="the fleet's Ed25519 public key (a bundle's fleet.pub, read from the bundle by default): "
                        "round descriptors and global state must then be signed with the fleet key")
    r.add_argument("--state-dir", metavar="DIR",
                   help="where the device keeps what must survive a restart: its best model so far "
                        "(best.safetensors: the round that scored best on its validation fold), the divergence "
                        "guard's kept model (kept.safetensors, with [train] divergence_margin), the newest signed "
                        "message seen per topic (replay protection), the fleet key it rotated to (fleet-key.json) "
                        "and, with OTA updates, its model store")
    r.add_argument("--model-store", metavar="DIR",
                   help="accept over-the-air model updates (`fedge deploy`) into this store: signed by the fleet key, "
                        "checked on the device's local split and with a smoke test, switched in atomically, rolled "
                        "back by themselves (needs the fleet key)")
    r.add_argument("--model", metavar="DIR", help="with --model-store: the flashed model an empty store starts from")
    r.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="chunk uploads above this size")
    r.add_argument("--global-timeout", type=float, default=120.0, metavar="S",
                   help="how long to wait for a round's global state (default 120)")
    r.add_argument("--keep-running", action="store_true", help="stay connected after the final round")
    r.add_argument("--heartbeat", type=float, default=10.0, metavar="S",
                   help="publish a health record (memory, CPU, temperature, throttling, disk, last round and "
                        "error) every S seconds (default 10; 0: never)")
    r.add_argument("--health-override", metavar="FILE",
                   help="for tests and emulation: a JSON object whose fields (cpu_temp_c, throttled, cpu_mhz, "
                        "cpu_max_mhz) replace the sensors' readings in every health record, read at each heartbeat "
                        "(absent: the real readings; default $FEDGE_HEALTH_OVERRIDE)")
    r.set_defaults(func=_run)


def _device(cfg_path: str, device_id: str, profile: str | None,
            data_dir: str | None = None, status_file: str | None = None) -> tuple[Any, Any, Any]:
    """(fleet config, SimDevice, own-data (LocalData, Scan) or None) of ``device_id``, with its profile's
    round-time budget in the hello."""
    from fedge.fleet.config import load_fleet
    from fedge.fleet.devices import build_device, device_ids, load_fleet_data
    from fedge.profiles import load_profile

    cfg = load_fleet(cfg_path)
    ids = [i for i, _ in device_ids(cfg)]
    if device_id not in ids:
        raise ConfigError(f"{cfg_path} has no device {device_id!r}",
                          hint=f"its devices are {', '.join(ids[:8])}{' ...' if len(ids) > 8 else ''}")
    own = None
    if data_dir is not None:
        from fedge.edge.own_data import build_own_device, local_data, start_failed_status, write_status

        try:
            data = local_data(cfg, data_dir)
            dev, scan = build_own_device(cfg, device_id, data)
        except FedgeError as exc:
            if status_file:
                write_status(status_file, start_failed_status(device_id, data_dir, exc))
            raise
        own = (data, scan)
    else:
        dev = build_device(cfg, load_fleet_data(cfg), ids.index(device_id))
    if profile is not None and profile != dev.info.profile:
        raise ConfigError(f"{device_id} has profile {dev.info.profile!r} in {cfg_path}, not {profile!r}")
    try:
        # The coordinator's first deadline comes from the slowest device's round-time budget.
        budget = load_profile(dev.info.profile).budgets.round_time_s
        dev.info = dataclasses.replace(dev.info, extra={**dev.info.extra, "est_round_s": budget})
    except ProfileError:
        pass
    return cfg, dev, own


def _ota(args: argparse.Namespace, cfg: Any, dev: Any, transport: Any, verifier: Any) -> Any:
    """The device's over-the-air updates (``--model-store``) on the transport's connection, or None."""
    if not args.model_store:
        return None
    if verifier is None:
        raise ConfigError("--model-store accepts only models signed by the fleet: it needs the fleet key",
                          hint="give --fleet-key FILE (a bundle's fleet.pub), or a bundle written with --sign/--mtls")
    from fedge.mqtt.ota import OtaDevice
    from fedge.runtime.ota import ModelUpdater
    from fedge.runtime.store import ModelStore

    store = ModelStore(args.model_store)
    if args.model:
        store.seed(args.model)
    test = dev.method.ctx.local_test  # the device's own validation split
    updater = ModelUpdater(store, (test.x, test.y) if test is not None and len(test.y) else None)
    print(f"{dev.info.device_id}: model store {args.model_store}, version {store.current} in use; accepting "
          "updates signed by the fleet key", file=sys.stderr)
    return OtaDevice(transport.client, cfg.run.fleet, dev.info.device_id, verifier, store.incoming,
                     apply=lambda data, order: updater.apply(data, version=order.version, fleet=order.fleet,
                                                             threshold=order.threshold),
                     status=store.status, precheck=store.check_new)


def _keep_best(state_dir: str, dev: Any) -> None:
    """Keep the device's best model (by its validation fold) in ``STATE_DIR/best.safetensors``, and take
    back the one an earlier start kept there: a restart neither forgets it nor lets a worse model replace it.
    With the divergence guard, its kept model likewise (``STATE_DIR/kept.safetensors``, fedge.edge.divergence)."""
    from fedge.edge.best import BestModel

    Path(state_dir).mkdir(parents=True, exist_ok=True)
    best = BestModel(state_dir)
    record = best.load(dev.method.ctx.model)
    dev.method.best = best
    if record is not None:
        acc = "none" if record.acc_val is None else f"{record.acc_val:.1%}"
        print(f"{dev.info.device_id}: best model so far from round {record.round} (validation {acc}) in "
              f"{best.path}", file=sys.stderr)
    guard = dev.method.guard
    if guard is not None and guard.keep_in(state_dir, dev.method.ctx.model):
        print(f"{dev.info.device_id}: the divergence guard's kept model of round {guard.kept_round} (validation "
              f"{guard.kept_acc:.1%}) in {guard.path}", file=sys.stderr)


def _fleet_key_trust(state_dir: str | None, fleet_key: str, fleet: str) -> FleetKeyTrust:
    """The device's trust in the fleet's signing key: the bundle's fleet.pub, or the key this device rotated
    to since (STATE_DIR/fleet-key.json), with replay protection kept in STATE_DIR."""
    from fedge.common.keyrotation import FleetKeyTrust
    from fedge.common.signing import ReplayGuard

    state = None
    if state_dir:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        state = Path(state_dir) / "signed-seen.json"
    else:
        log.warning("no --state-dir: a rotation of the fleet key is followed but not kept; after a restart this "
                    "device trusts %s's key until the retained key chain arrives again", fleet_key)
    return FleetKeyTrust.load(fleet_key, fleet, state_dir=state_dir, guard=ReplayGuard(state))


def _agent(args: argparse.Namespace, cfg: Any, dev: Any, own: Any, transport: Any) -> DeviceAgent:
    """The device loop: on the fleet's data share, or (``--data``) on the device's own folder."""
    from fedge.edge.agent import DeviceAgent

    if own is None:
        return DeviceAgent(dev.method, transport, dev.info, fleet=cfg.run.fleet, eval_every=cfg.run.eval_every)
    from fedge.edge.own_data import OwnDataAgent

    data, scan = own
    agent = OwnDataAgent(dev.method, transport, dev.info, fleet=cfg.run.fleet, eval_every=cfg.run.eval_every,
                         data=data, scan=scan, status_file=args.status_file)
    skipped = f", {len(scan.skipped)} unreadable files skipped" if scan.skipped else ""
    print(f"{dev.info.device_id}: own data {args.data}: {len(scan.train)} training and {len(scan.test)} "
          f"local test images{skipped}", file=sys.stderr)
    return agent


def _run(args: argparse.Namespace) -> int:
    from fedge.edge.health import health_override
    from fedge.edge.service import Bundle, EdgeOptions, EdgeService
    from fedge.mqtt.connection import parse_broker_url
    from fedge.mqtt.device_transport import MqttDeviceTransport
    from fedge.mqtt.flags import broker_settings
    from fedge.mqtt.settings import TransportSettings

    if args.status_file and not args.data:
        raise ConfigError("--status-file reports on the device's own data: give --data DIR too")
    override = health_override(args.health_override)  # a malformed file fails now, before anything loads
    if args.bundle:
        if args.config or args.device_id:
            raise ConfigError("give either --bundle or --config/--device-id, not both")
        b = Bundle.load(args.bundle)
        cfg, dev, own = _device(b.fleet_config, b.device_id, args.profile, args.data, args.status_file)
        settings = parse_broker_url(args.broker or b.broker, username=args.username or b.username,
                                    password=args.password or b.password(), ca_file=args.ca or b.ca_file,
                                    tls=True if args.tls else None, cert_file=args.cert or b.cert_file,
                                    key_file=args.key or b.key_file)
    else:
        if not (args.config and args.device_id and args.broker):
            raise ConfigError("fedge edge run needs --bundle DIR, or --config FLEET.toml --device-id ID --broker URL")
        cfg, dev, own = _device(args.config, args.device_id, args.profile, args.data, args.status_file)
        settings = broker_settings(args)
    wire = TransportSettings(chunk_bytes=args.chunk_bytes, global_timeout_s=args.global_timeout)
    fleet_key = args.fleet_key or (b.fleet_key if args.bundle else None)
    trust = None if fleet_key is None else _fleet_key_trust(args.state_dir, fleet_key, cfg.run.fleet)
    verifier = None if trust is None else trust.verifier
    transport = MqttDeviceTransport(settings, cfg.run.fleet, dev.info.device_id, wire, verifier=verifier)
    if trust is not None:
        from fedge.mqtt.fleetkey import KeyChainFollower

        KeyChainFollower(transport.client, transport.topics, trust, dev.info.device_id, transport.stats)
    agent = _agent(args, cfg, dev, own, transport)
    if args.state_dir:
        _keep_best(args.state_dir, dev)
    ota = _ota(args, cfg, dev, transport, verifier)
    if args.heartbeat < 0:
        raise ConfigError(f"--heartbeat must be >= 0 seconds, got {args.heartbeat:g}")
    private = (args.data, str(Path(args.data).resolve())) if args.data else ()
    service = EdgeService(agent, transport, EdgeOptions(exit_after_final=not args.keep_running,
                                                        heartbeat_s=args.heartbeat, private_paths=private,
                                                        health_override=override))
    stopped = []

    def on_term(*_: object) -> None:  # systemd's stop: leave cleanly (offline status, disconnect)
        stopped.append(True)
        service.stop()

    signal.signal(signal.SIGTERM, on_term)
    # Connect in the background: a device that boots before its broker keeps retrying with back-off.
    transport.start(wait=False)
    if ota is not None:
        ota.start()
    print(f"{dev.info.device_id}: {dev.info.profile}, {dev.info.arch}, {dev.info.num_samples} samples, "
          f"{cfg.run.method} on fleet {cfg.run.fleet} via {settings.url}", file=sys.stderr)
    try:
        rounds = service.run()
    except KeyboardInterrupt:
        service.stop()
        return 130
    finally:
        if ota is not None:
            ota.stop()
        transport.close()
    print(f"{dev.info.device_id}: {rounds} rounds handled, {service.failures} retried", file=sys.stderr)
    return 0 if service.finished or stopped or args.keep_running else 1
