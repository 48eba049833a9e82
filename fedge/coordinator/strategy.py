"""The coordinator half of a method."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedge.common.asyncmode import AsyncSettings
from fedge.common.rounds import TRAIN_PHASE, DeviceInfo
from fedge.common.settings import MethodName, MethodSettings
from fedge.coordinator.accumulators import Aggregation
from fedge.errors import ConfigError

Arrays = dict[str, np.ndarray]


class JsonDoc(dict[str, Any]):
    """A JSON object in a :meth:`Strategy.state_dict` that does not change once made: its text is encoded once,
    and the engine's store writes that text into every checkpoint (``fedge.coordinator.store``)."""

    @property
    def text(self) -> str:
        """The object's JSON text, compact (made on first use)."""
        cached: str | None = self.__dict__.get("_text")
        if cached is None:
            cached = self.__dict__["_text"] = json.dumps(self, separators=(",", ":"), allow_nan=False)
        return cached

    def preset(self, text: str) -> None:
        """Give the object's JSON text, made by whoever made the object (it must encode the same object)."""
        self.__dict__["_text"] = text


class LogDoc(dict[str, Any]):
    """A JSON object in a :meth:`Strategy.state_dict` that changes a few keys at a time: the engine's store keeps
    it in an append-only log beside ``state.json`` and appends only the keys set or deleted since the last
    checkpoint (``fedge.coordinator.statelog``), so a checkpoint costs what changed, not the whole object.

    Hand out the same object from every ``state_dict`` call (a new object is written whole, once). Only item
    assignment and ``del`` are tracked; values are JSON-able (a :class:`JsonDoc` is written as its kept text).
    A restarted coordinator gets a plain ``dict`` back in ``load_state_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.changed: set[str] = set()  # keys set or deleted since the store last wrote them

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.changed.add(key)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.changed.add(key)


# name -> (shape, dtype kind) where kind is "float" or "int"
UpdateSpec = dict[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Contribution:
    """How one update counts, handed to :meth:`Strategy.accumulate` by the round loop (never set from outside):
    ``weight`` is its staleness weight (asynchronous mode: ``AsyncSettings.weight`` of its staleness; 1 when
    fresh) and ``version`` the global version it trained from (its round)."""

    weight: float = 1.0
    version: int = 0


FRESH = Contribution()
"""A synchronous round's update: full weight."""


class Strategy(ABC):
    """Aggregates device updates into global artifacts, one round at a time.

    The engine calls :meth:`begin_round`, then :meth:`accumulate` once per valid
    update as it arrives (streaming: strategies keep running sums, not updates),
    then :meth:`finish_round`, whose artifacts are published for the next round.
    """

    name = MethodName()  # the [run] method name, read from settings_type (written once, there)
    settings_type: ClassVar[type[MethodSettings]]  # the method's [method] descriptor
    settings: MethodSettings  # subclasses narrow the type
    # How updates are combined; the engine sets its EngineConfig's. Strategies create their
    # accumulators from it (fedge.coordinator.accumulators.mean / GroupedMean / ClassMean).
    aggregation: Aggregation = Aggregation()
    # Asynchronous mode (docs/async.md): the engine sets ``asynchronous`` (its AsyncSettings; None: synchronous
    # rounds), and hands each accumulate the update's staleness weight and the version it trained from (a
    # Contribution). A round is then a version: weights are averaged over the buffer with these weights;
    # statistics are running aggregates over every device's latest upload (fedge.coordinator.strategies.fedproto).
    asynchronous: AsyncSettings | None = None
    # The attributes that hold the round's accumulators (WeightedMean, RobustMean, GroupedMean,
    # ClassMean; set by begin_round) when they are the strategy's *only* per-round state: then a
    # round can be aggregated in parts (aggregation workers, relays) and merged exactly
    # (fedge.coordinator.partial). None: this method's coordinator half cannot be split.
    partial_fields: ClassVar[tuple[str, ...] | None] = None
    # Secure aggregation ([privacy] secure_aggregation, fedge.secagg): when set, the round's updates carry metrics
    # only (the engine does not call accumulate) and each group's unmasked sum arrives in accumulate_group_sum.
    secure_sums: bool = False

    def __init__(self, settings: MethodSettings | None = None, *, num_classes: int, rounds: int) -> None:
        self.settings = self.settings_type.given(settings, type(self).__name__)
        self.num_classes = num_classes
        self.rounds = rounds

    def total_rounds(self) -> int:
        """Training rounds (the final evaluation round comes after these)."""
        return self.rounds

    def phase(self, rnd: int) -> str:
        """Phase name of training round ``rnd`` (1-based)."""
        return TRAIN_PHASE

    def round_config(self, rnd: int) -> dict[str, Any]:
        """Method-specific settings announced with round ``rnd``."""
        return {}

    def begin_round(self, rnd: int) -> None:  # noqa: B027
        """Reset per-round accumulators."""

    @abstractmethod
    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        """Fold one validated update into the running aggregate; ``at``: how much it counts (its staleness weight
        in asynchronous mode, and the version it trained from; :data:`FRESH` in a synchronous round)."""

    def accumulate_group_sum(self, group: str, sums: Arrays) -> None:
        """Fold in one group's secure sum: the terms of :mod:`fedge.secagg.terms` summed over the devices whose
        masked input arrived. The one place a strategy receives what secure aggregation unmasks."""
        raise ConfigError(f"method {self.name!r} cannot aggregate secure sums",
                          hint="leave [privacy] secure_aggregation out for this method (docs/security.md)")

    @abstractmethod
    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        """Artifacts changed by this round (name -> arrays)."""

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        """Exact tensor names/shapes this device must upload in ``rnd`` (None: unchecked)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state beyond the published artifacts (for coordinator restarts)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore :meth:`state_dict`."""

