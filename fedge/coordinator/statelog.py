"""Parts of ``state.json`` kept in append-only logs beside it (a :class:`LogDoc` of a strategy's state).

Asynchronous FedProto and FedVTC keep every device's latest upload (``fedge.coordinator.strategies.running``):
3.6 MB at N = 1,000, of which a version changes only the ``buffer_size`` devices that delivered into it. Written
whole into ``state.json`` at every version, it made a version's checkpoint cost O(N), ten times per N updates at
K = N/10. Here such an object lives in its own file, ``<path>-<generation>.jsonl``, one line per key set
(``[key, value]``) or deleted (``[key]``), the last line of a key winning; a checkpoint appends the lines of the
keys changed since the previous one and ``state.json`` holds a reference, ``{"$log": file, "bytes": n}``. The
log is compacted (rewritten with one line per live key, as the next generation) when it has grown past twice its
live size, so its size and a checkpoint's work both follow K, not N.

Crash safety is ``state.json``'s: lines are appended (and ``fsync``-ed) before ``state.json`` is replaced, and
a reader reads a log only up to the ``bytes`` its ``state.json`` names — lines appended by a checkpoint that
never completed are ignored, and cut off before the next append. A new generation is written whole to a
temporary file and renamed; the one it replaces is removed only once ``state.json`` points past it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.common import boundedjson
from fedge.common.atomicfile import write_atomic
from fedge.coordinator.strategy import LogDoc
from fedge.errors import CheckpointError, FedgeError

log = logging.getLogger(__name__)

REF_KEY = "$log"  # a reference's key in state.json: {"$log": "<file>", "bytes": <n>}
_NAME = re.compile(r"[A-Za-z0-9_.]+-[0-9]+\.jsonl")  # a log's file name: nothing else is read from a state
COMPACT_FACTOR = 2  # rewrite a log when it holds more than this many times its live bytes ...
COMPACT_SLACK = 1 << 20  # ... plus this much (small logs are never worth rewriting)
FILE_MODE = 0o600
MAX_DEPTH = 32  # a log line is [key, value]; a value of a strategy's state nests a few levels


@dataclass
class _Log:
    """One log file as this store last wrote or read it."""

    stem: str
    generation: int
    size: int  # bytes that state.json names (committed)
    sizes: dict[str, int] = field(default_factory=dict)  # key -> bytes of its last line
    live: int = 0  # the sum of ``sizes``, kept as they change (a checkpoint touches K keys, not N)
    owner: LogDoc | None = None  # the object written into it (None: read from disk; the next write is whole)
    pending: int | None = None  # size after an append not yet committed by state.json

    @property
    def name(self) -> str:
        return f"{self.stem}-{self.generation}.jsonl"

    def set_size(self, key: str, size: int | None) -> None:
        """``key``'s last line is ``size`` bytes (None: the key was deleted)."""
        self.live -= self.sizes.pop(key, 0)
        if size is not None:
            self.sizes[key] = size
            self.live += size


def is_ref(value: Any) -> bool:
    """Whether ``value`` (from ``state.json``) is a reference to a log."""
    return isinstance(value, dict) and REF_KEY in value


