"""A sharded fleet in an emulation: which shards run, and the fleet config that names their containers.

The shards come from the fleet config's ``[[shards]]`` (:mod:`fedge.fleet.shards`: devices, names,
parents) or from ``fedge emulate up --shards N`` (:func:`~fedge.fleet.shards.even_shards`: N shards of
contiguous devices under the root). In the emulation every shard's broker is a container: shard NAME's
broker is the compose service ``broker-NAME`` on MQTT's port, whatever address ``[[shards]]`` gave it
for the real sites (that address belongs to a machine the emulation does not have). The emulation
directory's ``fleet.toml`` therefore carries the ``[[shards]]`` tables the emulation runs — every
device listed by id, every broker at its service name — and everything downstream reads that one file:
``fedge broker config``'s writer for shards (the devices' bundles name ``broker-NAME``), ``fedge
flash``'s check of each bundle against its shard, each ``fedge relay --name relay-NAME`` and the
coordinator (which relay may report which devices).

Refused before anything is written or started, each naming the key and the fix: ``--shards`` beside
``[[shards]]``, ``--shards`` below 1 or above the device count, a shard layout the fleet config itself
refuses (checked when it loads: unknown or unassigned devices, a device in two shards, a cycle of
relays), asynchronous rounds or a method that cannot aggregate in parts, and a shard whose container
names would clash with a device's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.emulate.compose import BROKER, COORDINATOR, MQTT_PORT, shard_broker
from fedge.errors import ConfigError
from fedge.fleet.shards import Shard, even_shards

if TYPE_CHECKING:
    from fedge.broker.options import BrokerOptions
    from fedge.fleet.config import FleetConfig

log = logging.getLogger(__name__)

_SHARDS_HEADER = re.compile(r"^\[\[\s*shards\s*\]\]\s*(#.*)?$")


def emulated_layout(cfg: FleetConfig, ids: list[str], count: int | None = None) -> list[Shard]:
    """The shards the emulation runs (empty: a flat fleet), each broker at ``broker-NAME:1883``.

    ``count``: ``fedge emulate up --shards N`` (None: the fleet config's ``[[shards]]``, if any).
    """
    if count is not None and cfg.shards:
        raise ConfigError(f"--shards {count} and the [[shards]] tables of {cfg.source} both say how to shard the "
                          "fleet", hint="drop --shards (the fleet config's [[shards]] decide), or remove the "
                                        "[[shards]] tables to split the fleet evenly")
    if count is None and not cfg.shards:
        return []
    if count is not None and count < 1:
        raise ConfigError(f"--shards {count} must be at least 1",
                          hint="leave --shards out to run one broker, or give the number of shard brokers")
    what = "[[shards]]" if cfg.shards else f"--shards {count}"
    _check_method(cfg, what)
    layout = cfg.shard_layout if cfg.shards else even_shards(ids, count or 0, BROKER, MQTT_PORT)
    out = [dataclasses.replace(s, host=shard_broker(s.name), port=MQTT_PORT, scheme=None) for s in layout]
    services = {BROKER: "the root broker", COORDINATOR: "the coordinator"}
    for s in out:
        for service, what_it_is in ((s.host, f"shard {s.name!r}'s broker"), (s.relay, f"shard {s.name!r}'s relay")):
            if service in ids or service in services:
                other = f"device {service!r}" if service in ids else services[service]
                raise ConfigError(f"{what}: {what_it_is} runs as the container {service!r}, the name of {other}",
                                  hint="rename the shard (name = ... in [[shards]]) or the devices (id_prefix)")
            services[service] = what_it_is
    return out


def _check_method(cfg: FleetConfig, what: str) -> None:
    """Relays send one partial aggregate per round: synchronous rounds of a method that splits, only."""
    from fedge.common.asyncmode import refuse_in_parts
    from fedge.fleet.registry import method_entry

    refuse_in_parts(cfg.asynchronous, what, source=cfg.source)
    if method_entry(cfg.run.method).coordinator_half().partial_fields is None:
        raise ConfigError(f"{cfg.source}: {what}: method {cfg.run.method!r} cannot aggregate in parts, so its fleet "
                          "cannot run behind relays",
                          hint="emulate it without shards (one broker), or use fedavg, lgfedavg, fedproto or local")


def shard_tables(layout: list[Shard]) -> list[dict[str, Any]]:
    """The ``[[shards]]`` tables of ``layout`` as parsed TOML: every device by id, each broker's URL."""
    out = []
    for s in layout:
        table: dict[str, Any] = {"name": s.name, "broker": f"mqtt://{s.host}:{s.port}", "devices": list(s.devices)}
        if s.parent is not None:
            table["parent"] = s.parent
        out.append(table)
    return out


def sharded_fleet_text(text: str, layout: list[Shard], *, source: str) -> str:
    """The fleet config ``text`` with its ``[[shards]]`` tables (if any) replaced by ``layout``'s.

    The rest of the file is kept as written, comments included; the result is parsed back and must equal the
    original outside ``shards`` (a fleet config whose shards are not ``[[shards]]`` tables, e.g. an inline
    ``shards = [...]``, is refused rather than rewritten wrongly).
    """
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        stripped = line.strip()
        if _SHARDS_HEADER.match(stripped):
            skipping = True
            continue
        if skipping and stripped.startswith("["):  # the next table's header ends a [[shards]] table
            skipping = False
        if not skipping:
            kept.append(line)
    tables = shard_tables(layout)
    parts = [*kept, "", "# [[shards]] as `fedge emulate up` runs them: each shard's broker is the container "
                        "broker-NAME (docs/emulate.md)"]
    for t in tables:
        parts += ["", "[[shards]]", *(f"{k} = {json.dumps(v)}" for k, v in t.items())]
    out = "\n".join(parts).strip("\n") + "\n"
    hint = "write each shard as a [[shards]] table (docs/scale.md), not as an inline array"
    try:
        before, after = tomllib.loads(text), tomllib.loads(out)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: its shards could not be rewritten for the emulation's containers ({exc})",
                          hint=hint) from exc
    before.pop("shards", None)
    if after.pop("shards", None) != tables or after != before:
        raise ConfigError(f"{source}: its shards could not be rewritten for the emulation's containers",
                          hint=hint)
    return out


