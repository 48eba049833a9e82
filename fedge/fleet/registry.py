"""Every method, one line each: its ``[method]`` settings, its device half, its coordinator half.

This is the only registry of methods. The halves are named by dotted path and
imported on first use, so importing this module loads neither torch (device
halves) nor the coordinator; a coordinator resolves only
:meth:`MethodEntry.coordinator_half`, a device only :meth:`MethodEntry.device_half`.
Adding a method is one settings class in :mod:`fedge.common.method_settings`, one
device half, one coordinator half and one line in :data:`METHODS`
(``docs/architecture.md``, "Adding a method").
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedge.common.method_settings import (
    FedAvgSettings,
    FedProtoSettings,
    FedVTCSettings,
    GeFLFSettings,
    GeFLSettings,
    LGFedAvgSettings,
    LocalSettings,
)
from fedge.common.settings import MethodSettings
from fedge.errors import ConfigError

if TYPE_CHECKING:
    from fedge.coordinator.strategy import Strategy
    from fedge.edge.methods.base import DeviceContext, DeviceMethod


def _resolve(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class MethodEntry:
    """One method: its settings class and where its two halves live (``"module:Class"``)."""

    settings: type[MethodSettings]
    device: str
    coordinator: str

    @property
    def name(self) -> str:
        """The ``[run] method`` name (the settings class's)."""
        return self.settings.method

    @property
    def shares_features(self) -> bool:
        """Devices exchange feature-space statistics, so every device needs the same p."""
        return self.settings.shares_features

    def parse(self, table: Mapping[str, Any] | None = None, *, source: str = "") -> MethodSettings:
        """The method's settings from a ``[method]`` table (unknown keys, wrong types: :class:`ConfigError`)."""
        return self.settings.parse(table, source=source)

    def device_half(self) -> type[DeviceMethod]:
        """The device half's class (imports torch)."""
        return _resolve(self.device)

    def coordinator_half(self) -> type[Strategy]:
        """The coordinator half's class (numpy only)."""
        return _resolve(self.coordinator)

    def build_device(self, ctx: DeviceContext) -> DeviceMethod:
        """The device half for ``ctx`` (whose ``method_config`` holds these settings, or None for defaults)."""
        return self.device_half()(ctx)

    def build_strategy(self, settings: MethodSettings | Mapping[str, Any] | None, *, num_classes: int,
                       rounds: int) -> Strategy:
        """The coordinator half, from parsed settings or a ``[method]`` table."""
        if not isinstance(settings, MethodSettings):
            settings = self.parse(settings)
        return self.coordinator_half()(settings, num_classes=num_classes, rounds=rounds)


_E = "fedge.edge.methods."
_C = "fedge.coordinator.strategies."
METHODS: dict[str, MethodEntry] = {e.name: e for e in (
    MethodEntry(LocalSettings, _E + "local:LocalDevice", _C + "local:LocalStrategy"),
    MethodEntry(FedAvgSettings, _E + "fedavg:FedAvgDevice", _C + "fedavg:FedAvgStrategy"),
    MethodEntry(LGFedAvgSettings, _E + "fedavg:LGFedAvgDevice", _C + "fedavg:LGFedAvgStrategy"),
    MethodEntry(FedProtoSettings, _E + "fedproto:FedProtoDevice", _C + "fedproto:FedProtoStrategy"),
    MethodEntry(GeFLSettings, _E + "gefl:GeFLDevice", _C + "gefl:GeFLStrategy"),
    MethodEntry(GeFLFSettings, _E + "geflf:GeFLFDevice", _C + "geflf:GeFLFStrategy"),
    MethodEntry(FedVTCSettings, _E + "fedvtc:FedVTCDevice", _C + "fedvtc:FedVTCStrategy"),
)}

BUILTIN_SETTINGS: tuple[type[MethodSettings], ...] = tuple(e.settings for e in METHODS.values())
"""The settings class of every method fedge ships, in registry order: read off :data:`METHODS` as
written above, so a method is listed by its registry line alone (a method added later with
:func:`register_method` is not in it). The docs' key tables and the tests iterate over it."""


def register_method(entry: MethodEntry) -> MethodEntry:
    """Add a method (e.g. one defined outside fedge) under its settings' name."""
    if entry.name in METHODS:
        raise ConfigError(f"method {entry.name!r} is already registered")
    METHODS[entry.name] = entry
    return entry


def method_entry(name: str) -> MethodEntry:
    """The registry line of method ``name``; an unknown name is a :class:`ConfigError` naming the known ones."""
    if name not in METHODS:
        close = difflib.get_close_matches(name, METHODS, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown method {name!r}", hint=f"{guess}use one of {', '.join(sorted(METHODS))}")
    return METHODS[name]
