"""When each device is online, in virtual seconds: always, a seeded on/off process, or a trace file.

An :class:`Availability` answers three questions a scheduler asks about one device at virtual time
``t`` (seconds from the start of the run): is it online (:meth:`~Availability.online`), until when
does its current online spell last (:meth:`~Availability.online_until`), and when does it next come
online (:meth:`~Availability.next_online`). The synchronous virtual clock (:mod:`fedge.fleet.clock`)
uses them per round; an asynchronous scheduler can use the same three per event.

A trace is **untrusted input**: :func:`read_trace` refuses anything it cannot use with an error that
names the file, the line and the fix.
"""

from __future__ import annotations

import csv
import difflib
import io
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.errors import ConfigError

INF = math.inf
TRACE_HEADER = ("device", "online_from", "online_to")
MAX_TRACE_BYTES = 64 * 2**20  # a trace of a million devices' days fits; a larger file is surely not one
MAX_TRACE_ROWS = 2_000_000


class Availability:
    """Always online; the base of the other models (which override the three questions)."""

    def online(self, t: float) -> bool:
        """Whether the device is online at virtual time ``t``."""
        return True

    def online_until(self, t: float) -> float:
        """End of the online spell that contains ``t`` (``t`` itself when offline; inf: for good)."""
        return INF

    def next_online(self, t: float) -> float:
        """``t`` when online at ``t``, else the start of the next online spell (inf: never again)."""
        return t

    def online_share(self, start: float, end: float) -> float:
        """Fraction of [start, end) spent online."""
        return 1.0


@dataclass
class Intervals(Availability):
    """Online during the given half-open spells [from, to), sorted and disjoint; offline otherwise."""

    spells: list[tuple[float, float]] = field(default_factory=list)

    def _spell(self, t: float) -> int:
        """Index of the first spell that ends after ``t`` (len: none)."""
        lo, hi = 0, len(self.spells)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.spells[mid][1] <= t:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def online(self, t: float) -> bool:
        i = self._spell(t)
        return i < len(self.spells) and self.spells[i][0] <= t

    def online_until(self, t: float) -> float:
        i = self._spell(t)
        return self.spells[i][1] if i < len(self.spells) and self.spells[i][0] <= t else t

    def next_online(self, t: float) -> float:
        i = self._spell(t)
        if i == len(self.spells):
            return INF
        return max(t, self.spells[i][0])

    def online_share(self, start: float, end: float) -> float:
        if end <= start:
            return 1.0 if self.online(start) else 0.0
        covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.spells if a < end and b > start)
        return covered / (end - start)


class OnOff(Intervals):
    """Alternating online and offline spells with exponential durations of the given means, seeded.

    The device starts online with probability ``mean_online / (mean_online + mean_offline)`` (the
    process's long-run share), so a fleet's online share is the same at t = 0 as later. Spells are
    drawn lazily, as far as the questions asked reach.
    """

    def __init__(self, mean_online_s: float, mean_offline_s: float, seed: Sequence[int]) -> None:
        super().__init__([])
        if not (mean_online_s > 0 and mean_offline_s >= 0 and math.isfinite(mean_online_s + mean_offline_s)):
            raise ValueError(f"on/off means must be online > 0, offline >= 0, got {mean_online_s}, {mean_offline_s}")
        self.mean_on, self.mean_off = mean_online_s, mean_offline_s
        self._rng = np.random.default_rng(list(seed))
        share = mean_online_s / (mean_online_s + mean_offline_s)
        self._t = 0.0 if self._rng.random() < share else float(self._rng.exponential(mean_offline_s))
        self._extend(0.0)

    def _extend(self, t: float) -> None:
        # at least one spell beyond t, so that next_online(t) and online_until(t) are known
        while not self.spells or self.spells[-1][1] <= t:
            on = float(self._rng.exponential(self.mean_on))
            self.spells.append((self._t, self._t + on))
            self._t += on + (float(self._rng.exponential(self.mean_off)) if self.mean_off > 0 else 0.0)
            if self.mean_off == 0:  # never offline: one spell for good
                self.spells[-1] = (self.spells[-1][0], INF)

    def online(self, t: float) -> bool:
        self._extend(t)
        return super().online(t)

    def online_until(self, t: float) -> float:
        self._extend(t)
        return super().online_until(t)

    def next_online(self, t: float) -> float:
        self._extend(t)
        return super().next_online(t)

    def online_share(self, start: float, end: float) -> float:
        self._extend(end)
        return super().online_share(start, end)


