"""The fleet view of a coordinator's state directory, after the fact or following a run still going: a
:class:`~fedge.observe.monitor.FleetMonitor` rebuilt from ``state.json`` and ``reports.jsonl`` alone
(:func:`monitor_from_state_dir`), so the dashboard shows a finished run with the numbers of its reports, and
:class:`FileView`, which rebuilds it only when those files changed."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedge.common.rounds import DeviceInfo
from fedge.coordinator.store import REPORTS_FILE, STATE_FILE, read_reports
from fedge.observe.monitor import FleetMonitor


def monitor_from_state_dir(state_dir: str | Path, *,
                           fleet_devices: Mapping[str, DeviceInfo] | None = None) -> FleetMonitor:
    """A monitor replaying a coordinator's state directory: ``state.json`` (fleet, method, registered
    devices) and ``reports.jsonl`` (every completed round, read with ``live=True``: a line still being
    appended is left out). The numbers are the reports' own."""
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
