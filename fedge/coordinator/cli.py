"""``fedge coordinator run``: the coordinator service over MQTT (``fedge dashboard`` is :mod:`fedge.observe.cli`).

This is the command layer: it imports the MQTT package lazily, which the coordinator library itself never
does. The broker flags it shares with ``fedge edge run`` live with what they configure
(:mod:`fedge.mqtt.flags`); the engine's configuration from the fleet config, which the scale-out commands
(``fedge coordinator worker``, ``fedge relay``: :mod:`fedge.scaleout.cli`) build the same way, in
:mod:`fedge.coordinator.fromfleet`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from fedge.common.signing import Signer
    from fedge.coordinator.report import RoundReport
    from fedge.fleet.config import FleetConfig
    from fedge.mqtt.broker import EmbeddedBroker, MosquittoProcess
    from fedge.mqtt.connection import BrokerSettings
    from fedge.observe.web import DashboardServer, Endpoint

log = logging.getLogger(__name__)

Parsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # argparse's type, generic for mypy only


def add_parser(sub: Parsers) -> Parsers:
    """``fedge coordinator run``; returns ``fedge coordinator``'s actions, to which
    :mod:`fedge.cli` adds ``worker`` (:mod:`fedge.scaleout.cli`, beside ``fedge relay``)."""
    c = sub.add_parser("coordinator", help="run the coordinator against an MQTT broker",
                       description="The coordinator service: registers devices, runs rounds, checkpoints.")
    csub = c.add_subparsers(dest="coordinator_command", metavar="ACTION", required=True)
    _add_run_parser(csub)
    return csub


def _add_run_parser(csub: Parsers) -> None:
    from fedge.coordinator.config import DEFAULT_MAX_UPDATE_BYTES
    from fedge.mqtt.flags import add_broker_arguments

    r = csub.add_parser("run", help="run (or resume) a fleet's rounds over MQTT",
                        description="Run a fleet config's rounds over MQTT. Restarted with the same --state-dir, "
                                    "it resumes after the last completed round.")
    r.add_argument("--config", required=True, metavar="FLEET.toml", help="the fleet config")
    r.add_argument("--state-dir", required=True, metavar="DIR", help="checkpoints (state.json, globals.safetensors)")
    add_broker_arguments(r)
    e = r.add_argument_group("embedded broker (when --broker is not given)")
    e.add_argument("--embedded", choices=("amqtt", "mosquitto"), default="amqtt",
                   help="amqtt (in this process, default) or a mosquitto child process")
    e.add_argument("--port", type=int, default=1883, help="loopback port of the embedded broker (0: any free port)")
    _add_scheduling_arguments(r)
    g = r.add_argument_group("aggregation (flags override the fleet config's [coordinator] table)")
    g.add_argument("--aggregation", choices=("mean", "trimmed", "median"),
                   help="how updates are combined (default mean; fedavg, lgfedavg and fedproto)")
    g.add_argument("--trim", type=float,
                   help="trimmed: fraction of the devices cut at each end of every coordinate (default 0.2)")
    g.add_argument("--clip", type=float, help="clip updates to CLIP x the median distance from the median (0: off)")
    w = r.add_argument_group("wire")
    w.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="chunk messages above this size")
    w.add_argument("--max-update-bytes", type=int,
                   help=f"refuse larger updates (default {DEFAULT_MAX_UPDATE_BYTES // 2**20} MiB; each update is "
                        "also bounded by what its device owes)")
    r.add_argument("--signing-key", metavar="FILE",
                   help="the fleet's Ed25519 key (`fedge broker config --sign` or --mtls: coordinator/signing.key): "
                        "every round descriptor, global state and refusal is signed with it (default: "
                        "STATE_DIR/signing.key when it exists; without a key nothing is signed)")
    o = r.add_argument_group("watching the fleet")
    o.add_argument("--http", metavar="HOST:PORT",
                   help="serve the dashboard and /metrics (read-only; off by default; HOST defaults to 127.0.0.1, "
                        "any other address needs a token)")
    o.add_argument("--http-token-file", metavar="FILE",
                   help="the token every request must carry (Authorization: Bearer, or a browser's basic-auth "
                        "password); default $FEDGE_HTTP_TOKEN")
    o.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files of the per-round scalars (accuracy per fleet, profile and "
                        "device, round and aggregation time, updates, traffic) into DIR")
    o.add_argument("--wait-log", type=float, default=30.0, metavar="S",
                   help="while a round, the quorum or the fleet's hellos are incomplete, log every S seconds which "
                        "devices it waits for and why (default 30; 0: never)")
    o.add_argument("--heat-max-age", type=float, default=30.0, metavar="S",
                   help="[coordinator] thermal_guard: a heartbeat older than S seconds says nothing of a device's "
                        "heat, which the guard then treats as unknown (not held); default 30, three of the devices' "
                        "default 10 s heartbeats: set it to three of their --heartbeat if that is longer; 0: no bound")
    r.add_argument("--rounds", type=int, help="override [run] rounds")
    r.add_argument("--any-device", action="store_true",
                   help="accept hellos from devices not listed in the fleet config")
    r.add_argument("--workers", action="store_true",
                   help="aggregation workers read the updates (fedge coordinator worker, an MQTT 5 shared "
                        "subscription): this coordinator merges their partials and does not read updates itself")
    r.set_defaults(func=_run)


def _add_scheduling_arguments(r: argparse.ArgumentParser) -> None:
    from fedge.coordinator.config import (
        SERVICE_DEFAULTS,
        TASK_TIMEOUT_FACTOR,
        TASK_TIMEOUT_FLOOR_S,
        UNKNOWN_SPEED_TIMEOUT_S,
    )

    s = r.add_argument_group("scheduling (flags override the fleet config's [coordinator] table)")
    d = SERVICE_DEFAULTS
    s.add_argument("--min-devices", type=int, help=f"devices online before a round starts (default {d['min_devices']})")
    s.add_argument("--quorum", type=float, metavar="FRACTION",
                   help=f"fraction of the fleet's devices online before a round starts (default {d['quorum']})")
    s.add_argument("--quorum-timeout", type=float, metavar="S",
                   help=f"give up waiting (default {d['quorum_timeout_s']:.0f})")
    s.add_argument("--wait-for-fleet", type=float, default=0.0, metavar="S",
                   help="before the first round, wait up to S s for a hello from every device of the fleet config, "
                        "so round 1 has the whole fleet (default 0: start once the quorum is online)")
    s.add_argument("--deadline-slack", type=float,
                   help="round deadline = slack x the slowest expected device's round time "
                        f"(default {d['deadline_slack']:g}; 0: off)")
    s.add_argument("--round-timeout", type=float, metavar="S",
                   help="how long a device may leave its work unanswered; 0: wait for it. Default auto: an "
                        f"asynchronous task max({TASK_TIMEOUT_FLOOR_S:.0f} s, {TASK_TIMEOUT_FACTOR:g} x the device's "
                        f"expected task time), then withdrawn and handed out again; {UNKNOWN_SPEED_TIMEOUT_S:.0f} s "
                        "for a device of unknown speed (a synchronous round's budget too)")
    s.add_argument("--min-round", type=float, metavar="S", help=f"shortest deadline (default {d['min_round_s']:g})")
    s.add_argument("--max-round", type=float, metavar="S", help=f"longest deadline (default {d['max_round_s']:g})")


def _check_watch_flags(args: argparse.Namespace) -> tuple[Endpoint | None, str | None]:
    """(the --http endpoint or None, the token): refused before anything connects when they are wrong."""
    from fedge.errors import ConfigError
    from fedge.observe.serve import http_flags

    if args.wait_log < 0:
        raise ConfigError(f"--wait-log must be >= 0 seconds, got {args.wait_log:g}")
    if not 0 <= args.heat_max_age < float("inf"):
        raise ConfigError(f"--heat-max-age must be a finite number >= 0 seconds, got {args.heat_max_age:g}",
                          hint="e.g. 30: three of the devices' heartbeat intervals")
    return http_flags(args.http, args.http_token_file)


def _signer(args: argparse.Namespace) -> Signer | None:
    """The fleet's signer from --signing-key, else STATE_DIR/signing.key if present, else None (unsigned)."""
    from pathlib import Path

    from fedge.common.signing import Signer

    path = args.signing_key or (Path(args.state_dir) / "signing.key")
    if args.signing_key is None and not Path(path).is_file():
        return None
    signer = Signer.from_file(path)
    print(f"signing round descriptors and global state with key {signer.key_id} ({path})", file=sys.stderr)
    return signer


