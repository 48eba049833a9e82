"""A device's own data: an ImageFolder-style directory (or ``.npz`` files) turned into fedge datasets.

The same folder of WAV clips (``[data] kind = "audio"``) or of ``.csv`` / ``.npy`` sensor windows
(``kind = "series"``) is read with the runtime's readers (:mod:`fedge.runtime.signals`); there a file that
cannot be read or has the wrong shape (truncated WAV, NaN, another window length) is skipped and reported,
never fatal, as are other files in a class folder.

Layout (the torchvision ImageFolder convention)::

    DIR/cat/0001.png
    DIR/cat/0002.jpg
    DIR/dog/...
    DIR/extra.npz          optional: arrays ``x`` (raw pixels) and ``y`` (label ids of [data] classes)

Folder names map to label ids through the fleet's ``[data] classes``, so every
device of a fleet agrees on them. Images go through
:func:`fedge.runtime.inputs.read_image` and :func:`fedge.runtime.inputs.prepare`,
the code path ``fedge infer`` uses, so training sees inputs prepared exactly as
the deployed model will.

:meth:`LocalData.scan` is called again before every round: files added since
the last scan are converted (converted files are cached by path, size and
modification time), files that disappeared drop out. A file that cannot be
read (corrupt, truncated, still being written) is skipped and reported in
:attr:`Scan.skipped`; it is tried again at the next scan if it changed. A file
that reads but cannot become a fleet input (an unknown class folder, a
non-image file in a class folder, 32-bit float pixels, a 1x1 image, an .npz
with bad labels) is a :class:`~fedge.errors.DataError` naming the path and the
fix: the device's owner has to act, retrying will not help.

The local test split is stratified and seeded: within each class, files are
ranked by a keyed hash of their relative path and the first
``round(n * test_fraction)`` are test images (at least one image of a class stays
in training). The split depends only on the seed and the set of files, not on
the order they were found in.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.common.preprocess import Normalization
from fedge.edge.data.datasets import Dataset
from fedge.errors import DataError, PayloadError
from fedge.runtime.inputs import IMAGE_SUFFIXES, prepare, prepare_signal, read_image
from fedge.runtime.signals import AUDIO_SUFFIXES, WINDOW_SUFFIXES, fit_clip, read_wav, read_window

log = logging.getLogger(__name__)

NPZ_SUFFIX = ".npz"


@dataclass
class Scan:
    """One look at the data folder: the train and local-test sets and what was skipped."""

    train: Dataset
    test: Dataset
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why
    new: int = 0  # images converted by this scan (not cached from an earlier one)

    @property
    def num_images(self) -> int:
        return len(self.train) + len(self.test)

    def summary(self) -> dict[str, int]:
        """Counts only (never paths or pixels): what the device may report to the coordinator."""
        return {"train": len(self.train), "test": len(self.test), "skipped": len(self.skipped)}


@dataclass
class _Entry:
    stamp: tuple[int, int]  # (size, mtime_ns)
    x: np.ndarray | None  # (n, C, S, S) model inputs; None: skipped
    y: np.ndarray | None
    why: str = ""


class LocalData:
    """The data folder ``root`` of one device, for a fleet with ``classes`` and input ``norm``."""

    def __init__(self, root: str | os.PathLike[str], classes: tuple[str, ...], norm: Normalization, *,
                 test_fraction: float = 0.2, seed: int = 0, name: str = "local") -> None:
        if not classes:
            raise DataError("the fleet config names no classes for the devices' own data",
                            hint="add [data] classes = [\"name1\", \"name2\", ...] to the fleet config "
                                 "(folder names, in label order)")
        self.root = Path(root)
        self.classes = tuple(classes)
        self.norm = norm
        self.test_fraction = test_fraction
        self.seed = seed
        self.name = name
        self._label = {c: i for i, c in enumerate(self.classes)}
        self._cache: dict[Path, _Entry] = {}

    # -- finding files -------------------------------------------------------------------

    def _files(self) -> list[tuple[Path, int | None]]:
        """(file, label or None for .npz) of every data file; unknown class folders are errors."""
        root = self.root
        if root.is_file() and root.suffix.lower() == NPZ_SUFFIX:
            return [(root, None)]
        if not root.is_dir():
            raise DataError(f"{root}: no such data folder",
                            hint="point --data at a folder with one sub-folder per class (or at an .npz file)")
        out: list[tuple[Path, int | None]] = []
        for entry in sorted(root.iterdir()):
            if entry.name.startswith(".") or (self.norm.kind == "audio" and entry.name.startswith("_")):
                continue  # hidden files: editors, file managers, partial uploads; Speech Commands' _background_noise_
            if entry.is_file():
                if entry.suffix.lower() == NPZ_SUFFIX:
                    out.append((entry, None))
                    continue
                raise DataError(f"{entry}: a file at the top of the data folder",
                                hint=f"put images in a sub-folder named after their class "
                                     f"({', '.join(self.classes[:6])}), or use an .npz with x and y")
            if not entry.is_dir():
                continue
            if entry.name not in self._label:
                raise DataError(f"{entry}: class folder {entry.name!r} is not one of the fleet's classes",
                                hint=f"rename or remove it, or add it to [data] classes in the fleet config "
                                     f"(known: {', '.join(self.classes)})")
            label = self._label[entry.name]
            for f in sorted(entry.rglob("*")):
                if any(part.startswith(".") for part in f.relative_to(entry).parts) or not f.is_file():
                    continue
                if self.norm.kind != "image":
                    out.append((f, label))  # a file of another kind is skipped and reported by _convert_signal
                    continue
                if f.suffix.lower() not in IMAGE_SUFFIXES:
                    raise DataError(f"{f}: not an image file ({f.suffix or 'no suffix'})",
                                    hint=f"remove it from the class folder; images must be one of "
                                         f"{', '.join(IMAGE_SUFFIXES)}")
                out.append((f, label))
        return out

    # -- converting ----------------------------------------------------------------------

    def _convert_image(self, path: Path, label: int) -> _Entry:
        stamp = _stamp(path)
        try:
            pixels, full_scale = read_image(path, self.norm.channels)
        except PayloadError as exc:
            if isinstance(exc.__cause__, OSError):  # corrupt, truncated, still being written: skip, retry later
                return _Entry(stamp, None, None, exc.message)
            # A readable image of a kind no fleet input is made of (32-bit float or integer pixels).
            raise DataError(exc.message, hint=f"{exc.hint or 'convert it'}, or remove it from the folder") from exc
        try:
            x = prepare(pixels, self.norm, max_value=full_scale, what=str(path))  # (H, W) or (H, W, 3): one image
        except PayloadError as exc:
            raise DataError(f"{path}: cannot be converted to the fleet's {self.norm.channels}x{self.norm.size}x"
                            f"{self.norm.size} input: {exc.message}",
                            hint="remove the file or replace it with a normal photo or scan") from exc
        return _Entry(stamp, x, np.array([label], dtype=np.int64))

    def _convert_signal(self, path: Path, label: int) -> _Entry:
        """A WAV clip or a sensor window; unreadable or misshapen ones are skipped with their reason."""
        stamp = _stamp(path)
        n = self.norm
        suffixes = AUDIO_SUFFIXES if n.kind == "audio" else WINDOW_SUFFIXES
        if path.suffix.lower() not in suffixes:
            return _Entry(stamp, None, None, f"not a {' or '.join(suffixes)} file ({n.kind} data)")
        try:
            x = (fit_clip(read_wav(path), n.size)[None] if n.kind == "audio"
                 else read_window(path, n.size, n.channels))  # (channels, samples)
        except DataError as exc:
            return _Entry(stamp, None, None, exc.message.removeprefix(f"{path}: "))
        return _Entry(stamp, x[None], np.array([label], dtype=np.int64))

    def _convert_npz(self, path: Path) -> _Entry:
        stamp = _stamp(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                if "x" not in z or "y" not in z:
                    raise DataError(f"{path}: an .npz data file needs arrays 'x' and 'y' (has {sorted(z.files)})",
                                    hint="save it with np.savez(path, x=images, y=label_ids)")
                raw, y = np.asarray(z["x"]), np.asarray(z["y"])
        except (OSError, ValueError, EOFError) as exc:
            return _Entry(stamp, None, None, f"not a readable .npz file ({exc})")
        if y.ndim != 1 or len(y) != len(raw) or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: y must be one integer label per image (x {raw.shape}, y {y.shape} {y.dtype})",
                            hint="y holds label ids: positions in [data] classes")
        bad = (y < 0) | (y >= len(self.classes))
        if bad.any():
            raise DataError(f"{path}: label {int(y[bad][0])} is not a class id (the fleet has "
                            f"{len(self.classes)} classes)", hint="y holds positions in [data] classes: 0, 1, ...")
        if self.norm.kind != "image":  # clips or windows as the model takes them: (N, channels, samples)
            try:
                return _Entry(stamp, prepare_signal(raw, self.norm, what=str(path)), y.astype(np.int64))
            except PayloadError as exc:
                raise DataError(exc.message, hint=f"x holds {self.norm.kind} inputs of shape (N, "
                                                  f"{', '.join(map(str, self.norm.sample_shape))})") from exc
        # Raw pixels 0..255; floating-point arrays in [0, 1] are taken as already scaled.
        top = 1.0 if np.issubdtype(raw.dtype, np.floating) and raw.size and float(raw.max()) <= 1.0 else 255.0
        try:
            x = prepare(raw, self.norm, max_value=top, what=str(path))
        except PayloadError as exc:  # the runtime's hints speak of its API (max_value=...): say it for an .npz
            raise DataError(exc.message, hint="x holds raw images, (N, H, W) or (N, H, W, C): 0..255 pixels "
                                              "(uint8; 16-bit scans divided by 257) or floats scaled to 0..1") from exc
        return _Entry(stamp, x, y.astype(np.int64))

    # -- the scan ------------------------------------------------------------------------

    def scan(self) -> Scan:
        """Read the folder now (new files converted, cached ones reused) and split it."""
        files = self._files()
        cache: dict[Path, _Entry] = {}
        new = 0
        for path, label in files:
            old = self._cache.get(path)
            try:
                stamp = _stamp(path)
            except OSError:
                continue  # removed between listing and reading
            if old is not None and old.stamp == stamp:
                cache[path] = old
                continue
            if label is None:
                entry = self._convert_npz(path)
            elif self.norm.kind != "image":
                entry = self._convert_signal(path, label)
            else:
                entry = self._convert_image(path, label)
            if entry.x is not None:
                new += len(entry.x)
            cache[path] = entry
        self._cache = cache
        skipped = {str(p): e.why for p, e in cache.items() if e.x is None}
        for p, why in skipped.items():
            log.warning("%s: skipped: %s", p, why)
        keys: list[str] = []
        xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        for path, e in cache.items():
            if e.x is None or e.y is None:
                continue
            rel = str(path.relative_to(self.root)) if path != self.root else path.name
            keys += [rel] if len(e.x) == 1 and path.suffix.lower() != NPZ_SUFFIX else [
                f"{rel}[{i}]" for i in range(len(e.x))]
            xs.append(e.x)
            ys.append(e.y)
        if not keys:
            what = f"{len(skipped)} unreadable files" if skipped else "no images"
            raise DataError(f"{self.root}: the data set is empty ({what})",
                            hint="put images in one sub-folder per class: "
                                 f"{self.root}/{self.classes[0]}/image.png, ...")
        x = np.concatenate(xs)
        y = np.concatenate(ys)
        test = self._test_mask(keys, y)
        return Scan(self._dataset(x[~test], y[~test]), self._dataset(x[test], y[test]), skipped, new)

    def _dataset(self, x: np.ndarray, y: np.ndarray) -> Dataset:
        return Dataset(self.name, x, y, self.classes, self.norm)

    def _test_mask(self, keys: list[str], y: np.ndarray) -> np.ndarray:
        """Per class, the ``round(n * test_fraction)`` keys of lowest seeded hash (one stays in train)."""
        salt = str(self.seed).encode()
        rank = np.array([int.from_bytes(hashlib.blake2b(k.encode(), key=salt, digest_size=8).digest(), "big")
                         for k in keys], dtype=np.uint64)
        mask = np.zeros(len(keys), dtype=bool)
        for c in np.unique(y):
            idx = np.flatnonzero(y == c)
            n_test = min(round(len(idx) * self.test_fraction), len(idx) - 1)
            if n_test > 0:
                mask[idx[np.argsort(rank[idx], kind="stable")[:n_test]]] = True
        return mask


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
