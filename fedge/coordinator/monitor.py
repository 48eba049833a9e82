"""The fleet as an operator sees it: each device's state, health and history, and what the coordinator waits for.

A :class:`FleetMonitor` watches a running engine (it is an :class:`~fedge.coordinator.observer.EngineObserver`)
and its transport: it drains the devices' heartbeats and checks each with
:func:`fedge.common.health.parse_health` (a bad one is refused, counted by reason and logged, never
stored), keeps one record per device of the fleet config, and per round the figures the dashboard
draws. Its thread also says what the coordinator waits for: every ``wait_log_s`` seconds while a round,
the quorum or the fleet's hellos are incomplete, one log line names the missing devices and why
(offline, refused and the reason, no hello yet, no update yet).

In asynchronous mode (``[coordinator] mode = "async"``, docs/async.md) a "round" is a global version: the view
says so (``mode``, ``unit``), the engine announces a version again whenever it hands out tasks (the version's
start time stays that of its first announcement), the devices it waits for are those training (holding a
task), and each finished version keeps the staleness of its updates.

The same view is built after the fact from a state directory (:func:`monitor_from_state_dir`), from
``reports.jsonl`` and ``state.json`` alone, so the dashboard shows a finished run with the numbers of
its reports. Everything is plain Python: no torch, no numpy, no paho.

Memory stays flat in the number of rounds and devices where it matters: per round the monitor keeps
per-profile sums; per-device series only for fleets of at most :data:`DEVICE_SERIES_LIMIT` devices
(a chart of more lines is unreadable anyway, the per-profile chart stands in).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.health import HEALTH_KIND, MAX_HEALTH_BYTES, HealthError, HealthRecord, parse_health
from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.common.transport import CoordinatorTransport, Inbound
from fedge.coordinator.gate import reason_of
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.report import RoundReport

log = logging.getLogger(__name__)

DEVICE_SERIES_LIMIT = 40  # per-device accuracy and traffic series are kept up to this fleet size
NAMES_IN_A_LINE = 10  # devices a "waiting for" line names before "and N more"
HEALTH_LOG_EVERY_S = 60.0  # a device's refused heartbeats are logged at most this often
UNKNOWN = "?"  # refusals whose sender is not a device of the fleet


@dataclass
class LogThrottle:
    """At most one log line every ``every_s`` seconds; the lines held back meanwhile are counted."""

    every_s: float = HEALTH_LOG_EVERY_S
    last: float = float("-inf")
    held: int = 0

    def allow(self, now: float) -> int | None:
        """None: hold this line back (counted); else how many were held back since the last line."""
        if now - self.last < self.every_s:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held


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
    health_log: LogThrottle = field(default_factory=LogThrottle)  # its refused heartbeats' log lines


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


class FleetMonitor(EngineObserver):
    """The fleet view of one coordinator (see the module docstring). Thread-safe: the engine's thread,
    the monitor's own thread and the web server's threads call it."""

    def __init__(self, *, fleet: str, method: str, total_rounds: int,
                 transport: CoordinatorTransport | None = None, fleet_devices: Mapping[str, DeviceInfo] | None = None,
                 run_id: str = "", wait_log_s: float = 30.0, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.time, live: bool = True, buffer_size: int = 0) -> None:
        self.fleet = fleet
        self.method = method
        self.total_rounds = total_rounds  # training rounds; the final round is total_rounds + 1
        self.transport = transport
        self.run_id = run_id
        self.wait_log_s = wait_log_s
        self.poll_s = poll_s
        self.clock = clock
        self.live = live
        # asynchronous mode: updates per version (K; 0: synchronous rounds, or not known). A descriptor that
        # assigns tasks or a report with staleness also marks the run asynchronous.
        self.buffer_size = buffer_size
        self.asynchronous = buffer_size > 0
        self.started = clock()
        self._lock = threading.RLock()
        self.devices: dict[str, DeviceState] = {}
        for dev_id, info in (fleet_devices or {}).items():
            self.devices[dev_id] = DeviceState(dev_id, info.profile, info.arch)
        self.series = len(self.devices) <= DEVICE_SERIES_LIMIT
        self.rounds: list[RoundSummary] = []
        self.health_refused: Counter[str] = Counter()  # reason -> heartbeats refused
        self.health_accepted = 0
        self._stranger_log = LogThrottle()  # refused heartbeats from senders outside the fleet, all together
        self.updates_refused: Counter[str] = Counter()  # reason -> messages, from the round reports
        self.updates_accepted = 0
        self.staleness: Counter[int] = Counter()  # asynchronous mode: staleness -> accepted updates (/metrics)
        self.bytes_up = 0
        self.bytes_down = 0
        self.completed = 0
        # what the engine is doing: starting | fleet | quorum | round | finished
        self.state = "starting"
        self.wait_until = 0.0
        self.quorum_need = 0
        self.fleet_wanted: list[str] = []
        self.current: RoundInfo | None = None
        self.round_started_at = 0.0
        self.expected: frozenset[str] = frozenset()
        self._pending: Collection[str] = ()
        self.round_hist: list[tuple[float, float]] = []  # (round seconds, aggregation seconds), for /metrics
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_wait_log = clock()
        self._connections = 0  # the transport's connections() at the last tick
        self.version = 0  # bumped by every change the page shows (lets a client skip an unchanged view)

    # -- the engine's hooks --------------------------------------------------------------
    def _device(self, device_id: str) -> DeviceState:
        dev = self.devices.get(device_id)
        if dev is None:
            dev = self.devices[device_id] = DeviceState(device_id, in_fleet=False)
            self.series = self.series and len(self.devices) <= DEVICE_SERIES_LIMIT
        return dev

    def fleet_wait(self, device_ids: Collection[str], until: float) -> None:
        with self._lock:
            self.state, self.fleet_wanted, self.wait_until = "fleet", list(device_ids), until
            self.version += 1

    def quorum_wait(self, need: int, until: float) -> None:
        with self._lock:
            self.state, self.quorum_need, self.wait_until = "quorum", need, until
            self.version += 1

    def registered(self, device: DeviceInfo) -> None:
        with self._lock:
            dev = self._device(device.device_id)
            dev.registered, dev.refusal = True, None
            dev.profile, dev.arch = device.profile or dev.profile, device.arch or dev.arch
            self.version += 1

    def refused(self, device_id: str, what: str, reason: str, message: str) -> None:
        if what != "hello":
            return  # refused updates are counted from the round report (the numbers of reports.jsonl)
        # a check's message starts with its own reason ("slot: ..."), which the key already says
        message = message.removeprefix(f"{reason.removeprefix('hello-')}: ")
        with self._lock:
            if device_id in self.devices:
                self.devices[device_id].refusal = (reason, message[:500], self.clock())
                self.version += 1

    def round_started(self, info: RoundInfo, expected: Collection[str], pending: Collection[str]) -> None:
        with self._lock:
            again = self.state == "round" and self.current is not None and self.current.round == info.round
            if info.assigned is not None:
                self.asynchronous = True
            # an asynchronous version is announced again when it hands out tasks: it started at its first announcement
            self.state, self.current = "round", info
            if not again:
                self.round_started_at = self.clock()
            self.expected, self._pending = frozenset(expected), pending
            self.version += 1

    def round_finished(self, report: RoundReport, aggregation_s: float) -> None:
        self.add_report(report, aggregation_s, finished=self.clock())

    def run_finished(self) -> None:
        with self._lock:
            self.state, self._pending = "finished", ()
            self.version += 1

    # -- reports (live, and replayed from reports.jsonl) --------------------------------
    def add_report(self, report: RoundReport, aggregation_s: float = 0.0, *, finished: float = 0.0) -> None:
        """Count one round's report: per device and per profile (the live hook and the replay share it)."""
        with self._lock:
            profiles: dict[str, dict[str, float]] = {}
            for dev_id in report.accepted:
                dev = self._device(dev_id)
                dev.accepted += 1
                dev.last_round = max(dev.last_round, report.round)
                up, down = report.bytes_up.get(dev_id, 0), report.bytes_down.get(dev_id, 0)
                dev.bytes_up += up
                dev.bytes_down += down
                m = report.metrics.get(dev_id, {})
                acc = m.get("acc_global")
                if isinstance(acc, int | float):
                    dev.acc_global = float(acc)
                loc = m.get("acc_local")
                if isinstance(loc, int | float):
                    dev.acc_local = float(loc)
                p = profiles.setdefault(dev.profile or UNKNOWN, {"n": 0, "acc_sum": 0.0, "acc_n": 0,
                                                                  "acc_min": 1.0, "acc_max": 0.0,
                                                                  "bytes_up": 0, "bytes_down": 0})
                p["n"] += 1
                p["bytes_up"] += up
                p["bytes_down"] += down
                if isinstance(acc, int | float):
                    p["acc_sum"] += float(acc)
                    p["acc_n"] += 1
                    p["acc_min"] = min(p["acc_min"], float(acc))
                    p["acc_max"] = max(p["acc_max"], float(acc))
            for dev_id in report.missing:
                self._device(dev_id).missed += 1
            for dev_id, reasons in report.rejected_by_device.items():
                target = self.devices.get(dev_id)
                if target is not None:
                    target.refused.update(reasons)
            self.updates_refused.update(report.rejected)
            self.updates_accepted += len(report.accepted)
            up, down = report.total_bytes()  # compact partials: their totals, not per device
            self.bytes_up += up
            self.bytes_down += down
            small = self.series
            stale = list(report.staleness.values())
            if stale:
                self.asynchronous = True
                self.staleness.update(stale)
            self.rounds.append(RoundSummary(
                round=report.round, phase=report.phase, seconds=report.seconds, aggregation_s=aggregation_s,
                accepted=len(report.accepted), missing=list(report.missing[:NAMES_IN_A_LINE]),
                rejected=dict(report.rejected), profiles=profiles,
                acc={d: float(m["acc_global"]) for d, m in report.metrics.items()
                     if isinstance(m.get("acc_global"), int | float)} if small else None,
                bytes_up=dict(report.bytes_up) if small else None,
                bytes_down=dict(report.bytes_down) if small else None, finished=finished,
                staleness_mean=sum(stale) / len(stale) if stale else None, staleness_max=max(stale, default=None)))
            self.round_hist.append((report.seconds, aggregation_s))
            self.completed = max(self.completed, report.round)
            if self.state == "round":
                self.state = "between"
            self._pending = ()
            self.version += 1

    # -- heartbeats ------------------------------------------------------------------------
    def poll_health(self) -> int:
        """Check and store the heartbeats the transport received since the last call; returns how many
        were accepted. Never raises: a bad record is refused and counted."""
        if self.transport is None:
            return 0
        try:
            items = self.transport.health()
        except Exception:
            log.exception("reading heartbeats from the transport failed")
            return 0
        return sum(self.add_health(item) for item in items)

    def add_health(self, item: Inbound) -> bool:
        """Check one heartbeat; store it (True) or refuse and count it (False)."""
        origin = item.origin
        try:
            if item.reject is not None:
                raise HealthError(*item.reject)
            msg = Message.from_bytes(item.data, max_bytes=MAX_HEALTH_BYTES)
            if msg.kind != HEALTH_KIND:
                raise HealthError("kind", f"expected a health message, got a {msg.kind}")
            if origin is not None and msg.sender != origin:
                raise HealthError("spoofed", f"a health message on {origin[:64]!r}'s topic names {msg.sender[:64]!r}")
            if msg.fleet != self.fleet:
                raise HealthError("fleet", f"a health message for fleet {msg.fleet[:64]!r}")
            origin = origin or msg.sender
            if origin not in self.devices:
                raise HealthError("unauthorized", f"{origin[:64]!r} is not a device of this fleet")
            rec = parse_health(msg.info.get("health"))
        except Exception as exc:  # the error boundary: device bytes never stop the coordinator
            self._refuse_health(origin, reason_of(exc), getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
            return False
        with self._lock:
            dev = self.devices[origin]
            if dev.health is not None and rec.seq < dev.health.seq and rec.sent <= dev.health.sent:
                return False  # an older heartbeat overtaken by a newer one (a restarted agent counts from 1 again)
            dev.health, dev.health_at = rec, item.received or self.clock()
            self.health_accepted += 1
            self.version += 1
        return True

    def _refuse_health(self, origin: str | None, reason: str, message: str) -> None:
        key = f"health-{reason}"
        now = self.clock()
        with self._lock:
            self.health_refused[key] += 1
            dev = self.devices.get(origin) if origin else None
            if dev is not None:
                dev.health_refused[key] += 1
            # One line per device per minute, and one per minute for all senders outside the fleet together:
            # a device (or a stranger cycling through names) sending garbage every second must not flood the log.
            held = (dev.health_log if dev is not None else self._stranger_log).allow(now)
        if held is None:
            return
        more = f" ({held} more since the last such line)" if held else ""
        # a stranger's name comes from its topic: quoted, so a newline in it cannot forge a log line
        who = dev.device_id if dev is not None else repr(origin[:64]) if origin else UNKNOWN
        log.warning("refused a heartbeat from %s (%s): %s%s", who, key, message[:300], more)

    # -- what it waits for ---------------------------------------------------------------------
    def pending(self) -> list[str]:
        """The devices the current round still waits for (sorted)."""
        with self._lock:
            live = self._pending
        while True:
            try:
                # the engine's own set, mutated on its thread: copying a set is one C call under the GIL,
                # and a retry covers an implementation where it is not
                return sorted(set(live))
            except RuntimeError:
                continue

    def why(self, device_id: str, statuses: Mapping[str, tuple[bool, float]], now: float) -> str:
        """In words: why a device has not answered (for the log line and the page)."""
        dev = self.devices.get(device_id)
        status = statuses.get(device_id)
        if dev is not None and dev.refusal is not None and not dev.registered:
            return f"refused: {dev.refusal[0]}: {dev.refusal[1]}"
        if status is not None and not status[0]:
            return f"offline for {now - status[1]:.0f} s"
        if dev is None or not dev.registered:
            return "no hello yet" if status is None else "online, no valid hello yet"
        if self.state == "round":
            return "no update yet"
        return "not online" if status is None else "online"

    def waiting(self) -> tuple[str, list[tuple[str, str]]] | None:
        """(what the coordinator waits for, [(device, why)]) while it waits for devices; None otherwise."""
        now = self.clock()
        statuses = self.transport.statuses() if self.transport is not None else {}
        with self._lock:
            state = self.state
            if state == "round" and self.current is not None:
                info = self.current
                pending = self.pending()
                if not pending:
                    return None
                left = f", deadline in {max(0.0, info.deadline - now):.0f} s" if info.deadline else ""
                if info.assigned is not None:  # a version: the first K of the devices training make it
                    k = f"the {self.buffer_size} updates of " if self.buffer_size else "updates for "
                    head = (f"version {info.round} ({info.phase}): waiting for {k}{len(pending)} devices training, "
                            f"after {now - self.round_started_at:.0f} s{left}")
                else:
                    head = (f"round {info.round} ({info.phase}): waiting for {len(pending)} of {len(self.expected)} "
                            f"devices after {now - self.round_started_at:.0f} s{left}")
                return head, [(d, self.why(d, statuses, now)) for d in pending]
            if state == "fleet":
                missing = [d for d in self.fleet_wanted if not self.devices.get(d, DeviceState(d)).registered]
                if not missing:
                    return None
                head = (f"waiting for hellos from {len(missing)} of {len(self.fleet_wanted)} devices "
                        f"(up to {max(0.0, self.wait_until - now):.0f} s more)")
                return head, [(d, self.why(d, statuses, now)) for d in missing]
            if state == "quorum":
                online = [d for d, s in self.devices.items() if s.registered and statuses.get(d, (True, 0))[0]]
                if len(online) >= self.quorum_need:
                    return None
                absent = [d for d, s in self.devices.items() if s.in_fleet and d not in online]
                head = (f"waiting for a quorum of {self.quorum_need} devices ({len(online)} online; gives up in "
                        f"{max(0.0, self.wait_until - now):.0f} s)")
                return head, [(d, self.why(d, statuses, now)) for d in sorted(absent)]
        return None

    def waiting_line(self) -> tuple[int, str] | None:
        """(log level, the line) saying what the coordinator waits for, or None when it waits for nobody.

        WARNING when something is wrong (a device refused or offline, a quorum or the fleet's hellos
        missing), INFO for a round whose devices are still training."""
        got = self.waiting()
        if got is None:
            return None
        head, rows = got
        shown = "; ".join(f"{d} ({why})" for d, why in rows[:NAMES_IN_A_LINE])
        more = f"; and {len(rows) - NAMES_IN_A_LINE} more" if len(rows) > NAMES_IN_A_LINE else ""
        alarming = self.state != "round" or any(not why.startswith("no update") for _, why in rows)
        return (logging.WARNING if alarming else logging.INFO), f"{head}: {shown}{more}"

    def tick(self) -> None:
        """One step of the monitor's thread: heartbeats, then the "waiting for" line when it is due — at once, as a
        warning, after the coordinator reconnected to the broker (synchronous rounds and asynchronous versions
        alike: what it waits for then is what an outage may have lost)."""
        self.poll_health()
        now = self.clock()
        if self.reconnected():
            line = self.waiting_line()
            log.warning("reconnected to the broker: %s", line[1] if line is not None else f"{self.state}, "
                        "waiting for no device")
            self._last_wait_log = now
            return
        if self.wait_log_s > 0 and now - self._last_wait_log >= self.wait_log_s:
            self._last_wait_log = now
            line = self.waiting_line()
            if line is not None:
                log.log(line[0], "%s", line[1])

    def reconnected(self) -> bool:
        """Whether the transport reconnected to the broker since the last call (its first connection is not one)."""
        if self.transport is None:
            return False
        seen, self._connections = self._connections, self.transport.connections()
        return self._connections > max(seen, 1)

    # -- thread ----------------------------------------------------------------------------
    def start(self) -> FleetMonitor:
        """Run :meth:`tick` every ``poll_s`` seconds on a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-monitor", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception:  # the monitor must outlive its own bugs: it is how the operator sees the fleet
                log.exception("fleet monitor tick failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    # -- the view ----------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """Everything the dashboard shows, as JSON-able data (also ``/api/state``)."""
        now = self.clock()
        statuses = self.transport.statuses() if self.transport is not None else {}
        seen = self.transport.last_seen() if self.transport is not None else {}
        waiting = self.waiting()
        with self._lock:
            devices = []
            for d in self.devices.values():
                st = statuses.get(d.device_id)
                last = max(seen.get(d.device_id, 0.0), d.health_at)
                devices.append({
                    "device": d.device_id, "profile": d.profile, "arch": d.arch, "in_fleet": d.in_fleet,
                    "state": device_state(d, st, self.live),
                    "status_since": st[1] if st else None,
                    "last_seen": last or None,
                    "health": d.health.to_dict() if d.health else None,
                    "health_at": d.health_at or None,
                    "throttle": d.health.throttle_words() if d.health else [],
                    "health_refused": dict(d.health_refused),
                    "refusal": {"reason": d.refusal[0], "message": d.refusal[1], "at": d.refusal[2]}
                    if d.refusal else None,
                    "accepted": d.accepted, "missed": d.missed, "last_round": d.last_round,
                    "refused": dict(d.refused), "bytes_up": d.bytes_up, "bytes_down": d.bytes_down,
                    "acc_global": d.acc_global, "acc_local": d.acc_local,
                })
            cur = self.current
            return {
                "fleet": self.fleet, "method": self.method, "run_id": self.run_id, "live": self.live,
                # asynchronous mode: rounds are global versions (docs/async.md); buffer_size None when not known
                "mode": "async" if self.asynchronous else "sync", "unit": "version" if self.asynchronous else "round",
                "buffer_size": self.buffer_size or None,
                "generated": now, "started": self.started, "version": self.version,
                "state": self.state, "completed": self.completed, "total_rounds": self.total_rounds + 1,
                "round": None if cur is None or self.state != "round" else {
                    "round": cur.round, "phase": cur.phase, "deadline": cur.deadline or None,
                    "started": self.round_started_at, "expected": len(self.expected),
                    "training": len(self.pending()) if cur.assigned is not None else None},
                "waiting": None if waiting is None else {"what": waiting[0],
                                                         "devices": [{"device": d, "why": w} for d, w in waiting[1]]},
                "devices": devices,
                "rounds": [r.to_dict() for r in self.rounds],
                "series": self.series,
                "totals": {"updates_accepted": self.updates_accepted, "updates_refused": dict(self.updates_refused),
                           "health_accepted": self.health_accepted, "health_refused": dict(self.health_refused),
                           "bytes_up": self.bytes_up, "bytes_down": self.bytes_down},
            }


def device_state(d: DeviceState, status: tuple[bool, float] | None, live: bool) -> str:
    """online | offline | refused | no hello, or after the fact (``live`` False) registered | no hello."""
    if d.refusal is not None and not d.registered:
        return "refused"
    if not live:
        return "registered" if d.registered else "no hello"
    if status is not None:
        return "online" if status[0] else "offline"
    return "online" if d.registered else "no hello"


def monitor_from_state_dir(state_dir: str | Path, *,
                           fleet_devices: Mapping[str, DeviceInfo] | None = None) -> FleetMonitor:
    """A monitor replaying a coordinator's state directory: ``state.json`` (fleet, method, registered
    devices) and ``reports.jsonl`` (every completed round, read with ``live=True``: a line still being
    appended is left out). The numbers are the reports' own."""
    import json

    from fedge.coordinator.store import REPORTS_FILE, STATE_FILE, read_reports

    path = Path(state_dir)
    doc: dict[str, Any] = {}
    state_file = path / STATE_FILE
    if state_file.is_file():
        try:
            loaded = json.loads(state_file.read_bytes())
            doc = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            doc = {}  # being replaced right now, or damaged: the reports alone still make a view
    devices: dict[str, DeviceInfo] = dict(fleet_devices or {})
    for raw in doc.get("devices", []) if isinstance(doc.get("devices"), list) else []:
        try:
            info = DeviceInfo.from_dict(raw)
        except (TypeError, KeyError):
            continue
        devices.setdefault(info.device_id, info)
    reports = read_reports(path / REPORTS_FILE, live=True)
    mon = FleetMonitor(fleet=str(doc.get("fleet", "")), method=str(doc.get("method", "")),
                       total_rounds=max([r.round for r in reports if r.phase != "final"], default=0),
                       fleet_devices=devices, run_id=str(doc.get("run_id", "")), wait_log_s=0, live=False)
    registered = {str(d.get("device_id")) for d in doc.get("devices", []) if isinstance(d, dict)} \
        if isinstance(doc.get("devices"), list) else set()
    for dev_id in registered & set(mon.devices):
        mon.devices[dev_id].registered = True
    for r in reports:
        mon.add_report(r)
    finished = any(r.phase == "final" for r in reports)
    mon.state = "finished" if finished else ("between" if reports else "starting")
    if finished:
        mon.total_rounds = max(r.round for r in reports) - 1
    return mon