def _key_chain(signer: Signer | None, args: argparse.Namespace) -> bytes | None:
    """The fleet key's rotations beside the signing key (fleet-keys.json), to publish retained; None if none."""
    from pathlib import Path

    from fedge.common.keyrotation import chain_for_key

    if signer is None:
        return None
    chain = chain_for_key(args.signing_key or Path(args.state_dir) / "signing.key", signer.key)
    if chain is None:
        return None
    print(f"publishing the fleet's key chain ({len(chain.links)} rotations, newest key {chain.last})", file=sys.stderr)
    return chain.to_bytes()


def _broker(args: argparse.Namespace) -> tuple[EmbeddedBroker | MosquittoProcess | None, BrokerSettings]:
    """(the embedded broker started when no --broker is given, else None; the broker settings)."""
    from fedge.mqtt.flags import broker_settings

    if args.broker is not None:
        return None, broker_settings(args)
    from fedge.mqtt.broker import EmbeddedBroker, MosquittoProcess, free_port

    embedded: EmbeddedBroker | MosquittoProcess
    if args.embedded == "mosquitto":
        embedded = MosquittoProcess(port=args.port or free_port()).start()
    else:
        embedded = EmbeddedBroker(port=args.port).start()
    print(f"embedded broker ({args.embedded}) on {embedded.url}: devices connect with --broker {embedded.url}",
          file=sys.stderr)
    return embedded, broker_settings(args, embedded.url)


