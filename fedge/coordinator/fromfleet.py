"""The engine's configuration and strategy that a fleet config (and a command's flags) describe.

Shared by the commands that run a coordinator's half: ``fedge coordinator run`` (:mod:`fedge.coordinator.cli`)
and the scale-out services, ``fedge coordinator worker`` and ``fedge relay`` (:mod:`fedge.scaleout.cli`), which
must check updates exactly as the coordinator does. Here rather than in either command line, since no command
line imports another's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from fedge.common.coordinator_section import CoordinatorSection
from fedge.common.heat import HeatLimits
from fedge.common.sampling import thermal_guarded
from fedge.coordinator.config import EngineConfig, engine_config
from fedge.coordinator.service import KEEP_REPORTS
from fedge.coordinator.strategy import Strategy
from fedge.errors import ConfigError, FedgeError
from fedge.fleet.clock import fleet_clock
from fedge.fleet.config import FleetConfig, device_ids
from fedge.fleet.registry import method_entry
from fedge.fleet.shards import reporters
from fedge.fleet.slots import checked_slots, device_profile, fleet_classes

log = logging.getLogger(__name__)

# flag dest -> [coordinator] key
_FLAG_KEYS = {"min_devices": "min_devices", "quorum": "quorum", "quorum_timeout": "quorum_timeout_s",
              "deadline_slack": "deadline_slack", "round_timeout": "round_timeout_s", "min_round": "min_round_s",
              "max_round": "max_round_s", "max_update_bytes": "max_update_bytes", "aggregation": "aggregation",
              "trim": "trim", "clip": "clip"}


def coordinator_settings(args: argparse.Namespace, section: CoordinatorSection, source: str) -> CoordinatorSection:
    """The fleet config's ``[coordinator]`` table with every flag given applied over it."""
    flags = {key: getattr(args, dest) for dest, key in _FLAG_KEYS.items() if getattr(args, dest, None) is not None}
    try:
        return section.override(**flags)
    except ConfigError as exc:
        raise ConfigError(f"{source}: [coordinator] with the flags: {exc.message}", hint=exc.hint) from exc


def engine_parts(args: argparse.Namespace, cfg: FleetConfig, *, any_device: bool, relays_report: bool = False,
                 shard: str | None = None) -> tuple[EngineConfig, Strategy]:
    """The EngineConfig and the strategy a fleet config (``cfg``, a ``FleetConfig``) and the command's flags
    describe.

    ``relays_report``: this node merges the partials of ``[[shards]]``' relays whose parent is ``shard`` (None:
    the root, ``fedge coordinator run`` without ``--workers``; a relay's shard name for ``fedge relay``), each
    for its own subtree only (:attr:`EngineConfig.partial_reporters`). Otherwise, or without ``[[shards]]``, any
    account the broker lets publish a partial is heard (aggregation workers)."""
    engine_cfg = engine_config(coordinator_settings(args, cfg.coordinator, cfg.source), fleet=cfg.run.fleet,
                               method=cfg.run.method, slots=checked_slots(cfg), own_data=cfg.own_data,
                               privacy=cfg.privacy_mechanism, any_device=any_device, keep_reports=KEEP_REPORTS)
    if relays_report and cfg.shard_layout:
        engine_cfg = dataclasses.replace(engine_cfg, partial_reporters=reporters(cfg.shard_layout, shard))
    if engine_cfg.slots is not None:
        engine_cfg = dataclasses.replace(engine_cfg, slots=heat_limits(cfg, expected_task_times(cfg, engine_cfg.slots)))
    if cfg.privacy.secure_aggregation:  # synchronous rounds over MQTT (fedge.coordinator.secure)
        engine_cfg = dataclasses.replace(engine_cfg, secure=cfg.privacy)
    strat = method_entry(cfg.run.method).build_strategy(cfg.method_config, num_classes=len(fleet_classes(cfg)),
                                                         rounds=cfg.run.rounds)
    return engine_cfg, strat


def refuse_secure_in_parts(cfg: FleetConfig, what: str) -> None:
    """:class:`ConfigError` when ``cfg`` sums securely and ``what`` (aggregation workers) would read its rounds:
    workers share out the devices' updates, which in a secure round carry metrics only, and a masked input means
    nothing outside its group's sum (relays do carry secure rounds: they sum their shard's masked inputs,
    :mod:`fedge.secagg.partial`)."""
    if cfg.privacy.secure_aggregation:
        raise ConfigError(f"{cfg.source}: [privacy] secure_aggregation runs with one coordinator per broker tree; "
                          f"{what} do not carry its stage messages",
                          hint="leave secure_aggregation out, or run the fleet without aggregation workers (relays "
                               "and [[shards]] work: docs/security.md#secure-aggregation)")


def heat_limits(cfg: FleetConfig, checks: Mapping[str, Any]) -> Mapping[str, Any]:
    """With ``[coordinator] thermal_guard``: each slot check with its profile's ``[thermal]`` limits (the guard reads
    the heartbeats against them; a profile without the table keeps the defaults, :class:`HeatLimits`)."""
    if not thermal_guarded(cfg.coordinator.sampling, cfg.coordinator.asynchronous):
        return checks
    limits: dict[int, HeatLimits | None] = {}
    out = dict(checks)
    for d, gi in device_ids(cfg):
        if gi not in limits:
            thermal = device_profile(cfg, gi).thermal
            limits[gi] = thermal.limits if thermal is not None else None
        if d in out and limits[gi] is not None:
            out[d] = dataclasses.replace(out[d], heat=limits[gi])
    return out


def expected_task_times(cfg: FleetConfig, checks: Mapping[str, Any]) -> Mapping[str, Any]:
    """Asynchronous mode: each slot check with its device's task time by the fleet config's clock model (its
    training and evaluation on its profile's speed; fedge.fleet.clock), the basis of the default task timeout until
    the device has delivered a task (EngineConfig.round_timeout_s). Unchanged for synchronous rounds, or when the
    clock cannot be built (the command's other checks say why)."""
    if cfg.asynchronous is None:
        return checks
    try:
        clocks = fleet_clock(cfg, checked_slots(cfg)).devices
    except (FedgeError, OSError) as exc:
        log.warning("no clock-model task times (%s): a task's default timeout waits for its first update", exc)
        return checks
    return {d: dataclasses.replace(c, expected_task_s=clocks[d].train_s(1)) if d in clocks else c
            for d, c in checks.items()}
