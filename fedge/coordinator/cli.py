"""``fedge coordinator run``: the coordinator service over MQTT.

This is the command layer: it may import the fleet layer (:mod:`fedge.fleet`) and
the MQTT package lazily, which the coordinator library itself never does. The broker
flags it shares with ``fedge edge run`` live with what they configure (:mod:`fedge.mqtt.flags`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fedge.mqtt.flags import add_broker_arguments

    c = sub.add_parser("coordinator", help="run the coordinator against an MQTT broker",
                       description="The coordinator service: registers devices, runs rounds, checkpoints.")
    csub = c.add_subparsers(dest="coordinator_command", metavar="ACTION", required=True)
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
    s = r.add_argument_group("scheduling")
    s.add_argument("--min-devices", type=int, default=1, help="devices online before a round starts (default 1)")
    s.add_argument("--quorum", type=float, default=0.5, metavar="FRACTION",
                   help="fraction of the fleet's devices online before a round starts (default 0.5)")
    s.add_argument("--quorum-timeout", type=float, default=600.0, metavar="S", help="give up waiting (default 600)")
    s.add_argument("--deadline-slack", type=float, default=2.0,
                   help="round deadline = slack x the slowest expected device's round time (default 2; 0: off)")
    s.add_argument("--round-timeout", type=float, default=300.0, metavar="S",
                   help="budget of a round with a device of unknown speed (default 300; 0: wait for it)")
    s.add_argument("--min-round", type=float, default=5.0, metavar="S", help="shortest deadline (default 5)")
    s.add_argument("--max-round", type=float, default=3600.0, metavar="S", help="longest deadline (default 3600)")
    w = r.add_argument_group("wire")
    w.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="chunk messages above this size")
    w.add_argument("--max-update-bytes", type=int, default=64 * 1024 * 1024, help="refuse larger updates")
    r.add_argument("--rounds", type=int, help="override [run] rounds")
    r.add_argument("--any-device", action="store_true",
                   help="accept hellos from devices not listed in the fleet config")
    r.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from fedge.coordinator.service import CoordinatorService, SchedulePolicy
    from fedge.coordinator.strategies import strategy
    from fedge.fleet.config import device_ids, load_fleet
    from fedge.fleet.slots import fleet_classes
    from fedge.mqtt.flags import broker_settings
    from fedge.mqtt.transport import MqttCoordinatorTransport, TransportSettings

    cfg = load_fleet(args.config)
    if args.rounds is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=args.rounds))
    ids = [i for i, _ in device_ids(cfg)]
    policy = SchedulePolicy(min_devices=args.min_devices, quorum_fraction=args.quorum,
                            quorum_timeout_s=args.quorum_timeout, deadline_slack=args.deadline_slack,
                            round_timeout_s=args.round_timeout, min_round_s=args.min_round, max_round_s=args.max_round)
    engine_cfg = policy.engine_config(fleet=cfg.run.fleet, method=cfg.run.method, expected_devices=len(ids),
                                      allowed=None if args.any_device else frozenset(ids),
                                      max_update_bytes=args.max_update_bytes)
    strat = strategy(cfg.run.method)(dict(cfg.method), num_classes=len(fleet_classes(cfg)),
                                     rounds=cfg.run.rounds)

    embedded: Any = None
    if args.broker is None:
        from fedge.mqtt.broker import EmbeddedBroker, MosquittoProcess, free_port

        if args.embedded == "mosquitto":
            embedded = MosquittoProcess(port=args.port or free_port()).start()
        else:
            embedded = EmbeddedBroker(port=args.port).start()
        print(f"embedded broker ({args.embedded}) on {embedded.url}: devices connect with --broker {embedded.url}",
              file=sys.stderr)
        settings = broker_settings(args, embedded.url)
    else:
        settings = broker_settings(args)
    wire = TransportSettings(chunk_bytes=args.chunk_bytes, max_message_bytes=args.max_update_bytes)
    transport = MqttCoordinatorTransport(settings, cfg.run.fleet, wire)
    try:
        transport.start()
        service = CoordinatorService(strat, transport, engine_cfg, args.state_dir)
        if service.resumed_from:
            print(f"resuming {cfg.run.method} on fleet {cfg.run.fleet} after round {service.resumed_from} "
                  f"(state in {args.state_dir})", file=sys.stderr)
        total = strat.total_rounds() + 1

        def on_round(rep: Any) -> None:
            rejected = ", ".join(f"{k} {v}" for k, v in sorted(rep.rejected.items())) or "none"
            accs = [m["acc_global"] for m in rep.metrics.values() if "acc_global" in m]
            acc = f", mean acc {100 * sum(accs) / len(accs):.1f}%" if accs else ""
            missing = f", missing {', '.join(rep.missing)}" if rep.missing else ""
            print(f"round {rep.round}/{total} ({rep.phase}): {len(rep.accepted)} updates, rejected {rejected}"
                  f"{missing}{acc}, {rep.seconds:.1f} s", flush=True)

        service.run(on_round=on_round)
    finally:
        transport.close()
        if embedded is not None:
            embedded.stop()
    print(f"done: state in {args.state_dir}/state.json")
    return 0
