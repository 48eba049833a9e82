"""The fleet config's ``[coordinator]`` table as one typed object, parsed once when the config loads.

:class:`CoordinatorSection` holds every key of the table, typed: an unknown key is refused with the closest
known one (as every table of the fleet config is, :func:`fedge.common.tomlconf.build`), and every value is
range-checked in ``__post_init__``. What depends on the rest of the fleet config (its size, its seed, its
method) is resolved by :meth:`CoordinatorSection.resolve` into two typed nested fields, ``sampling``
(:mod:`fedge.common.sampling`) and ``asynchronous`` (:mod:`fedge.common.asyncmode`); ``aggregation_rule()``
is the typed :class:`Aggregation`. ``fedge.coordinator.config.engine_config`` builds the round engine's
configuration from it, for ``fedge coordinator run`` and ``fedge simulate`` alike.

Plain Python (the fleet config, the coordinator and the simulator read it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fedge.common.asyncmode import ASYNC_HINTS, ASYNC_KEYS, MODES, AsyncSettings, parse_async
from fedge.common.sampling import SAMPLING_KEYS, Sampling, parse_sampling
from fedge.errors import ConfigError

RULES: tuple[str, ...] = ("mean", "trimmed", "median")


@dataclass(frozen=True)
class Aggregation:
    """How a round's updates are combined (``[coordinator] aggregation``, ``trim``, ``clip``)."""

    rule: str = "mean"  # one of RULES
    trim: float = 0.2  # trimmed: fraction of the devices cut at each end of every coordinate
    clip: float = 0.0  # > 0: clip each update's distance from the median to clip x the median distance

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"unknown aggregation {self.rule!r}", hint=f"use one of {', '.join(RULES)}")
        if not 0 <= self.trim < 0.5:
            raise ConfigError(f"trim must be in [0, 0.5), got {self.trim}")
        if not 0 <= self.clip < math.inf:
            raise ConfigError(f"clip must be >= 0 (0: off), got {self.clip}")

    @property
    def robust(self) -> bool:
        """Whether updates must be kept until the round ends (anything but a plain mean)."""
        return self.rule != "mean" or self.clip > 0


_FLAGS = {"deadline_slack": "deadline-slack", "round_timeout_s": "round-timeout", "min_round_s": "min-round",
          "max_round_s": "max-round", "min_devices": "min-devices", "quorum": "quorum",
          "quorum_timeout_s": "quorum-timeout"}
_HINTS = {
    "quorum_timeout_s": "seconds to wait for the quorum before giving up, e.g. 600",
    "deadline_slack": "round deadline = slack x the slowest expected device's round time, e.g. 2 (0: off)",
    "round_timeout_s": "budget of a round with a device of unknown speed, e.g. 300 (0: wait for it)",
    "min_round_s": "the shortest deadline, e.g. 5",
    "max_round_s": "the longest deadline, e.g. 3600 (0: no bound)",
}
_KEY_HINTS = {
    **ASYNC_HINTS, **_HINTS,
    "aggregation": "one of mean, trimmed, median", "trim": "trimmed: fraction cut at each end, e.g. 0.2",
    "clip": "clip factor x the median distance, e.g. 2.0 (0: off)", "min_devices": "a device count, e.g. 1",
    "quorum": "a fraction of the fleet, e.g. 0.8", "max_update_bytes": "bytes, e.g. 67108864 (64 MiB)",
    "selection": "one of uniform, available, balanced, oort, energy", "mode": '"sync" or "async"',
    "explore": "oort / energy: the share of slots for untried devices, e.g. 0.2",
    "preferred_round_s": "oort: the preferred round duration in seconds (0: the median task time)",
    "straggler_penalty": "oort: the exponent α of the penalty (T / t) ** α, e.g. 2",
    "thermal_guard": "oort / energy, or async mode: true to give a hot device no task until it cools",
    "staleness_weight": "one of constant, polynomial, hinge",
}


# The keys that say how long a coordinator waits for real devices, in wall-clock seconds (or devices): what
# ``fedge coordinator run`` schedules by, and what a simulation cannot apply (see ``refuse_in_simulation``).
DEADLINE_KEYS = ("deadline_slack", "round_timeout_s", "min_round_s", "max_round_s")
QUORUM_KEYS = ("min_devices", "quorum", "quorum_timeout_s")


