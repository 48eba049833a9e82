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

# Defaults of the scheduling settings when neither a flag nor the fleet's [coordinator] table sets them.
SCHEDULING_DEFAULTS: dict[str, float] = {
    "min_devices": 1, "quorum": 0.5, "quorum_timeout_s": 600.0, "deadline_slack": 2.0, "round_timeout_s": 300.0,
    "min_round_s": 5.0, "max_round_s": 3600.0, "max_update_bytes": 64 * 1024 * 1024,
}
# flag dest -> [coordinator] key
_FLAG_KEYS = {"min_devices": "min_devices", "quorum": "quorum", "quorum_timeout": "quorum_timeout_s",
              "deadline_slack": "deadline_slack", "round_timeout": "round_timeout_s", "min_round": "min_round_s",
              "max_round": "max_round_s", "max_update_bytes": "max_update_bytes", "aggregation": "aggregation",
              "trim": "trim", "clip": "clip"}


def coordinator_settings(args: argparse.Namespace, table: dict[str, Any], source: str) -> Any:
    """The fleet config's ``[coordinator]`` table with every flag that was given applied over it."""
    from fedge.common.tomlconf import build
    from fedge.coordinator.config import CoordinatorSection

    merged = dict(table)
    merged.update({key: getattr(args, dest) for dest, key in _FLAG_KEYS.items() if getattr(args, dest) is not None})
    return build(CoordinatorSection, merged, source=source, section="coordinator")


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
    s = r.add_argument_group("scheduling (flags override the fleet config's [coordinator] table)")
    d = SCHEDULING_DEFAULTS
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
                   help=f"budget of a round with a device of unknown speed (default {d['round_timeout_s']:.0f}; "
                        "0: wait for it)")
    s.add_argument("--min-round", type=float, metavar="S", help=f"shortest deadline (default {d['min_round_s']:g})")
    s.add_argument("--max-round", type=float, metavar="S", help=f"longest deadline (default {d['max_round_s']:g})")
    g = r.add_argument_group("aggregation (flags override the fleet config's [coordinator] table)")
    g.add_argument("--aggregation", choices=("mean", "trimmed", "median"),
                   help="how updates are combined (default mean; fedavg, lgfedavg and fedproto)")
    g.add_argument("--trim", type=float,
                   help="trimmed: fraction of the devices cut at each end of every coordinate (default 0.2)")
    g.add_argument("--clip", type=float, help="clip updates to CLIP x the median distance from the median (0: off)")
    w = r.add_argument_group("wire")
    w.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="chunk messages above this size")
    w.add_argument("--max-update-bytes", type=int, help="refuse larger updates (default 64 MiB; each update is "
                                                        "also bounded by what its device owes)")
    r.add_argument("--rounds", type=int, help="override [run] rounds")
    r.add_argument("--any-device", action="store_true",
                   help="accept hellos from devices not listed in the fleet config")
    r.set_defaults(func=_run)


def _wait_for_fleet(transport: Any, ids: list[str], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every device's hello; the quorum decides when fewer say hello."""
    from fedge.errors import TransportError

    try:
        transport.wait_for_hellos(ids, timeout_s)
    except TransportError as exc:
        log.warning("%s: starting with the devices online once the quorum is", exc.message)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from fedge.coordinator.config import EngineConfig, slot_checks
    from fedge.coordinator.service import KEEP_REPORTS, CoordinatorService
    from fedge.fleet.config import device_ids, load_fleet
    from fedge.fleet.registry import method_entry
    from fedge.fleet.slots import checked_slots, fleet_classes
    from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
    from fedge.mqtt.flags import broker_settings
    from fedge.mqtt.settings import TransportSettings

    cfg = load_fleet(args.config)
    if args.rounds is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=args.rounds))
    ids = [i for i, _ in device_ids(cfg)]
    section = coordinator_settings(args, cfg.coordinator, cfg.source)
    d = SCHEDULING_DEFAULTS

    def pick(key: str) -> Any:
        value = getattr(section, key)
        return d[key] if value is None else value

    engine_cfg = EngineConfig(
        fleet=cfg.run.fleet, method=cfg.run.method, expected_devices=len(ids),
        allowed_devices=None if args.any_device else frozenset(ids), max_update_bytes=int(pick("max_update_bytes")),
        min_devices=int(pick("min_devices")), quorum_fraction=pick("quorum"), quorum_timeout_s=pick("quorum_timeout_s"),
        deadline_slack=pick("deadline_slack"), round_timeout_s=pick("round_timeout_s"), min_round_s=pick("min_round_s"),
        max_round_s=pick("max_round_s"), keep_reports=KEEP_REPORTS, aggregation=section.aggregation_rule(),
        # every hello is checked against its device's slot (arch, precision, samples, embedding size)
        slots=slot_checks(checked_slots(cfg), own_data=cfg.own_data), privacy=cfg.privacy_mechanism,
        sampling=cfg.sampling, asynchronous=cfg.asynchronous)
    strat = method_entry(cfg.run.method).build_strategy(cfg.method_config, num_classes=len(fleet_classes(cfg)),
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
    wire = TransportSettings(chunk_bytes=args.chunk_bytes, max_message_bytes=engine_cfg.max_update_bytes)
    transport = MqttCoordinatorTransport(settings, cfg.run.fleet, wire)
    try:
        transport.start()
        service = CoordinatorService(strat, transport, engine_cfg, args.state_dir)
        from fedge.mqtt.topics import FleetTopics

        topics = FleetTopics(cfg.run.fleet)
        print(f"coordinator of fleet {cfg.run.fleet!r} ({cfg.run.method}, {len(ids)} devices in {cfg.source}), "
              f"run {service.engine.run_id}: devices publish on {topics.device_filter('hello')} (and status, "
              f"update), rounds on {topics.round}, global state on {topics.base}/global/#", file=sys.stderr)
        if service.resumed_from:
            print(f"resuming {cfg.run.method} on fleet {cfg.run.fleet} after round {service.resumed_from} "
                  f"(state in {args.state_dir})", file=sys.stderr)
        if args.wait_for_fleet > 0 and not service.resumed_from:
            _wait_for_fleet(transport, ids, args.wait_for_fleet)
        total = strat.total_rounds() + 1

        def on_round(rep: Any) -> None:
            rejected = ", ".join(f"{k} {v}" for k, v in sorted(rep.rejected.items())) or "none"
            # metrics passed the gate (finite numbers), but a printout must not be what stops a coordinator
            accs = [float(a) for m in rep.metrics.values()
                    if isinstance(a := m.get("acc_global"), int | float) and not isinstance(a, bool)]
            acc = f", mean acc {100 * sum(accs) / len(accs):.1f}%" if accs else ""
            missing = f", missing {', '.join(rep.missing)}" if rep.missing else ""
            p = rep.privacy
            eps = f", ε {p['epsilon']:.3g} at δ {p['delta']:g} (+{p['epsilon_round']:.3g}/round)" if p else ""
            slow = max(rep.train_s.items(), key=lambda kv: kv[1], default=None)  # each device's own clock
            slowest = f", slowest device {slow[0]} {slow[1]:.1f} s" if slow else ""
            print(f"round {rep.round}/{total} ({rep.phase}): {len(rep.accepted)} updates, rejected {rejected}"
                  f"{missing}{acc}{eps}, {rep.seconds:.1f} s{slowest}", flush=True)

        service.run(on_round=on_round)
    finally:
        transport.close()
        if embedded is not None:
            embedded.stop()
    print(f"done: state in {args.state_dir}/state.json")
    return 0
