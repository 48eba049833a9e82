"""What the fleet monitor keeps (:mod:`fedge.observe.monitor`): one :class:`DeviceState` per device, one
:class:`RoundSummary` per finished round, and :func:`device_state`, a device's state in one word."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fedge.common.health import HealthRecord

UNKNOWN = "?"  # a refusal's sender that is not a device of the fleet; a device's profile not known

@dataclass
class DeviceState:
    """What the monitor knows about one device."""

    device_id: str
    profile: str = ""
    arch: str = ""
    in_fleet: bool = True  # listed in the fleet config (else: registered with --any-device)
    registered: bool = False
    health: HealthRecord | None = None
    health_at: float = 0.0  # coordinator's clock when the last accepted heartbeat arrived
    health_refused: Counter[str] = field(default_factory=Counter)
    refusal: tuple[str, str, float] | None = None  # latest refused hello: (reason, message, when)
    refused: Counter[str] = field(default_factory=Counter)  # reason -> messages, from the round reports
    accepted: int = 0
    last_round: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    acc_global: float | None = None
    acc_local: float | None = None
    missed: int = 0  # rounds it was expected in and did not answer


@dataclass
class RoundSummary:
    """One finished round as the dashboard draws it."""

    round: int
    phase: str
    seconds: float
    aggregation_s: float
    accepted: int
    missing: list[str]
    rejected: dict[str, int]
    # profile -> {"n", "acc_sum", "acc_n", "acc_min", "acc_max", "bytes_up", "bytes_down"}
    profiles: dict[str, dict[str, float]]
    acc: dict[str, float] | None  # device -> acc_global (only for small fleets)
    bytes_up: dict[str, int] | None
    bytes_down: dict[str, int] | None
    finished: float = 0.0  # unix seconds (0: unknown, after the fact)
    # asynchronous mode: the mean and largest staleness of the version's updates (None: synchronous rounds)
    staleness_mean: float | None = None
    staleness_max: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def device_state(d: DeviceState, status: tuple[bool, float] | None, live: bool) -> str:
    """online | offline | refused | no hello, or after the fact (``live`` False) registered | no hello."""
    if d.refusal is not None and not d.registered:
        return "refused"
    if not live:
        return "registered" if d.registered else "no hello"
    if status is not None:
        return "online" if status[0] else "offline"
    return "online" if d.registered else "no hello"
