"""Coordinator halves of every method, by name."""

from __future__ import annotations

from fedge.coordinator.strategies.baselines import (
    FedAvgStrategy,
    FedProtoStrategy,
    LGFedAvgStrategy,
    LocalStrategy,
)
from fedge.coordinator.strategies.fedvtc import FedVTCStrategy
from fedge.coordinator.strategies.gefl import GeFLStrategy
from fedge.coordinator.strategies.geflf import GeFLFStrategy
from fedge.coordinator.strategy import Strategy
from fedge.errors import ConfigError

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (LocalStrategy, FedAvgStrategy, LGFedAvgStrategy, FedProtoStrategy, GeFLStrategy, GeFLFStrategy,
                FedVTCStrategy)
}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a coordinator half available by its ``name``."""
    STRATEGIES[cls.name] = cls
    return cls


def strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown method {name!r}", hint=f"use one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "Strategy", "register_strategy", "strategy"]