def write_shard_brokers(fleet_text: str, out: Path, layout: list[Shard], opts: BrokerOptions) -> None:
    """The emulation's ``fleet.toml`` (``fleet_text``: :func:`sharded_fleet_text`) and, from it, ``fedge broker
    config``'s tree in ``out/broker`` (:func:`fedge.broker.shards.write_sharded_config`): the root broker, one
    broker directory per shard, the relays' passwords, every device's bundle naming its shard's container.

    A previous run's retained messages (each shard's ``data/``) and relay state (``relays/``) are removed: they
    would resume that run."""
    from fedge.broker.shards import write_sharded_config
    from fedge.fleet.config import device_ids, load_fleet

    fleet = out / "fleet.toml"
    fleet.write_text(fleet_text)
    cfg = load_fleet(fleet)  # the file every container reads: its [[shards]] pass the fleet config's checks
    for s in layout:
        shutil.rmtree(out / "broker" / "shards" / s.dirname / "data", ignore_errors=True)
    shutil.rmtree(out / "relays", ignore_errors=True)
    for s in layout:  # the relays' state directories, mounted into their containers
        (out / "relays" / s.relay).mkdir(parents=True)
    write_sharded_config(cfg.run.fleet, [i for i, _ in device_ids(cfg)], out / "broker", opts,
                         shards=cfg.shard_layout, fleet_config=fleet)
    log.info("%d shards: %s", len(layout), "; ".join(f"{s.host} and {s.relay} ({len(s.devices)} devices"
                                                     f"{'' if s.parent is None else ', under ' + s.parent})"
                                                     for s in layout))


def shard_records(layout: list[Shard]) -> list[dict[str, Any]]:
    """The shards as ``emulation.json`` keeps them (:attr:`fedge.emulate.emulation.Emulation.shards`)."""
    return [{"name": s.name, "parent": s.parent, "broker": s.host, "relay": s.relay,
             "up": BROKER if s.parent is None else shard_broker(s.parent), "devices": list(s.devices)} for s in layout]
