"""The engine's checkpoints: one state directory, written atomically after every round.

Files (all 0600: they hold what devices said about themselves):

* ``globals.safetensors`` — every published artifact, keys ``artifact/tensor``;
* ``reports.jsonl`` — one :class:`RoundReport` per completed round, appended;
* ``state.json`` — written last: rounds completed, registered devices, the strategy's
  state, the run id, artifact versions, measured latencies. A part of the strategy's state
  that changes a few keys at a time (a :class:`LogDoc`: asynchronous FedProto's and FedVTC's
  latest upload of every device) lives in an append-only log beside it, ``<path>-<n>.jsonl``,
  which ``state.json`` names with the bytes that count (``fedge.coordinator.statelog``). A crash before it
  leaves the previous ``state.json`` pointing at round N-1 (and at N-1 report
  lines: a report line of round N beyond them is cut off on load), and round N
  is simply run again;
* ``buffer/`` — asynchronous mode only: every update accepted into the version being built, appended to
  ``<version>.updates`` before it counts, and ``tasks-<version>.json``, the devices asked to train; a restarted
  coordinator folds them in again (no accepted update is lost) and clears them once the version is saved.

:func:`read_reports` is the one reader of ``reports.jsonl``, for the store and for anyone
who looks at a state directory (``fedge emulate status``, the benchmarks).
"""

from __future__ import annotations

import json
import logging
import operator
import os
import struct
import typing
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from fedge.common.atomicfile import write_atomic
from fedge.common.rounds import DeviceInfo
from fedge.common.tensorcodec import Payload, decode, encode
from fedge.coordinator.report import RoundReport
from fedge.coordinator.statelog import FILE_MODE, StateLogs, is_ref
from fedge.coordinator.strategy import JsonDoc, LogDoc
from fedge.errors import CheckpointError, FedgeError

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
GLOBALS_FILE = "globals.safetensors"
REPORTS_FILE = "reports.jsonl"  # one line per completed round, appended (state.json stays small)
BUFFER_DIR = "buffer"  # asynchronous mode: the accepted updates of the version being built
LOG_SUFFIX = ".updates"  # buffer/<version>.updates: the version's accepted updates, appended
RECORD = struct.Struct("<QI")  # an accepted update's record in the log: its length and CRC-32, then its bytes


def _write_state_file(path: Path, data: bytes) -> None:
    """Replace one of the coordinator's files (its own: mode 0600), durably."""
    write_atomic(path, data, FILE_MODE)


class StateMismatchError(CheckpointError):
    """The state directory holds another run (another method or fleet) than the one configured."""


@dataclass
class EngineState:
    """Everything a restarted coordinator needs to resume after the last completed round."""

    completed: int = 0
    method: str = ""
    fleet: str = ""
    devices: dict[str, DeviceInfo] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    global_rounds: dict[str, int] = field(default_factory=dict)
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    globals: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    reports: list[RoundReport] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)  # asynchronous mode: device -> version it was asked at


