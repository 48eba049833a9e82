"""What the coordinator waits for, in words: the fleet's hellos, a quorum, or a round's (a version's) updates,
and for each device not there yet why — offline, refused and the reason, no hello yet, no update yet.

Pure functions of a :class:`WaitState` (what the fleet monitor last heard from the engine, copied under its lock)
and the monitor's device records; :mod:`fedge.observe.monitor` logs the line and the page shows the rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from fedge.common.rounds import RoundInfo
from fedge.observe.fleetrecords import DeviceState

NAMES_IN_A_LINE = 10  # devices a "waiting for" line names before "and N more"

Statuses = Mapping[str, tuple[bool, float]]  # device -> (online, since: unix seconds), as the transport heard
Waiting = tuple[str, list[tuple[str, str]]]  # (what the coordinator waits for, [(device, why)])


@dataclass(frozen=True)
class WaitState:
    """What the engine is doing, as the monitor heard it: ``state`` (starting | fleet | quorum | round | between
    | finished), the round announced and when, the devices it still waits for, and what the waits want."""

    state: str
    current: RoundInfo | None = None
    round_started_at: float = 0.0
    pending: tuple[str, ...] = ()  # sorted
    expected: int = 0
    buffer_size: int = 0  # asynchronous mode: updates per version (0: not known)
    fleet_wanted: tuple[str, ...] = ()
    quorum_need: int = 0
    wait_until: float = 0.0


def why(device_id: str, devices: Mapping[str, DeviceState], state: str, statuses: Statuses, now: float) -> str:
    """In words: why a device has not answered (for the log line and the page)."""
    dev = devices.get(device_id)
    status = statuses.get(device_id)
    if dev is not None and dev.refusal is not None and not dev.registered:
        return f"refused: {dev.refusal[0]}: {dev.refusal[1]}"
    if status is not None and not status[0]:
        return f"offline for {now - status[1]:.0f} s"
    if dev is None or not dev.registered:
        return "no hello yet" if status is None else "online, no valid hello yet"
    if state == "round":
        return "no update yet"
    return "not online" if status is None else "online"


def waiting(w: WaitState, devices: Mapping[str, DeviceState], statuses: Statuses, now: float) -> Waiting | None:
    """(what the coordinator waits for, [(device, why)]) while it waits for devices; None otherwise."""
    def rows(ids: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
        return [(d, why(d, devices, w.state, statuses, now)) for d in ids]

    if w.state == "round" and w.current is not None:
        info = w.current
        if not w.pending:
            return None
        left = f", deadline in {max(0.0, info.deadline - now):.0f} s" if info.deadline else ""
        since = now - w.round_started_at
        if info.assigned is not None:  # a version: the first K of the devices training make it
            k = f"the {w.buffer_size} updates of " if w.buffer_size else "updates for "
            head = f"version {info.round} ({info.phase}): waiting for {k}{len(w.pending)} devices training, "
        else:
            head = f"round {info.round} ({info.phase}): waiting for {len(w.pending)} of {w.expected} devices "
        return f"{head}after {since:.0f} s{left}", rows(w.pending)
    if w.state == "fleet":
        missing = [d for d in w.fleet_wanted if not devices.get(d, DeviceState(d)).registered]
        if not missing:
            return None
        return (f"waiting for hellos from {len(missing)} of {len(w.fleet_wanted)} devices "
                f"(up to {max(0.0, w.wait_until - now):.0f} s more)"), rows(missing)
    if w.state == "quorum":
        online = [d for d, s in devices.items() if s.registered and statuses.get(d, (True, 0))[0]]
        if len(online) >= w.quorum_need:
            return None
        absent = sorted(d for d, s in devices.items() if s.in_fleet and d not in online)
        return (f"waiting for a quorum of {w.quorum_need} devices ({len(online)} online; gives up in "
                f"{max(0.0, w.wait_until - now):.0f} s)"), rows(absent)
    return None


def waiting_line(state: str, got: Waiting | None) -> tuple[int, str] | None:
    """(log level, the line) saying what the coordinator waits for (``got``: :func:`waiting`), or None when it
    waits for nobody. WARNING when something is wrong (a device refused or offline, a quorum or the fleet's hellos
    missing), INFO for a round whose devices are still training."""
    if got is None:
        return None
    head, rows = got
    shown = "; ".join(f"{d} ({reason})" for d, reason in rows[:NAMES_IN_A_LINE])
    more = f"; and {len(rows) - NAMES_IN_A_LINE} more" if len(rows) > NAMES_IN_A_LINE else ""
    alarming = state != "round" or any(not reason.startswith("no update") for _, reason in rows)
    return (logging.WARNING if alarming else logging.INFO), f"{head}: {shown}{more}"
