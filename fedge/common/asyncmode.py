"""Asynchronous buffered aggregation: ``[coordinator] mode = "async"`` and its settings (issue 27, item 2).

In asynchronous mode the coordinator's "round" is the **global version**: devices train from the latest
version, each update carries the version it trained from (its ``round``), and every ``buffer_size`` (K)
accepted updates make a new version. An update's **staleness** is the version being built minus the version
it trained from; one staler than ``max_staleness`` is refused (reason ``stale``), and the others count with a
staleness weight:

* ``constant``: 1 (FedBuff's default);
* ``polynomial``: ``(1 + s) ** -staleness_exponent`` (FedAsync's polynomial; FedBuff's ``1/sqrt(1 + s)`` is
  exponent 0.5, the default);
* ``hinge``: 1 up to ``hinge_b``, then ``1 / (hinge_a × (s − hinge_b) + 1)`` (FedAsync's hinge).

``concurrency`` devices train at once (default: every device of the fleet). Shared by the fleet config
(checked when it loads) and the coordinator: plain Python, no torch. docs/async.md has the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.errors import ConfigError

MODES = ("sync", "async")
WEIGHTS: dict[str, str] = {
    "constant": "every accepted update counts fully (FedBuff)",
    "polynomial": "(1 + staleness) ** -staleness_exponent (FedAsync; FedBuff's 1/sqrt(1+s) is exponent 0.5)",
    "hinge": "1 up to hinge_b, then 1 / (hinge_a * (staleness - hinge_b) + 1) (FedAsync)",
}
ASYNC_KEYS = ("buffer_size", "max_staleness", "staleness_weight", "staleness_exponent", "hinge_a", "hinge_b",
              "concurrency")


@dataclass(frozen=True)
class AsyncSettings:
    """``[coordinator] mode = "async"``: buffer size K, staleness bound and weight, concurrency."""

    buffer_size: int = 10  # the fleet config's default: min(10, concurrency)
    max_staleness: int = 10
    staleness_weight: str = "polynomial"
    staleness_exponent: float = 0.5
    hinge_a: float = 10.0
    hinge_b: float = 4.0
    concurrency: int = 0  # 0: every device of the fleet
    thermal_guard: bool = False  # a hot idle device gets no task until it has cooled (fedge.common.heat)
    fleet_size: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        def whole(key: str, low: int) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"[coordinator] {key} = {v!r}: must be an integer >= {low}",
                                  hint=ASYNC_HINTS[key])

        if not isinstance(self.thermal_guard, bool):
            raise ConfigError(f"[coordinator] thermal_guard = {self.thermal_guard!r}: must be true or false",
                              hint="thermal_guard = true: a hot device gets no task until it has cooled")
        whole("buffer_size", 1)
        whole("max_staleness", 0)
        whole("concurrency", 0)
        n = self.fleet_size
        if n and self.concurrency > n:
            raise ConfigError(f"[coordinator] concurrency = {self.concurrency}: more than the fleet's {n} devices",
                              hint=f"at most {n}, or 0 (every device)")
        if n and self.buffer_size > n:
            raise ConfigError(f"[coordinator] buffer_size = {self.buffer_size}: more than the fleet's {n} devices",
                              hint=f"buffer_size at most {n} (K = {n} with concurrency = {n} is a synchronous round)")
        if self.concurrency and self.buffer_size > self.concurrency:
            raise ConfigError(f"[coordinator] buffer_size = {self.buffer_size} > concurrency = {self.concurrency}: "
                              "a version could never fill its buffer", hint="buffer_size <= concurrency")
        if self.staleness_weight not in WEIGHTS:
            raise ConfigError(f"[coordinator] staleness_weight = {self.staleness_weight!r}: unknown weight function",
                              hint="use " + "; ".join(f"{k!r} ({v})" for k, v in WEIGHTS.items()))
        for key in ("staleness_exponent", "hinge_a", "hinge_b"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"[coordinator] {key} = {v!r}: must be a number >= 0", hint=ASYNC_HINTS[key])

    @property
    def concurrent_devices(self) -> int:
        """Devices training at once (``concurrency``, else every device; "workers" are aggregation workers)."""
        return self.concurrency or self.fleet_size

    def weight(self, staleness: int) -> float:
        """The weight of an update ``staleness`` versions old (1 when fresh, whatever the function)."""
        s = max(0, staleness)
        if self.staleness_weight == "polynomial":
            return float((1.0 + s) ** -self.staleness_exponent)
        if self.staleness_weight == "hinge":
            return 1.0 if s <= self.hinge_b else 1.0 / (self.hinge_a * (s - self.hinge_b) + 1.0)
        return 1.0

    def choose(self, version: int, idle: list[str], k: int) -> list[str]:
        """``k`` of the ``idle`` online devices to start training from ``version``: seeded, deterministic in
        (seed, version, the candidates), least recently started first is the caller's order to keep."""
        if k >= len(idle):
            return sorted(idle)
        rng = np.random.default_rng([self.seed & 0xFFFF_FFFF, version, 0xA5C])
        pool = sorted(idle)
        return sorted(pool[i] for i in rng.choice(len(pool), size=k, replace=False))