class EngineStore:
    """Saves and loads :class:`EngineState` in ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.report_lines = 0  # reports appended to REPORTS_FILE so far
        # device id -> (the DeviceInfo, its to_dict()): state.json lists every registered device after every
        # round (asynchronous mode: every version), while a device's entry changes only with a new hello,
        # which registers a new (frozen) DeviceInfo
        self._device_docs: dict[str, tuple[DeviceInfo, dict[str, Any]]] = {}
        self._devices_list: JsonList | None = None  # ... the list, its JSON text made, for these devices:
        self._devices_seen: list[DeviceInfo] = []  # the DeviceInfo objects it was made of, in order
        self._buffer_log: tuple[int, int] | None = None  # (version, fd) of the update log being appended to
        self._buffer_dirty = False  # records written since the last buffer_sync
        self._log_size = 0  # bytes in that log
        self._log_end: tuple[int, int] = (0, 0)  # (version, byte) where buffer_load found that log's last record end
        self._logs = StateLogs(self.dir)  # the strategy's LogDocs, each in its append-only log

    def exists(self) -> bool:
        """Whether a previous run left a state here."""
        return (self.dir / STATE_FILE).is_file()

    def save(self, state: EngineState, report: RoundReport | None) -> None:
        """Checkpoint after a round: globals, then ``report`` appended, then ``state.json``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"{a}/{k}": v for a, arrays in state.globals.items() for k, v in arrays.items()}
        _write_state_file(self.dir / GLOBALS_FILE, encode(Payload(tensors)))
        # Reports are appended, not rewritten: rewriting every round's per-device report each round
        # costs O(rounds x devices) per round (seconds at 1000 devices).
        if report is not None:
            # the fields as they are (asdict would deep-copy every per-device entry first, only to encode it)
            doc = {f.name: getattr(report, f.name) for f in fields(report)}
            line = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode() + b"\n"
            fd = os.open(self.dir / REPORTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            with os.fdopen(fd, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.report_lines += 1
        doc = {
            "completed": state.completed,
            "method": state.method,
            "fleet": state.fleet,
            "devices": self._devices_doc(state.devices),
            "strategy": state.strategy,
            "reports_saved": self.report_lines,
            "artifacts": sorted(state.globals),
            "run_id": state.run_id,
            "global_rounds": state.global_rounds,
            "latency": state.latency,
            "tasks": state.tasks,
        }
        try:
            _write_state_file(self.dir / STATE_FILE, _state_json(doc, self._logs))
        except BaseException:
            self._logs.abort()
            raise
        self._logs.commit()

    def _devices_doc(self, devices: dict[str, DeviceInfo]) -> JsonList:
        """``state.json``'s device list: each device's ``to_dict()``, made again only for a new DeviceInfo, and
        the list and its JSON text kept while no device changed.

        Whether one changed is one identity test per device in C (``map(operator.is_, ...)``): asynchronous
        mode checkpoints every version, and a Python loop over a fleet of thousands at each one was a cost
        that grows with N (issue 27)."""
        kept = self._devices_list
        if (kept is not None and len(devices) == len(self._devices_seen)
                and all(map(operator.is_, devices.values(), self._devices_seen))):
            return kept  # the same DeviceInfo objects in the same order: the same devices (keyed by their ids)
        docs = self._device_docs
        out = JsonList()
        for dev_id, dev in devices.items():
            doc = docs.get(dev_id)
            if doc is None or doc[0] is not dev:
                doc = docs[dev_id] = (dev, dev.to_dict())
            out.append(doc[1])
        if len(docs) > len(devices):
            for gone in set(docs) - set(devices):
                del docs[gone]
        out.text = json.dumps(out, separators=(",", ":"), allow_nan=False)
        self._devices_list = out
        self._devices_seen = list(devices.values())
        return out

    def load(self, *, method: str, fleet: str) -> EngineState:
        """The saved state; :class:`StateMismatchError` if it is another method's or fleet's run."""
        path = self.dir / STATE_FILE
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is unreadable: {exc}",
                                  hint="restore the state directory or start another --state-dir") from exc
        if not isinstance(doc, dict):
            raise CheckpointError(f"{path} is not a JSON object", hint="restore it or start another --state-dir")
        if doc.get("method") != method:
            raise StateMismatchError(f"{self.dir} holds a {doc.get('method')} run, not {method}",
                                     hint="use another --state-dir or the same method")
        saved_fleet = doc.get("fleet", fleet)  # states written before fleets were recorded: accept
        if saved_fleet != fleet:
            raise StateMismatchError(f"{self.dir} holds a run of fleet {saved_fleet!r}, not {fleet!r}",
                                     hint="use another --state-dir or the same fleet")
        try:
            state = EngineState(
                completed=int(doc["completed"]),
                method=method,
                fleet=fleet,
                devices={d["device_id"]: DeviceInfo.from_dict(d) for d in doc["devices"]},
                strategy=self._resolve(dict(doc.get("strategy", {}))),
                run_id=str(doc.get("run_id") or ""),
                global_rounds={str(k): int(v) for k, v in doc.get("global_rounds", {}).items()},
                latency={str(p): {str(d): float(s) for d, s in per.items()}
                         for p, per in doc.get("latency", {}).items()},
                tasks={str(d): int(v) for d, v in doc.get("tasks", {}).items()},
            )
            self.report_lines = int(doc.get("reports_saved", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{path} is damaged: {exc!r}",
                                  hint="restore the state directory or start another --state-dir") from exc
        state.reports = self._load_reports(self.report_lines)
        try:
            flat = decode((self.dir / GLOBALS_FILE).read_bytes()).tensors
        except (OSError, FedgeError) as exc:
            raise CheckpointError(f"{self.dir / GLOBALS_FILE} is unreadable: {exc}",
                                  hint="restore the state directory or start another --state-dir") from exc
        for key, arr in flat.items():
            artifact, name = key.split("/", 1)
            state.globals.setdefault(artifact, {})[name] = arr
        return state

    def _resolve(self, value: Any) -> Any:
        """``value`` from ``state.json`` with every log reference in it replaced by the log's object."""
        if is_ref(value):
            return self._logs.read(value)
        if isinstance(value, dict):
            return {k: self._resolve(v) for k, v in value.items()}
        return value

    # -- asynchronous mode's buffer ------------------------------------------------------------
    def buffer_add(self, version: int, index: int, data: bytes) -> None:
        """Persist the ``index``-th update accepted into ``version`` (before it counts: a kill -9 loses none).

        Appended to the version's log, ``buffer/<version>.updates``, as one record (:data:`RECORD` header:
        length and CRC-32, then the bytes) in one ``write``: once it returns the update is in the file, whatever
        becomes of this process. :meth:`buffer_sync` makes the log durable on disk (the engine calls it before
        it announces tasks or publishes the version: before anything outside depends on these updates); a
        file and an ``fsync`` per update cost about four times the CPU and 3 ms of waiting each.
        """
        log = self._buffer_log
        if log is None or log[0] != version:
            self._buffer_close()
            d = self.dir / BUFFER_DIR
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{version}{LOG_SUFFIX}"
            if self._log_end[0] == version and path.is_file() and path.stat().st_size > self._log_end[1]:
                os.truncate(path, self._log_end[1])  # a torn record buffer_load left out: appended after it, the
                # records that follow could not be read back
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            log = self._buffer_log = (version, fd)
            self._log_size = os.fstat(fd).st_size
        record = RECORD.pack(len(data), zlib.crc32(data)) + data
        try:
            written = os.write(log[1], record)
        except OSError:
            written = -1
        if written != len(record):  # (a full disk) no part of a record may stay: the next one must be readable
            os.ftruncate(log[1], self._log_size)
            raise CheckpointError(f"{self.dir / BUFFER_DIR}: could not write an accepted update",
                                  hint="check the free space of the state directory's disk")
        self._log_size += written
        self._buffer_dirty = True

    def buffer_sync(self) -> None:
        """``fsync`` the version's log if updates were added since the last call."""
        if self._buffer_log is not None and self._buffer_dirty:
            os.fsync(self._buffer_log[1])
        self._buffer_dirty = False

    def _buffer_close(self) -> None:
        if self._buffer_log is not None:
            self.buffer_sync()
            os.close(self._buffer_log[1])
            self._buffer_log = None

    def save_tasks(self, version: int, tasks: dict[str, int]) -> None:
        """The devices asked to train (device -> the version it was asked at), as announced for ``version``."""
        d = self.dir / BUFFER_DIR
        d.mkdir(parents=True, exist_ok=True)
        _write_state_file(d / f"tasks-{version}.json", json.dumps(tasks, sort_keys=True).encode())

    def buffer_load(self, version: int) -> tuple[list[bytes], dict[str, int] | None]:
        """The updates accepted into ``version`` so far, in order, and its saved tasks (None: none saved).

        A record cut short or whose CRC does not match ends the log: it was being written when the process
        or the machine stopped, so it had not counted (an update counts once its record is written). One
        file per update, ``<version>-<index>.update``, is how states written before the log held them.
        """
        d = self.dir / BUFFER_DIR
        files = sorted(d.glob(f"{version}-*.update")) if d.is_dir() else []
        saved = [f.read_bytes() for f in files]
        log_file = d / f"{version}{LOG_SUFFIX}"
        if log_file.is_file():
            records, end = _read_records(log_file)
            saved += records
            self._log_end = (version, end)
        tasks_file = d / f"tasks-{version}.json"
        try:
            tasks = ({str(k): int(v) for k, v in json.loads(tasks_file.read_bytes()).items()}
                     if tasks_file.is_file() else None)
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{tasks_file} is damaged: {exc}",
                                  hint="restore the state directory or start another --state-dir") from exc
        return saved, tasks

    def buffer_clear(self, keep_version: int | None = None) -> None:
        """Drop the buffer's files (those of ``keep_version`` stay): its version is saved in ``state.json``."""
        if self._buffer_log is not None and self._buffer_log[0] != keep_version:
            self._buffer_close()
        d = self.dir / BUFFER_DIR
        if not d.is_dir():
            return
        for f in d.iterdir():
            version = f.name.removeprefix("tasks-").split("-")[0].split(".")[0]
            if keep_version is None or version != str(keep_version):
                f.unlink(missing_ok=True)

    def _load_reports(self, count: int) -> list[RoundReport]:
        """The first ``count`` report lines; lines beyond them (a crash before state.json) are cut off."""
        path = self.dir / REPORTS_FILE
        lines = _report_lines(path)
        if len(lines) < count:
            raise CheckpointError(f"{path} holds {len(lines)} round reports, {count} expected",
                                  hint="the state directory is damaged; restore it or start another --state-dir")
        if len(lines) > count:
            _write_state_file(path, b"".join(lines[:count]))
        return _parse_reports(path, lines[:count])


def read_reports(path: str | os.PathLike[str], *, live: bool = False) -> list[RoundReport]:
    """The round reports in ``path`` (a state directory's ``reports.jsonl``), oldest first.

    A missing file holds none (no round has completed). The file is input like any other: a line
    that is not a round report raises :class:`CheckpointError` naming the file and the line.
    ``live``: a coordinator may be appending to the file right now, so a last line without its
    newline is a report still being written and is left out (the store writes each line whole,
    newline included, in one append).
    """
    path = Path(path)
    lines = _report_lines(path)
    if live and lines and not lines[-1].endswith(b"\n"):
        lines = lines[:-1]
    return _parse_reports(path, lines)


def _report_lines(path: Path) -> list[bytes]:
    """The lines of a reports file, each with its newline (the last may lack it); none if it is missing."""
    return path.read_bytes().splitlines(keepends=True) if path.is_file() else []


def _json_types() -> dict[str, tuple[type, ...]]:
    """RoundReport's fields -> the JSON types their values may have (a float field also takes an integer)."""
    hints = typing.get_type_hints(RoundReport)
    out: dict[str, tuple[type, ...]] = {}
    for f in fields(RoundReport):
        kind = typing.get_origin(hints[f.name]) or hints[f.name]  # list[str] -> list
        out[f.name] = (int, float) if kind is float else (kind,)
    return out


_REPORT_FIELDS = _json_types()


def _parse_reports(path: Path, lines: Sequence[bytes]) -> list[RoundReport]:
    """One :class:`RoundReport` per line; :class:`CheckpointError` at the first line that is not one."""
    out = []
    for number, line in enumerate(lines, 1):
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}, not an object")
            wrong = [k for k, v in doc.items() if k in _REPORT_FIELDS and not isinstance(v, _REPORT_FIELDS[k])]
            if wrong:
                raise ValueError(f"wrong type of {', '.join(wrong)}")
            out.append(RoundReport(**doc))  # unknown or missing fields: TypeError
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}, line {number}: not a round report: {exc}",
                                  hint="restore the state directory or start another --state-dir") from exc
    return out