class StateLogs:
    """The logs of one state directory: written by :meth:`write` during a checkpoint, made current by
    :meth:`commit` once ``state.json`` is replaced, read back by :meth:`read` when a state is loaded."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._logs: dict[str, _Log] = {}  # stem -> log
        self._written: list[tuple[_Log, LogDoc, str | None]] = []  # this checkpoint's: log, doc, file replaced

    def write(self, path: str, doc: LogDoc, encode: Callable[[Any], str]) -> str:
        """Write ``doc`` (found at ``path`` in the state) to its log; the reference's JSON text for ``state.json``.
        ``encode`` gives a value's compact JSON text."""
        stem = _stem(path)
        cur = self._logs.get(stem)
        if cur is None or cur.owner is not doc or cur.size > COMPACT_FACTOR * cur.live + COMPACT_SLACK:
            new = self._rewrite(stem, doc, encode, cur)
            self._written.append((new, doc, cur.name if cur is not None and cur.name != new.name else None))
            cur = new
        else:
            self._append(cur, doc, encode)
            self._written.append((cur, doc, None))
        return json.dumps({REF_KEY: cur.name, "bytes": cur.pending, "keys": len(doc)}, separators=(",", ":"))

    def commit(self) -> None:
        """``state.json`` now names what :meth:`write` wrote: forget the docs' changes, drop replaced files."""
        for lg, doc, replaced in self._written:
            if lg.pending is not None:
                lg.size, lg.pending = lg.pending, None
            doc.changed.clear()
            if replaced is not None:
                (self.dir / replaced).unlink(missing_ok=True)
        self._written.clear()

    def abort(self) -> None:
        """The checkpoint failed before ``state.json`` was replaced: the next one appends after the committed
        bytes (the lines appended since are cut off) and keeps every doc's changes."""
        for lg, _doc, _replaced in self._written:
            lg.pending = None
        self._written.clear()

    def read(self, ref: Any) -> dict[str, Any]:
        """The object a reference in ``state.json`` names (read up to its ``bytes``); :class:`CheckpointError`
        naming the file if it is missing, shorter than named, or holds a line that is not ``[key(, value)]``."""
        name, size = ref.get(REF_KEY), ref.get("bytes")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{self.dir}: state.json names a log as {ref!r}, not a file name and a size",
                                  hint="restore the state directory or start another --state-dir")
        path = self.dir / name
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path} is unreadable: {exc}",
                                  hint="restore the state directory or start another --state-dir") from exc
        if len(raw) < size:
            raise CheckpointError(f"{path} holds {len(raw)} bytes, state.json names {size}",
                                  hint="the state directory is damaged; restore it or start another --state-dir")
        stem, _, gen = name[:-len(".jsonl")].rpartition("-")
        lg = _Log(stem, int(gen), size)
        out: dict[str, Any] = {}
        for number, line in enumerate(raw[:size].splitlines(keepends=True), 1):
            try:
                item = boundedjson.loads(line, max_bytes=size, max_depth=MAX_DEPTH, what="the line")
                if not (isinstance(item, list) and len(item) in (1, 2) and isinstance(item[0], str)):
                    raise ValueError("not [key] or [key, value]")
            except (ValueError, FedgeError) as exc:
                why = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc  # the parser's own words
                raise CheckpointError(f"{path}, line {number}: {why}",
                                      hint="restore the state directory or start another --state-dir") from exc
            if len(item) == 2:
                out[item[0]] = item[1]
            else:
                out.pop(item[0], None)
            lg.set_size(item[0], len(line) if len(item) == 2 else None)
        self._logs[stem] = lg
        return out

    def _append(self, lg: _Log, doc: LogDoc, encode: Callable[[Any], str]) -> None:
        lines = []
        for key in doc.changed:
            line = _line(key, doc, encode)
            lines.append(line)
            lg.set_size(key, len(line) if key in doc else None)
        data = b"".join(lines)
        fd = os.open(self.dir / lg.name, os.O_WRONLY | os.O_CREAT, FILE_MODE)
        try:
            if os.fstat(fd).st_size != lg.size:
                os.ftruncate(fd, lg.size)  # lines of a checkpoint that never completed: not part of the log
            if data:
                os.lseek(fd, lg.size, os.SEEK_SET)
                if os.write(fd, data) != len(data):
                    os.ftruncate(fd, lg.size)
                    raise CheckpointError(f"{self.dir / lg.name}: could not append {len(data)} bytes",
                                          hint="check the free space of the state directory's disk")
                os.fsync(fd)
        finally:
            os.close(fd)
        lg.pending = lg.size + len(data)

    def _rewrite(self, stem: str, doc: LogDoc, encode: Callable[[Any], str], cur: _Log | None) -> _Log:
        new = _Log(stem, cur.generation + 1 if cur is not None else 0, 0, owner=doc)
        lines = []
        for key in doc:
            line = _line(key, doc, encode)
            new.set_size(key, len(line))
            lines.append(line)
        data = b"".join(lines)
        write_atomic(self.dir / new.name, data, FILE_MODE)
        new.pending = len(data)
        self._logs[stem] = new
        if cur is not None:
            log.debug("%s: %s rewritten as %s (%d bytes for %d bytes of live lines)", self.dir, cur.name, new.name,
                      len(data), new.live)
        return new


def _line(key: str, doc: LogDoc, encode: Callable[[Any], str]) -> bytes:
    """A log line: ``[key, value]`` for a key set, ``[key]`` for one deleted."""
    if key in doc:
        return f"[{json.dumps(key)},{encode(doc[key])}]\n".encode()
    return f"[{json.dumps(key)}]\n".encode()


def _stem(path: str) -> str:
    """A log's file stem from where its object sits in the state (``strategy.latest``)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", path)
