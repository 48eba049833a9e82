"""A device's health record: what it says about itself on every heartbeat, and the check it must pass.

The device publishes a ``health`` message (envelope ``kind`` = ``health``, ``round`` = its last
round, no tensors) whose ``info.health`` is one flat JSON object of the fields below. Both halves
read the schema from here: the device fills it (:mod:`fedge.edge.health`), the coordinator checks
it with :func:`parse_health` before anything else reads it — exact field names, types and ranges,
no nesting — because it is device input like any other: a record with a wrong type, a NaN, a huge
value or a nested object is refused (reason ``health-malformed``) and counted, never stored.

Every measurement may be ``null``: a machine that cannot tell (no thermal zone, no Pi firmware,
not Linux) says so instead of inventing a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedge.errors import PayloadError

HEALTH_KIND = "health"
HEARTBEAT_S = 10.0
"""A device's heartbeat interval by default (``fedge edge run --heartbeat``)."""
MAX_HEALTH_BYTES = 8 * 1024  # a whole health message; a record is ~600 bytes
MAX_TEXT = 256  # characters of last_error (longer ones are cut by the device, refused here)
MAX_NAME = 64  # characters of fedge_version and model

_BIG = 1 << 53  # integers beyond this lose precision in JSON readers (and no gauge needs them)

# field -> (kind, lower bound, upper bound, may be null). Kinds: "int" (not bool), "float" (int or
# float, finite), "text" (string of at most the upper bound's characters).
FIELDS: dict[str, tuple[str, float, float, bool]] = {
    "seq": ("int", 0, _BIG, False),  # heartbeat number since the agent started
    "sent": ("float", 0, 1e11, False),  # the device's clock, unix seconds (shown beside the coordinator's)
    "uptime_s": ("float", 0, 1e10, True),  # since the machine booted
    "agent_uptime_s": ("float", 0, 1e10, False),  # since the agent started
    "rss_bytes": ("int", 0, 1 << 50, True),  # the agent process's resident memory
    "mem_total_bytes": ("int", 0, 1 << 50, True),  # RAM it may use: MemTotal, or its cgroup's limit if lower
    "mem_available_bytes": ("int", 0, 1 << 50, True),  # what is left of that
    "cpu_percent": ("float", 0, 102400, True),  # the agent's CPU since the last heartbeat (100 = one core)
    "cpu_count": ("int", 1, 4096, True),
    "cpu_temp_c": ("float", -100, 200, True),  # hottest CPU thermal zone
    "cpu_mhz": ("float", 0, 100000, True),  # current clock of CPU 0 ...
    "cpu_max_mhz": ("float", 0, 100000, True),  # ... and its maximum (below it under load: throttled)
    "throttled": ("int", 0, (1 << 32) - 1, True),  # Raspberry Pi firmware flags (get_throttled)
    "disk_free_bytes": ("int", 0, _BIG, True),
    "fedge_version": ("text", 0, MAX_NAME, False),
    "model": ("text", 0, MAX_NAME, False),  # the device's architecture (e.g. tier-m)
    "model_round": ("int", 0, 1 << 31, False),  # round of the newest global state it applied (0: none)
    "last_round": ("int", 0, 1 << 31, False),  # the last round it uploaded
    "last_error": ("text", 0, MAX_TEXT, True),  # the last failure the agent logged (or its refusal)
}

# Raspberry Pi firmware throttle bits (vcgencmd get_throttled): "now" bits, then "since boot" bits.
THROTTLE_BITS: dict[int, str] = {
    0: "under-voltage", 1: "arm frequency capped", 2: "throttled", 3: "soft temperature limit",
    16: "under-voltage occurred", 17: "arm frequency capping occurred", 18: "throttling occurred",
    19: "soft temperature limit occurred",
}


class HealthError(PayloadError):
    """A health record was refused; ``reason`` is the counter key (``health-`` + it), ``message`` says why."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class HealthRecord:
    """One checked health record (see :data:`FIELDS` for units and meaning)."""

    seq: int
    sent: float
    agent_uptime_s: float
    fedge_version: str
    model: str
    model_round: int
    last_round: int
    uptime_s: float | None = None
    rss_bytes: int | None = None
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    cpu_percent: float | None = None
    cpu_count: int | None = None
    cpu_temp_c: float | None = None
    cpu_mhz: float | None = None
    cpu_max_mhz: float | None = None
    throttled: int | None = None
    disk_free_bytes: int | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)  # flat: asdict's deep copy costs 0.3 ms a record (0.3 s a page at N = 1000)

    def throttle_words(self) -> list[str]:
        """The Pi firmware's throttle flags in words (empty: none set, or not a Pi)."""
        if not self.throttled:
            return []
        return [name for bit, name in THROTTLE_BITS.items() if self.throttled >> bit & 1]


def check_field(name: str, value: object) -> object:
    """``value`` of field ``name`` checked against :data:`FIELDS` (a float field's int as a float); :class:`HealthError`
    (reason ``malformed`` or ``range``) otherwise."""
    kind, lo, hi, nullable = FIELDS[name]
    if value is None:
        if nullable:
            return None
        raise HealthError("malformed", f"{name} must not be null")
    if kind == "text":
        if not isinstance(value, str) or len(value) > hi:
            raise HealthError("malformed", f"{name} must be a string of at most {hi:.0f} characters")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HealthError("malformed", f"{name} must be a number, got {type(value).__name__}")
    if kind == "int" and not isinstance(value, int):
        raise HealthError("malformed", f"{name} must be an integer, got {str(value)[:24]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise HealthError("malformed", f"{name} must be finite")
    if not lo <= value <= hi:
        raise HealthError("range", f"{name} = {str(value)[:24]} is outside [{lo:g}, {hi:g}]")
    return float(value) if kind == "float" else value


def parse_health(raw: object) -> HealthRecord:
    """``info.health`` of a health message, every field's type and range checked; :class:`HealthError`
    (reason ``malformed`` or ``range``) otherwise. Measurements may be missing (they become null)."""
    if not isinstance(raw, dict):
        raise HealthError("malformed", f"info.health must be an object, got {type(raw).__name__}")
    unknown = sorted(str(k)[:40] for k in raw if k not in FIELDS)
    if unknown:
        raise HealthError("malformed", f"info.health has unknown fields {unknown[:5]}")
    required = [k for k, (_, _, _, nullable) in FIELDS.items() if not nullable and k not in raw]
    if required:
        raise HealthError("malformed", f"info.health lacks {', '.join(required)}")
    return HealthRecord(**{k: check_field(k, v) for k, v in raw.items()})  # type: ignore[arg-type]