def _read_records(path: Path) -> tuple[list[bytes], int]:
    """The whole records of an update log (:meth:`EngineStore.buffer_add`), up to a torn or damaged one, and the
    byte where they end."""
    raw = path.read_bytes()
    out: list[bytes] = []
    at = 0
    while at + RECORD.size <= len(raw):
        size, crc = RECORD.unpack_from(raw, at)
        data = raw[at + RECORD.size:at + RECORD.size + size]
        if len(data) < size or zlib.crc32(data) != crc:
            log.warning("%s: a record at byte %d is %s; the %d records before it are the version's updates",
                        path, at, "cut short" if len(data) < size else "damaged", len(out))
            break
        out.append(data)
        at += RECORD.size + size
    return out, at


def _state_json(doc: dict[str, Any], logs: StateLogs | None = None) -> bytes:
    """``state.json``'s text: one top-level key per line, each value compact; each :class:`LogDoc` in it written
    to its log by ``logs`` and named by a reference.

    ``json.dumps`` with ``indent`` runs the pure-Python encoder; without it, the C encoder is some ten
    times faster. The file is written after every round (asynchronous mode: every version, with every
    registered device in it), so it is encoded compactly, one key per line to stay readable.
    """
    pieces = ["{\n"]
    for i, (k, v) in enumerate(doc.items()):
        pieces += [",\n" if i else "", json.dumps(k), ": ", _compact(v, logs, k)]
    pieces.append("\n}\n")
    return "".join(pieces).encode()


class JsonList(list[Any]):
    """A list whose JSON text (``text``) was made already: :func:`_compact` writes that."""

    text: str = ""


def _compact(value: Any, logs: StateLogs | None = None, path: str = "") -> str:
    """``value`` as compact JSON; a :class:`JsonDoc` inside (nested in dicts) is written as its kept text, a
    :class:`LogDoc` (at ``path`` in the state) to its log by ``logs``, as a reference."""
    if isinstance(value, LogDoc) and logs is not None:
        return logs.write(path, value, _compact)
    if isinstance(value, JsonDoc | JsonList):
        return value.text
    if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_compact(v, logs, f'{path}.{k}')}"
                              for k, v in value.items()) + "}"
    return json.dumps(value, separators=(",", ":"), allow_nan=False)