def _print_topics(cfg: FleetConfig, devices: int, run_id: str) -> None:
    from fedge.mqtt.topics import FleetTopics

    topics = FleetTopics(cfg.run.fleet)
    print(f"coordinator of fleet {cfg.run.fleet!r} ({cfg.run.method}, {devices} devices in {cfg.source}), "
          f"run {run_id}: devices publish on {topics.device_filter('hello')} (and status, "
          f"update), rounds on {topics.round}, global state on {topics.base}/global/#", file=sys.stderr)


def round_line(rep: RoundReport, total: int) -> str:
    """The line ``fedge coordinator run`` prints after each round (``rep``, a RoundReport) of ``total``."""
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(rep.rejected.items())) or "none"
    # metrics passed the gate (finite numbers), but a printout must not be what stops a coordinator
    # (compact partials of relays and workers report sums and counts, not each device's figure)
    acc_sum, acc_n = rep.metric_values("acc_global")
    acc = f", mean acc {100 * acc_sum / acc_n:.1f}%" if acc_n else ""
    missing = f", missing {', '.join(rep.missing)}" if rep.missing else ""
    p = rep.privacy
    eps = f", ε {p['epsilon']:.3g} at δ {p['delta']:g} (+{p['epsilon_round']:.3g}/round)" if p else ""
    slow = max(rep.train_s.items(), key=lambda kv: kv[1], default=None)  # each device's own clock
    slowest = f", slowest device {slow[0]} {slow[1]:.1f} s" if slow else ""
    stale = list(rep.staleness.values())  # asynchronous mode: a round is a global version
    unit = "version" if stale else "round"
    staleness = f", staleness mean {sum(stale) / len(stale):.1f} max {max(stale)}" if stale else ""
    return (f"{unit} {rep.round}/{total} ({rep.phase}): {len(rep.accepted)} updates{staleness}, rejected "
            f"{rejected}{missing}{acc}{eps}, {rep.seconds:.1f} s{slowest}")