ASYNC_HINTS = {
    "buffer_size": "buffer_size = K: updates per new global version, e.g. 10",
    "max_staleness": "max_staleness: versions an update may lag behind, e.g. 10 (0: fresh updates only)",
    "concurrency": "concurrency: devices training at once, e.g. 30 (0: every device)",
    "staleness_exponent": "polynomial exponent a in (1 + s) ** -a, e.g. 0.5",
    "hinge_a": "hinge slope a, e.g. 10",
    "hinge_b": "hinge knee b (versions of full weight), e.g. 4",
}


def parse_async(table: Mapping[str, Any], *, fleet_size: int, seed: int, source: str = "",
                refusal: str | None = None, method: str = "") -> AsyncSettings | None:
    """The ``mode`` and asynchronous keys of a ``[coordinator]`` table (None: synchronous rounds).

    ``refusal`` is the run's method's reason it cannot run asynchronously (None: it can).
    """
    where = f"{source}: " if source else ""
    mode = table.get("mode", "sync")
    if mode not in MODES:
        raise ConfigError(f"{where}[coordinator] mode = {mode!r}: unknown mode", hint='use "sync" or "async"')
    given = [k for k in ASYNC_KEYS if k in table]
    if mode == "sync":
        if given:
            raise ConfigError(f"{where}[coordinator] {given[0]} is a setting of asynchronous mode",
                              hint='add mode = "async", or drop ' + ", ".join(given))
        return None
    if refusal is not None:
        raise ConfigError(f"{where}[coordinator] mode = \"async\" cannot run {method}: {refusal}",
                          hint='drop mode = "async" (synchronous rounds), or choose a method docs/async.md lists')
    if "sample" in table:
        raise ConfigError(f"{where}[coordinator] sample is for synchronous rounds; async mode has concurrency",
                          hint="drop sample and selection; set concurrency = devices training at once")
    values = {k: table[k] for k in given}
    if table.get("thermal_guard") is not None:  # a key of the utility selections too (fedge.common.sampling)
        values["thermal_guard"] = table["thermal_guard"]
    if "buffer_size" not in values:  # FedBuff's K = 10, or every device training at once in a smaller fleet
        at_once = values.get("concurrency") or fleet_size
        values["buffer_size"] = min(10, at_once, fleet_size or at_once) if isinstance(at_once, int) and at_once > 0 \
            else 10
    try:
        return AsyncSettings(**values, fleet_size=fleet_size, seed=seed)
    except ConfigError as exc:
        raise ConfigError(where + exc.message, hint=exc.hint) from exc
    except TypeError as exc:  # a wrong type the checks above did not catch
        raise ConfigError(f"{where}[coordinator] async settings: {exc}", hint="see docs/async.md") from exc


def refuse_in_parts(settings: AsyncSettings | None, what: str, *, source: str = "") -> None:
    """A :class:`ConfigError` when asynchronous mode (``settings``) would run with aggregation workers or relays
    (``what``: the flag or command that asks for them); nothing for synchronous rounds.

    Workers and relays send one partial sum of a round's updates; a version takes the first ``buffer_size``
    updates from devices training from any of the last ``max_staleness`` versions, weighs each by its own
    staleness, checks it against the task its device holds and persists it before it counts, so that a restart
    loses none. A sum cannot be taken apart into those updates, so the two do not compose (docs/async.md).
    """
    if settings is None:
        return
    where = f"{source}: " if source else ""
    raise ConfigError(
        f'{where}[coordinator] mode = "async" cannot run with {what}: aggregation workers and relays send one sum '
        "per round, while an asynchronous version takes the first buffer_size updates from devices training from "
        "different versions, each weighed by its own staleness and persisted before it counts",
        hint='run the asynchronous fleet with one coordinator (no --workers, no --shards, no relays), or drop '
             'mode = "async" from [coordinator] to aggregate synchronous rounds in parts (docs/async.md)')
