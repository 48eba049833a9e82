"""The transports ``fedge simulate`` can run a fleet over: a table, each entry naming its runner.

A runner takes the fleet config and its built devices and returns (coordinator
transport, device agents, cleanup). Runners are imported only when chosen, so an
in-process run never loads paho. Adding a transport is one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from fedge.errors import ConfigError

if TYPE_CHECKING:
    from fedge.common.transport import CoordinatorTransport
    from fedge.edge.agent import DeviceAgent
    from fedge.fleet.config import FleetConfig
    from fedge.fleet.devices import SimDevice

    TransportRunner = Callable[[FleetConfig, list[SimDevice]],
                               tuple[CoordinatorTransport, list[DeviceAgent], Callable[[], None]]]


@dataclass(frozen=True)
class Transport:
    """One ``--transport`` choice: the function (``module:name``) that connects a fleet over it."""

    runner: str
    help: str

    def load(self) -> TransportRunner:
        module, name = self.runner.split(":")
        return cast("TransportRunner", getattr(importlib.import_module(module), name))


TRANSPORTS: dict[str, Transport] = {
    "inprocess": Transport("fedge.sim.inprocess:run_inprocess",
                           "an in-memory bus, devices stepped in fleet order (deterministic; default)"),
    "mqtt": Transport("fedge.sim.over_mqtt:run_mqtt",
                      "an embedded broker on loopback, one MQTT connection and thread per device"),
}


def transport_runner(name: str) -> TransportRunner:
    """The runner of ``--transport name``; an unknown name is a :class:`ConfigError` listing the choices."""
    if name not in TRANSPORTS:
        raise ConfigError(f"unknown transport {name!r}", hint=f"use one of {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name].load()
