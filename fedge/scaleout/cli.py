"""``fedge relay`` and ``fedge coordinator worker``: the scale-out services' command lines.

``fedge relay`` is added through ``add_parser`` like every area's commands; ``worker`` is an action of
``fedge coordinator``, whose command line is another area's, so :mod:`fedge.cli` adds it there
(:func:`add_worker_parser`). Both build their aggregator from the fleet config exactly as the coordinator
builds its engine (:mod:`fedge.coordinator.fromfleet`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TypeAlias

Parsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # argparse's type, generic for mypy only


def add_parser(sub: Parsers) -> None:
    """``fedge relay``."""
    _add_relay_parser(sub)


def add_worker_parser(csub: Parsers) -> None:
    """``fedge coordinator worker``, added under ``fedge coordinator`` by :mod:`fedge.cli`."""
    from fedge.mqtt.flags import add_broker_arguments

    wk = csub.add_parser("worker", help="aggregate a share of the updates (MQTT 5 shared subscription)",
                        description="An aggregation worker: reads its share of the fleet's updates through the "
                                    "shared subscription $share/GROUP/fedge/FLEET/devices/+/update, checks each "
                                    "with the coordinator's update gate, accumulates them and sends partial "
                                    "aggregates to the coordinator (started with --workers). See docs/scale.md.")
    _add_aggregator_arguments(wk)
    add_broker_arguments(wk, required=True)
    wk.add_argument("--group", default="fedge-workers", help="shared subscription group (default fedge-workers)")
    wk.add_argument("--flush", type=float, default=0.05, metavar="S",
                   help="send what accumulated every S seconds (default 0.05)")
    wk.set_defaults(func=_worker)



def _add_relay_parser(sub: Parsers) -> None:
    from fedge.mqtt.flags import add_broker_arguments

    rl = sub.add_parser("relay", help="relay one broker shard to its parent broker (hierarchical aggregation)",
                        description="A relay: connected to its shard's broker (--shard) and to its parent's "
                                    "(--broker) under one account; forwards the global state and round "
                                    "descriptors down, the devices' hellos and statuses up, and one partial "
                                    "aggregate of the shard's updates per round instead of the updates. See "
                                    "docs/scale.md.")
    _add_aggregator_arguments(rl)
    add_broker_arguments(rl, required=True)
    rl.add_argument("--shard", metavar="URL",
                    help="the shard's broker (same credentials; default: the broker of this relay's shard in the "
                         "fleet config's [[shards]], the shard NAME of --name relay-NAME)")
    rl.add_argument("--state-dir", metavar="DIR",
                    help="where the relay notes the devices it forwarded this round (a restarted relay does not "
                         "count them twice) and keeps each round's per-device entries (rounds.jsonl)")
    rl.add_argument("--margin", type=float, default=1.0, metavar="S",
                    help="send the partial S seconds before the round's deadline at the latest (default 1)")
    rl.add_argument("--hold", type=float, default=1.0, metavar="S",
                    help="send what accumulated once nothing new came for S seconds (default 1)")
    rl.set_defaults(func=_relay)



def _add_aggregator_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FLEET.toml", help="the fleet config (the coordinator's)")
    p.add_argument("--name", metavar="ACCOUNT",
                   help="this aggregator's account: its partials go to fedge/FLEET/partials/ACCOUNT (default: "
                        "--username)")
    p.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="chunk messages above this size")
    p.add_argument("--rounds", type=int, help="override [run] rounds (as the coordinator does)")
    p.add_argument("--detail", action="store_true",
                   help="send each device's report entry (bytes, update info: ~100 B per device per round) in the "
                        "partials, so the root's report has per-device figures; default: compact partials (the "
                        "devices as runs of ids and one summary: bytes, mean metrics, training time), whose size "
                        "does not grow with the devices (docs/scale.md)")
    p.add_argument("--fp32-sums", action="store_true",
                   help="send the partial's sums as float32 (half their bytes: about one update per partial) "
                        "instead of float64 split in two float32 halves (the flat aggregate to 1 float32 ulp); "
                        "each partial then adds one float32 rounding")



def _aggregator(args: argparse.Namespace, command: str, cfg: Any = None, *, relay: bool = False
                ) -> tuple[Any, Any, Any]:
    """(the aggregator, the broker settings, the transport settings) of a worker or relay (``relay``) command
    (``command``, for the refusal of an asynchronous or, for a worker, secure fleet; ``cfg``: the fleet config,
    when the command loaded it). A ``relay`` of a ``[[shards]]`` entry hears its child relays only, each for its
    own subtree."""
    import dataclasses

    from fedge.common.asyncmode import refuse_in_parts
    from fedge.coordinator.fromfleet import engine_parts, refuse_secure_in_parts
    from fedge.errors import ConfigError
    from fedge.fleet.config import load_fleet
    from fedge.mqtt.flags import broker_settings
    from fedge.mqtt.settings import TransportSettings
    from fedge.scaleout.aggregator import PartialAggregator

    cfg = cfg or load_fleet(args.config)
    refuse_in_parts(cfg.asynchronous, command, source=cfg.source)
    if not relay:  # a relay sums its shard's masked inputs; a worker has no stage messages to carry
        refuse_secure_in_parts(cfg, command)
    if args.rounds is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=args.rounds))
    name = args.name or args.username
    if not name:
        raise ConfigError("an aggregator needs an account name", hint="pass --name (or --username)")
    mine = next((s for s in cfg.shard_layout if s.relay == name), None) if relay else None
    engine_cfg, strat = engine_parts(args, cfg, any_device=False, relays_report=mine is not None,
                                     shard=mine.name if mine is not None else None)
    agg = PartialAggregator(strat, engine_cfg, name, detail=args.detail, exact=not args.fp32_sums)
    return (agg, broker_settings(args),
            TransportSettings(chunk_bytes=args.chunk_bytes, max_message_bytes=engine_cfg.max_update_bytes))



def _worker(args: argparse.Namespace) -> int:
    from fedge.coordinator.service import install_stop_signals
    from fedge.scaleout.worker import AggregationWorker

    agg, broker, wire = _aggregator(args, "`fedge coordinator worker`")
    worker = AggregationWorker(broker, agg.config.fleet, agg, group=args.group, flush_s=args.flush, settings=wire)
    restore = install_stop_signals()
    try:
        worker.start()
        print(f"worker {agg.name} of fleet {agg.config.fleet!r}: reading {worker.subscription} on {broker.url}, "
              f"partials to {worker.topics.partial(agg.name)}", file=sys.stderr, flush=True)
        worker.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        restore()
        worker.stop()
    return 0



def shard_url(args: argparse.Namespace, cfg: Any, name: str, parent: Any) -> str:
    """``--shard``, or the broker of relay ``name``'s shard in ``[[shards]]``; a parent shard there must be
    the broker ``--broker`` names."""
    from fedge.errors import ConfigError

    layout = {s.relay: s for s in cfg.shard_layout}
    mine = layout.get(name)
    if mine is not None and mine.parent is not None:
        up = next(s for s in cfg.shard_layout if s.name == mine.parent)
        if (up.host, up.port) != (parent.host, parent.port):
            raise ConfigError(f"{cfg.source}: [[shards]] {mine.name!r} reports to shard {up.name!r} at "
                              f"{up.host}:{up.port}, but --broker is {parent.url}",
                              hint=f"pass --broker mqtt://{up.host}:{up.port} (mqtts:// with TLS), or change "
                                   f"{mine.name!r}'s parent")
    if args.shard:
        return str(args.shard)
    if mine is None:
        raise ConfigError(f"relay {name!r} needs --shard: {cfg.source} has no [[shards]] entry whose relay is {name}",
                          hint="pass --shard mqtt://HOST:PORT, or --name relay-NAME for the shard NAME of "
                               "[[shards]]" if cfg.shard_layout else "pass --shard mqtt://HOST:PORT")
    scheme = mine.scheme or ("mqtts" if parent.tls else "mqtt")
    return f"{scheme}://{mine.host}:{mine.port}"



def _relay(args: argparse.Namespace) -> int:
    from fedge.coordinator.service import install_stop_signals
    from fedge.fleet.config import load_fleet
    from fedge.mqtt.connection import parse_broker_url
    from fedge.scaleout.relay import Relay

    cfg = load_fleet(args.config)
    agg, parent, wire = _aggregator(args, "`fedge relay`", cfg, relay=True)
    child = parse_broker_url(shard_url(args, cfg, agg.name, parent), username=parent.username,
                             password=parent.password,
                             tls=True if parent.tls else None, ca_file=parent.ca_file, cert_file=parent.cert_file,
                             key_file=parent.key_file)
    relay = Relay(child, parent, agg.config.fleet, agg, settings=wire, state_dir=args.state_dir,
                  margin_s=args.margin, hold_s=args.hold)
    restore = install_stop_signals()
    try:
        relay.start()
        print(f"relay {agg.name} of fleet {agg.config.fleet!r}: shard {child.url} -> parent {parent.url}",
              file=sys.stderr, flush=True)
        relay.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        restore()
        relay.stop()
    return 0