def _run(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from fedge.coordinator.fromfleet import engine_parts, refuse_secure_in_parts
    from fedge.coordinator.service import CoordinatorService
    from fedge.coordinator.store import REPORTS_FILE, read_reports
    from fedge.fleet.config import device_ids, load_fleet
    from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
    from fedge.mqtt.settings import TransportSettings
    from fedge.observe.monitor import FleetMonitor, fleet_infos
    from fedge.observe.serve import start_web

    endpoint, token = _check_watch_flags(args)
    cfg = load_fleet(args.config)
    if args.rounds is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=args.rounds))
    ids = [i for i, _ in device_ids(cfg)]
    # [[shards]] without --workers: the root hears its relays, each for its own subtree
    engine_cfg, strat = engine_parts(args, cfg, any_device=args.any_device, relays_report=not args.workers)
    if args.workers:
        from fedge.common.asyncmode import refuse_in_parts
        from fedge.coordinator.partial import check_splittable

        refuse_in_parts(cfg.asynchronous, "--workers", source=cfg.source)
        refuse_secure_in_parts(cfg, "aggregation workers (--workers)")
        check_splittable(strat)

    embedded, settings = _broker(args)
    wire = TransportSettings(chunk_bytes=args.chunk_bytes, max_message_bytes=engine_cfg.max_update_bytes)
    signer = _signer(args)
    transport = MqttCoordinatorTransport(settings, cfg.run.fleet, wire, signer=signer, updates=not args.workers,
                                         key_chain=_key_chain(signer, args))
    monitor = FleetMonitor(fleet=cfg.run.fleet, method=cfg.run.method, total_rounds=strat.total_rounds(),
                           transport=transport, fleet_devices=fleet_infos(engine_cfg.slots, ids),
                           wait_log_s=args.wait_log,
                           buffer_size=cfg.asynchronous.buffer_size if cfg.asynchronous is not None else 0)
    web: DashboardServer | None = None
    try:
        transport.start()
        service = CoordinatorService(strat, transport, engine_cfg, args.state_dir, observers=[monitor])
        service.engine.health = monitor.heartbeats  # the thermal guard reads the heartbeats (issue 44)
        service.engine.heat_max_age_s = args.heat_max_age
        monitor.run_id = service.engine.run_id
        if service.resumed_from:  # the rounds before the restart, for the dashboard
            for rep in read_reports(Path(args.state_dir) / REPORTS_FILE):
                monitor.add_report(rep)
        monitor.start()
        if args.tensorboard:
            from fedge.observe.tensorboard import TensorBoardWriter

            board = TensorBoardWriter(args.tensorboard)
            board.profiles({d: i.profile for d, i in fleet_infos(engine_cfg.slots, ids).items()})
            service.engine.observers.append(board)
        if endpoint is not None:
            web, more = start_web(monitor, endpoint, token)
            service.engine.observers.extend(more)  # before the first round: they see every round
            print(f"dashboard on {web.url}/, metrics on {web.url}/metrics{' (token required)' if token else ''}",
                  file=sys.stderr)
        _print_topics(cfg, len(ids), service.engine.run_id)
        if service.resumed_from:
            print(f"resuming {cfg.run.method} on fleet {cfg.run.fleet} after round {service.resumed_from} "
                  f"(state in {args.state_dir})", file=sys.stderr)
        if args.wait_for_fleet > 0 and not service.resumed_from:
            service.engine.await_fleet(ids, args.wait_for_fleet)
        total = strat.total_rounds() + 1
        service.run(on_round=lambda rep: print(round_line(rep, total), flush=True))
    finally:
        if web is not None:
            web.stop()
        monitor.stop()
        transport.close()
        if embedded is not None:
            embedded.stop()
    print(f"done: state in {args.state_dir}/state.json")
    return 0
