"""TensorBoard event files of the per-round scalars (``fedge coordinator run --tensorboard DIR``).

Written without TensorFlow, torch or protobuf: an event file is a sequence of records (length, its
masked CRC-32C, the bytes, their masked CRC-32C), each an ``Event`` protocol buffer, and the few fields
a scalar needs are encoded by hand below (wall_time = 1, step = 2, file_version = 3, summary = 5;
``Summary.value`` = 1 with ``tag`` = 1 and ``simple_value`` = 2). TensorBoard's own reader reads them
(``tests/test_tensorboard.py``). One file per coordinator process; a resumed run appends a new file to
the same directory, and TensorBoard joins them by step.

Scalars, step = the round: ``fleet/accuracy`` and ``fleet/accuracy_local`` (means over the accepted
devices), ``profile/NAME/accuracy``, ``device/ID/accuracy`` (fleets of at most 40 devices),
``round/seconds``, ``round/aggregation_seconds``, ``round/accepted``, ``round/missing``,
``round/refused``, ``traffic/bytes_up``, ``traffic/bytes_down``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from pathlib import Path

from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.report import RoundReport
from fedge.observe.monitor import DEVICE_SERIES_LIMIT

log = logging.getLogger(__name__)


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # the Castagnoli polynomial, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """One ``Event`` message."""
    out = bytearray(b"\x09" + struct.pack("<d", wall_time))  # field 1, double
    out += b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF)  # field 2, int64
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    return bytes(out)


class TensorBoardWriter(EngineObserver):
    """Appends one event per finished round to ``DIR/events.out.tfevents.TIME.HOST.PID``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.fedge"
        with self.path.open("ab") as f:
            f.write(record(event(time.time(), 0, file_version="brain.Event:2")))
        self._profiles: dict[str, str] = {}

    def profiles(self, profile_of: dict[str, str]) -> None:
        """Device id -> profile, for the per-profile accuracies."""
        self._profiles = dict(profile_of)

    def scalars(self, report: RoundReport, aggregation_s: float) -> dict[str, float]:
        accs = {d: m["acc_global"] for d, m in report.metrics.items() if isinstance(m.get("acc_global"), int | float)}
        local = [m["acc_local"] for m in report.metrics.values() if isinstance(m.get("acc_local"), int | float)]
        out: dict[str, float] = {
            "round/seconds": report.seconds, "round/aggregation_seconds": aggregation_s,
            "round/accepted": len(report.accepted), "round/missing": len(report.missing),
            "round/refused": sum(report.rejected.values()),
            "traffic/bytes_up": report.total_bytes()[0], "traffic/bytes_down": report.total_bytes()[1],
        }
        acc_sum, acc_n = report.metric_values("acc_global")  # compact partials included
        if acc_n:
            out["fleet/accuracy"] = acc_sum / acc_n
        if local:
            out["fleet/accuracy_local"] = sum(local) / len(local)
        by_profile: dict[str, list[float]] = {}
        for d, a in accs.items():
            by_profile.setdefault(self._profiles.get(d, "unknown"), []).append(a)
        for p, values in sorted(by_profile.items()):
            out[f"profile/{p}/accuracy"] = sum(values) / len(values)
        if len(accs) <= DEVICE_SERIES_LIMIT:
            for d, a in sorted(accs.items()):
                out[f"device/{d}/accuracy"] = a
        return out

    def round_finished(self, report: RoundReport, aggregation_s: float) -> None:
        data = record(event(time.time(), report.round, scalars=self.scalars(report, aggregation_s)))
        with self.path.open("ab") as f:
            f.write(data)