class FileView:
    """The view of a state directory, rebuilt only when ``reports.jsonl`` or ``state.json`` changed (a run
    still going is followed as its coordinator appends)."""

    def __init__(self, state_dir: str | Path, fleet_devices: Mapping[str, DeviceInfo] | None = None) -> None:
        self.dir = Path(state_dir)
        self.fleet_devices = dict(fleet_devices or {})
        self._key: tuple[Any, ...] | None = None
        self._monitor: FleetMonitor | None = None
        self._lock = threading.Lock()

    def _stamp(self) -> tuple[Any, ...]:
        from fedge.coordinator.store import REPORTS_FILE, STATE_FILE

        out: list[Any] = []
        for name in (REPORTS_FILE, STATE_FILE):
            try:
                st = (self.dir / name).stat()
                out += [st.st_mtime_ns, st.st_size]
            except OSError:
                out += [None, None]
        return tuple(out)

    def monitor(self) -> FleetMonitor:
        with self._lock:
            key = self._stamp()
            if self._monitor is None or key != self._key:
                self._monitor = monitor_from_state_dir(self.dir, fleet_devices=self.fleet_devices)
                self._key = key
            return self._monitor

    def view(self) -> dict[str, Any]:
        return self.monitor().view()


def fleet_infos(slots: Mapping[str, Any] | None, ids: Iterable[str] = ()) -> dict[str, DeviceInfo]:
    """Device id -> DeviceInfo of the fleet config: from the engine's slot checks, else bare ids."""
    out: dict[str, DeviceInfo] = {}
    for dev_id, check in (slots or {}).items():
        out[dev_id] = check.info
    for dev_id in ids:
        out.setdefault(dev_id, DeviceInfo(dev_id, "", ""))
    return out
