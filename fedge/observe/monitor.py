"""The fleet as an operator sees it: each device's state, health and history, and what the coordinator waits for.

A :class:`FleetMonitor` watches a running engine (it is an :class:`~fedge.coordinator.observer.EngineObserver`)
and its transport: it drains the devices' heartbeats into its :class:`~fedge.observe.heartbeats.HealthIntake`
(a bad one is refused, counted by reason and logged, never stored), keeps one record per device of the fleet
config (:mod:`fedge.observe.fleetrecords`), and per round the figures the dashboard draws. Its thread also
says what the coordinator waits for (:mod:`fedge.observe.waiting`): every ``wait_log_s`` seconds while a
round, the quorum or the fleet's hellos are incomplete, one log line names the missing devices and why
(offline, refused and the reason, no hello yet, no update yet).

In asynchronous mode (``[coordinator] mode = "async"``, docs/async.md) a "round" is a global version: the view
says so (``mode``, ``unit``), the engine announces a version again whenever it hands out tasks (the version's
start time stays that of its first announcement), the devices it waits for are those training (holding a
task), and each finished version keeps the staleness of its updates.

The same view is built after the fact from a state directory (:mod:`fedge.observe.fileview`), from
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
from typing import Any

from fedge.common.health import HealthRecord
from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.common.transport import CoordinatorTransport, Inbound
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.report import RoundReport
from fedge.observe.fleetrecords import UNKNOWN, DeviceState, RoundSummary, device_state
from fedge.observe.heartbeats import HealthIntake
from fedge.observe.waiting import NAMES_IN_A_LINE, Statuses, Waiting, WaitState, waiting, waiting_line, why

log = logging.getLogger(__name__)

DEVICE_SERIES_LIMIT = 40  # per-device accuracy and traffic series are kept up to this fleet size


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
        self.health = HealthIntake(fleet=fleet, devices=self.devices, lock=self._lock, clock=clock,
                                   changed=self._changed)
        self.updates_refused: Counter[str] = Counter()  # reason -> messages, from the round reports
        self.updates_accepted = 0
        self.staleness: Counter[int] = Counter()  # asynchronous mode: staleness -> accepted updates (/metrics)
        self.thermal_held = 0  # candidates the thermal guard held out of a round, summed over rounds (/metrics)
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
            self.thermal_held += len(report.hot)
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

    # -- heartbeats (fedge.observe.heartbeats) ------------------------------------------
    @property
    def health_refused(self) -> Counter[str]:
        """Heartbeats refused, by reason (``health-`` + the check's reason)."""
        return self.health.refused

    @property
    def health_accepted(self) -> int:
        """Heartbeats accepted and stored."""
        return self.health.accepted

    def health_records(self) -> dict[str, HealthRecord]:
        """Each device's last accepted heartbeat."""
        with self._lock:
            return {d: dev.health for d, dev in self.devices.items() if dev.health is not None}

    def heartbeats(self) -> dict[str, tuple[HealthRecord, float]]:
        """Each device's last accepted heartbeat and when it arrived (the coordinator's clock): what the thermal
        guard reads (``RoundEngine.health``), a reading too old saying nothing of the heat (fedge.common.heat)."""
        with self._lock:
            return {d: (dev.health, dev.health_at) for d, dev in self.devices.items() if dev.health is not None}

    def poll_health(self) -> int:
        """Check and store the heartbeats the transport received since the last call; returns how many
        were accepted. Never raises: a bad record is refused and counted."""
        return self.health.poll(self.transport)

    def add_health(self, item: Inbound) -> bool:
        """Check one heartbeat; store it (True) or refuse and count it (False)."""
        return self.health.add(item)

    def _changed(self) -> None:
        self.version += 1

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

    def why(self, device_id: str, statuses: Statuses, now: float) -> str:
        """In words: why a device has not answered (for the log line and the page)."""
        with self._lock:
            return why(device_id, self.devices, self.state, statuses, now)

    def waiting(self) -> Waiting | None:
        """(what the coordinator waits for, [(device, why)]) while it waits for devices; None otherwise
        (:func:`fedge.observe.waiting.waiting`)."""
        now = self.clock()
        statuses = self.transport.statuses() if self.transport is not None else {}
        with self._lock:
            w = WaitState(self.state, self.current, self.round_started_at,
                          tuple(self.pending()) if self.state == "round" else (), len(self.expected),
                          self.buffer_size, tuple(self.fleet_wanted), self.quorum_need, self.wait_until)
            return waiting(w, self.devices, statuses, now)

    def waiting_line(self) -> tuple[int, str] | None:
        """(log level, the line) saying what the coordinator waits for, or None when it waits for nobody.

        WARNING when something is wrong (a device refused or offline, a quorum or the fleet's hellos
        missing), INFO for a round whose devices are still training."""
        return waiting_line(self.state, self.waiting())

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


def fleet_infos(slots: Mapping[str, Any] | None, ids: Iterable[str] = ()) -> dict[str, DeviceInfo]:
    """Device id -> DeviceInfo of the fleet config: from the engine's slot checks, else bare ids."""
    out: dict[str, DeviceInfo] = {}
    for dev_id, check in (slots or {}).items():
        out[dev_id] = check.info
    for dev_id in ids:
        out.setdefault(dev_id, DeviceInfo(dev_id, "", ""))
    return out