def _number(text: str, column: str, where: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {column} = {text[:40]!r} is not a number",
                          hint="give virtual seconds from the start of the run, e.g. 0 or 3600.5") from None
    if not math.isfinite(x) or x < 0:
        raise ConfigError(f"{where}: {column} = {text[:40]!r} must be a finite number >= 0",
                          hint="give virtual seconds from the start of the run")
    return x


def parse_trace(text: str, devices: Iterable[str], *, source: str) -> dict[str, Intervals]:
    """Each device's online spells from a trace's CSV ``text`` (header ``device,online_from,online_to``).

    Refused, naming the line: a missing or different header, a row without three fields, a device that
    is not in the fleet, a time that is not a finite number >= 0, ``online_from >= online_to``, two
    spells of one device that overlap; and a fleet device with no row at all.
    """
    known = list(devices)
    if len(text) > MAX_TRACE_BYTES:
        raise ConfigError(f"{source}: {len(text):,} bytes is not a plausible trace (limit {MAX_TRACE_BYTES:,})")
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if header is None or tuple(h.strip().lower() for h in header) != TRACE_HEADER:
        raise ConfigError(f"{source}:1: the header must be {','.join(TRACE_HEADER)}, got {','.join(header or [])!r}",
                          hint="one line per online spell: device id, then its start and end in virtual seconds")
    spells: dict[str, list[tuple[float, float, int]]] = {}
    known_set = set(known)
    for n, row in enumerate(rows, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        where = f"{source}:{n}"
        if n > MAX_TRACE_ROWS:
            raise ConfigError(f"{where}: more than {MAX_TRACE_ROWS:,} lines is not a plausible trace")
        if len(row) != 3:
            raise ConfigError(f"{where}: expected 3 fields (device, online_from, online_to), got {len(row)}",
                              hint="quote a device id that holds a comma")
        dev = row[0].strip()
        if dev not in known_set:
            close = difflib.get_close_matches(dev, known, n=1)
            raise ConfigError(f"{where}: device {dev[:64]!r} is not in the fleet",
                              hint=(f"did you mean {close[0]!r}? " if close else "")
                              + f"the fleet's devices: {', '.join(known[:8])}{' ...' if len(known) > 8 else ''}")
        a, b = _number(row[1], "online_from", where), _number(row[2], "online_to", where)
        if a >= b:
            raise ConfigError(f"{where}: online_from = {a:g} is not before online_to = {b:g}",
                              hint="each line is one online spell [online_from, online_to) with from < to")
        spells.setdefault(dev, []).append((a, b, n))
    missing = [d for d in known if d not in spells]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ConfigError(f"{source}: no line for device(s) {', '.join(missing[:8])}{more}",
                          hint="every device of the fleet needs at least one online spell in the trace")
    out: dict[str, Intervals] = {}
    for dev, rows_ in spells.items():
        rows_.sort()
        for (a0, b0, n0), (a1, _, n1) in itertools.pairwise(rows_):
            if a1 < b0:
                raise ConfigError(f"{source}:{n1}: {dev}'s spell from {a1:g} overlaps its spell on line {n0} "
                                  f"({a0:g} to {b0:g})", hint="merge the two lines into one spell")
        out[dev] = Intervals([(a, b) for a, b, _ in rows_])
    return out


def read_trace(path: str | Path, devices: Iterable[str]) -> dict[str, Intervals]:
    """:func:`parse_trace` of the file at ``path``."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_TRACE_BYTES:
            raise ConfigError(f"{p}: {p.stat().st_size:,} bytes is not a plausible trace (limit {MAX_TRACE_BYTES:,})")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the availability trace {p}: {exc.strerror or exc}",
                          hint="[clock] trace is a CSV path, relative to the fleet config") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text", hint="write the trace as a UTF-8 CSV file") from None
    return parse_trace(text, devices, source=str(p))
