"""Multichannel sensor windows: UCI HAR's on-disk layout, and a folder of ``.npy`` / ``.csv`` windows per class.

**UCI HAR** (Anguita et al. 2013; 30 subjects, a waist-worn phone's accelerometer and gyroscope at 50 Hz,
2.56-s windows of 128 samples with 50 % overlap, six activities)::

    UCI HAR Dataset/
      train/  y_train.txt  subject_train.txt  Inertial Signals/body_acc_x_train.txt ... (9 files)
      test/   y_test.txt   subject_test.txt   Inertial Signals/..._test.txt

Each signal file holds one window per line, 128 numbers separated by spaces; ``y_*.txt`` one label 1..6 per
line, ``subject_*.txt`` one subject id per line. The nine signals become the channels of one (9, 128)
window, in :data:`HAR_SIGNALS` order; labels become 0..5 (:data:`fedge.common.catalog.HAR_CLASSES`). A
malformed file (a row of another length, a value that is not a finite number, a missing file, files of
different lengths) refuses the whole split, naming the file and line: the data set is read as a whole.

**A folder of windows** (a device's own recordings)::

    root/walking/s01_nohash_0.csv     one file per window, T rows (time) x C columns (channels)
    root/walking/s01_nohash_1.npy     the same as a (T, C) array
    root/sitting/...

The subject is the name before ``_nohash_`` (as a Speech Commands speaker). Here a bad file is skipped and
reported with its reason (wrong shape, NaN, unreadable), never fatal: a device keeps training on the rest.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.common.catalog import HAR_CLASSES
from fedge.edge.data.speech import speaker_of
from fedge.errors import DataError
from fedge.runtime.signals import WINDOW_SUFFIXES, read_window

log = logging.getLogger(__name__)

HAR_WINDOW = 128
HAR_SIGNALS = ("body_acc_x", "body_acc_y", "body_acc_z", "body_gyro_x", "body_gyro_y", "body_gyro_z",
               "total_acc_x", "total_acc_y", "total_acc_z")


@dataclass
class SensorSet:
    """Windows x float32 (N, channels, window), labels y int64 (N,), the subject of each window, and (for a
    folder) the files skipped and why."""

    name: str
    x: np.ndarray
    y: np.ndarray
    subjects: np.ndarray
    classes: tuple[str, ...]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.y)


def _har_dir(root: Path, split: str) -> Path:
    for base in (root, root / "UCI HAR Dataset"):
        if (base / split).is_dir():
            return base / split
    raise DataError(f"{root}: no {split}/ folder (nor 'UCI HAR Dataset/{split}/')",
                    hint="point it at the unpacked UCI HAR Dataset folder (UCI HAR cannot be downloaded by fedge)")


def _read_rows(path: Path, width: int | None) -> np.ndarray:
    """A whitespace-separated text file as float64 rows, each of ``width`` numbers (None: one per line)."""
    if not path.is_file():
        raise DataError(f"{path}: missing", hint="UCI HAR's layout has it; re-copy the data set")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        want = width or 1
        if len(fields) != want:
            raise DataError(f"{path}, line {n}: {len(fields)} values, expected {want}",
                            hint="the file is cut or not UCI HAR's; re-copy it")
        try:
            row = np.array(fields, dtype=np.float64)
        except ValueError as exc:
            raise DataError(f"{path}, line {n}: not a number ({exc})", hint="re-copy the file") from exc
        if not np.isfinite(row).all():
            raise DataError(f"{path}, line {n}: NaN or infinite value", hint="re-copy the file, or drop that window")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: empty")
    return np.stack(rows)


def load_uci_har(root: str | os.PathLike[str], *, split: str = "train") -> SensorSet:
    """One split (``train`` or ``test``) of UCI HAR: (N, 9, 128) windows, labels 0..5, subjects."""
    if split not in ("train", "test"):
        raise DataError(f"UCI HAR has no {split!r} split", hint="use train or test")
    d = _har_dir(Path(root), split)
    y = _read_rows(d / f"y_{split}.txt", None)[:, 0]
    subjects = _read_rows(d / f"subject_{split}.txt", None)[:, 0]
    signals = [_read_rows(d / "Inertial Signals" / f"{s}_{split}.txt", HAR_WINDOW) for s in HAR_SIGNALS]
    lengths = {f"y_{split}.txt": len(y), f"subject_{split}.txt": len(subjects),
               **{f"{s}_{split}.txt": len(a) for s, a in zip(HAR_SIGNALS, signals, strict=True)}}
    if len(set(lengths.values())) > 1:
        raise DataError(f"{d}: the files hold different numbers of windows: {lengths}",
                        hint="every file has one line per window; re-copy the split")
    bad = sorted({int(v) for v in y if v != int(v) or not 1 <= v <= len(HAR_CLASSES)})
    if bad:
        raise DataError(f"{d / f'y_{split}.txt'}: labels {bad} outside 1..{len(HAR_CLASSES)}")
    x = np.stack(signals, axis=1).astype(np.float32)  # (N, 9, 128)
    log.info("loaded UCI HAR %s from %s: %d windows of %d subjects", split, d, len(y), len(np.unique(subjects)))
    return SensorSet(f"uci_har:{split}", x, y.astype(np.int64) - 1,
                     np.array([f"subject{int(s)}" for s in subjects], dtype=object), HAR_CLASSES)


def load_window_folder(root: str | os.PathLike[str], classes: tuple[str, ...], *, window: int,
                       channels: int) -> SensorSet:
    """Every window of the class folders of ``root`` (folders named in ``classes``; labels by that order).

    Unreadable or misshapen windows, other files and empty class folders are logged and listed in
    ``skipped``; a folder of a class not in ``classes`` is skipped and reported too."""
    base = Path(root)
    if not base.is_dir():
        raise DataError(f"{base}: no such directory", hint="point it at a folder of class folders of windows")
    xs, ys, subjects, skipped = [], [], [], []
    for folder in sorted(d for d in base.iterdir() if d.is_dir() and not d.name.startswith(".")):
        if folder.name not in classes:
            skipped.append((str(folder), f"not one of the fleet's classes {list(classes)}"))
            continue
        files = sorted(f for f in folder.iterdir() if f.is_file())
        wins = [f for f in files if f.suffix.lower() in WINDOW_SUFFIXES]
        skipped += [(str(f), "not a .npy or .csv window") for f in files if f not in wins]
        if not wins:
            skipped.append((str(folder), "class folder holds no window"))
        for f in wins:
            try:
                xs.append(read_window(f, window, channels))
            except DataError as exc:
                skipped.append((str(f), exc.message.removeprefix(f"{f}: ")))
                continue
            ys.append(classes.index(folder.name))
            subjects.append(speaker_of(f.name))
    for path, reason in skipped:
        log.warning("sensor windows: skipped %s: %s", path, reason)
    x = np.stack(xs) if xs else np.zeros((0, channels, window), np.float32)
    return SensorSet(f"windows:{base}", x, np.array(ys, dtype=np.int64), np.array(subjects, dtype=object),
                     classes, skipped)