@dataclass(frozen=True)
class CoordinatorSection:
    """The fleet config's ``[coordinator]`` table; ``fedge coordinator run`` flags override it (:meth:`override`).

    Unset scheduling keys (None) fall back to the command's defaults. Example::

        [coordinator]
        aggregation = "trimmed"   # mean | trimmed | median
        trim = 0.2                # trimmed: fraction of the devices cut at each end of every coordinate
        clip = 2.0                # clip each update to 2 x the median distance from the median (0: off)
        quorum = 0.8
        deadline_slack = 3.0
    """

    # how updates are combined (fedavg, lgfedavg and fedproto; the generative methods always average)
    aggregation: str = "mean"
    trim: float = 0.2
    clip: float = 0.0
    # how long `fedge coordinator run` waits for devices (None: its defaults; fedge simulate refuses them)
    min_devices: int | None = None
    quorum: float | None = None
    quorum_timeout_s: float | None = None
    deadline_slack: float | None = None
    round_timeout_s: float | None = None
    min_round_s: float | None = None
    max_round_s: float | None = None
    max_update_bytes: int | None = None
    # client sampling (fedge.common.sampling)
    sample: Any = None  # a count (int) or a fraction (float): Sampling checks it, with a hint for each
    selection: str | None = None
    # selection = "oort" / "energy" (fedge.common.selection)
    explore: float | None = None
    preferred_round_s: float | None = None
    straggler_penalty: float | None = None
    thermal_guard: bool | None = None
    # asynchronous mode (fedge.common.asyncmode)
    mode: str = "sync"
    buffer_size: int | None = None
    max_staleness: int | None = None
    staleness_weight: str | None = None
    staleness_exponent: float | None = None
    hinge_a: float | None = None
    hinge_b: float | None = None
    concurrency: int | None = None
    KEY_HINTS: ClassVar[dict[str, str]] = _KEY_HINTS  # what each key means, for a value of the wrong type
    # Resolved against the rest of the fleet config (:meth:`resolve`), never keys of the table.
    sampling: Sampling | None = field(default=None, init=False, compare=False)
    asynchronous: AsyncSettings | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        self.aggregation_rule()  # an unknown rule, a trim outside [0, 0.5) or a negative clip fails here
        if self.min_devices is not None and self.min_devices < 0:
            raise ConfigError(f"min_devices = {self.min_devices}: must be >= 0",
                              hint="devices online before a round starts, e.g. 1")
        if self.quorum is not None and not 0 <= self.quorum <= 1:
            raise ConfigError(f"quorum = {self.quorum:g}: must be a fraction in [0, 1]",
                              hint="e.g. quorum = 0.8: 80 % of the fleet's devices online before a round starts")
        for key in ("quorum_timeout_s", "deadline_slack", "round_timeout_s", "min_round_s", "max_round_s"):
            v = getattr(self, key)
            if v is not None and not 0 <= v < math.inf:
                raise ConfigError(f"{key} = {v:g}: must be a finite number >= 0", hint=_HINTS[key])
        if self.min_round_s and self.max_round_s and self.min_round_s > self.max_round_s:
            raise ConfigError(f"min_round_s = {self.min_round_s:g} > max_round_s = {self.max_round_s:g}",
                              hint="the shortest deadline must not exceed the longest")
        if self.max_update_bytes is not None and self.max_update_bytes < 1:
            raise ConfigError(f"max_update_bytes = {self.max_update_bytes}: must be >= 1",
                              hint="the largest update accepted, in bytes, e.g. 67108864 (64 MiB)")
        if self.mode not in MODES:
            raise ConfigError(f"mode = {self.mode!r}: unknown mode", hint='use "sync" or "async"')

    def aggregation_rule(self) -> Aggregation:
        """The :class:`Aggregation` this table selects (validated)."""
        return Aggregation(self.aggregation, self.trim, self.clip)

    def given(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """The keys of ``keys`` the table sets (a key left out is None, or ``mode``'s "sync")."""
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def resolve(self, *, fleet_size: int, seed: int, async_refusal: str | None, method: str) -> CoordinatorSection:
        """This table with ``sampling`` and ``asynchronous`` resolved against the fleet (its size and seed) and
        its method (``async_refusal``: why the method cannot run asynchronously, None if it can)."""
        table: dict[str, Any] = {"mode": self.mode, **self.given(SAMPLING_KEYS + ASYNC_KEYS)}
        out = dataclasses.replace(self)
        object.__setattr__(out, "sampling", parse_sampling(table, fleet_size=fleet_size, seed=seed))
        object.__setattr__(out, "asynchronous", parse_async(table, fleet_size=fleet_size, seed=seed,
                                                            refusal=async_refusal, method=method))
        return out

    def override(self, **values: object) -> CoordinatorSection:
        """This table with the scheduling or aggregation keys in ``values`` replaced (command-line flags),
        checked again; ``sampling`` and ``asynchronous`` stay as resolved."""
        unknown = sorted(set(values) - set(DEADLINE_KEYS + QUORUM_KEYS + ("max_update_bytes", "aggregation",
                                                                            "trim", "clip")))
        if unknown:
            raise ValueError(f"not a flag-overridable [coordinator] key: {unknown}")
        out = dataclasses.replace(self, **values)  # type: ignore[arg-type]
        object.__setattr__(out, "sampling", self.sampling)
        object.__setattr__(out, "asynchronous", self.asynchronous)
        return out

    def refuse_in_simulation(self, source: str = "") -> None:
        """A :class:`ConfigError` naming why, when the table sets a key a simulation cannot apply.

        ``fedge simulate`` steps its devices on the virtual clock (``[clock]``): every device says hello before
        round 1, ``[clock] availability`` says who is online, and ``[clock] deadline_s`` is a round's deadline
        in virtual seconds. The deadline and quorum keys are wall-clock waits for real devices: applied to a
        simulation, the simulating host's speed would decide which updates count.
        """
        where = f"{source}: " if source else ""
        for keys, why, fix in (
            (DEADLINE_KEYS, "fedge simulate runs rounds on the virtual clock, whose deadline is [clock] deadline_s; "
                            "deadline_slack, round_timeout_s, min_round_s and max_round_s are wall-clock seconds of a "
                            "coordinator waiting for real devices, and in a simulation the simulating host's speed "
                            "would decide which updates count",
             "set [clock] deadline_s for a deadline in virtual seconds"),
            (QUORUM_KEYS, "in fedge simulate every device says hello before round 1 and [clock] availability decides "
                          "who is online each round; min_devices, quorum and quorum_timeout_s are how long a "
                          "coordinator waits for real devices to connect",
             "set [clock] availability to simulate devices that come and go")):
            given = self.given(keys)
            if given:
                key, value = next(iter(given.items()))
                raise ConfigError(f"{where}[coordinator] {key} = {value}: {why}",
                                  hint=f"{fix}; to keep one fleet config for both, pass --{_FLAGS[key]} to fedge "
                                       f"coordinator run instead of setting {key} here")
