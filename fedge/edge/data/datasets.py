"""Real datasets from local files: Fashion-MNIST (IDX), MNIST/CIFAR10 (torchvision), digits.

Nothing is downloaded: a missing dataset is a :class:`DataError` that says where
to get the files.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.common.catalog import CLASS_NAMES, DATASETS, SIGNAL_SHAPES
from fedge.common.preprocess import NORMALIZATION, Normalization, preprocess
from fedge.edge.data.signal_sets import load_signal_split
from fedge.errors import DataError

log = logging.getLogger(__name__)

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# The catalog (names, classes) is fedge.common.catalog: known without loading data.
__all__ = ["DATASETS", "Dataset", "load_dataset", "load_groups", "load_labels"]


@dataclass
class Dataset:
    """Preprocessed arrays: x float32 (N, C, S, S) images or (N, C, T) audio / sensor windows, y int64 (N,)."""

    name: str
    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]
    norm: Normalization

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> Dataset:
        return Dataset(self.name, self.x[idx], self.y[idx], self.classes, self.norm)

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped), the MNIST family's format."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if len(data) < 4:
        raise DataError(f"{path} is too short to be an IDX file")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path} holds {body.size} bytes, its header says {int(np.prod(dims))}")
    return body.reshape(dims)


def _find(data_dir: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (data_dir / name).is_file():
            return data_dir / name
    return None


def load_idx_dataset(name: str, data_dir: Path, train: bool,
                     *, labels_only: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
    """(images, labels) of an IDX data set; with ``labels_only`` the images are not read (None)."""
    prefix = "train" if train else "t10k"
    img = _find(data_dir, f"{prefix}-images-idx3-ubyte")
    lab = _find(data_dir, f"{prefix}-labels-idx1-ubyte")
    if img is None or lab is None:
        how = (
            "install the Debian package: apt-get install dataset-fashion-mnist"
            if name == "fmnist"
            else "put the four IDX files (train/t10k images/labels, .gz or not) in a directory"
        )
        raise DataError(
            f"{name}: no {prefix}-images-idx3-ubyte[.gz] / {prefix}-labels-idx1-ubyte[.gz] in {data_dir}",
            hint=f"{how}, or point --data-dir at a directory holding them",
        )
    y = read_idx(lab).astype(np.int64)
    if labels_only:
        return None, y
    x = read_idx(img)
    if len(x) != len(y):
        raise DataError(f"{img} has {len(x)} images but {lab} has {len(y)} labels")
    return x, y


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    # 8x8 images with values 0..16; scale to the 0..255 range every other set uses.
    return (d.images * (255.0 / 16.0)).astype(np.float32), d.target.astype(np.int64)


def _load_cifar10(data_dir: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    try:
        from torchvision.datasets import CIFAR10

        ds = CIFAR10(str(data_dir), train=train, download=False)
    except RuntimeError as exc:
        raise DataError(
            f"cifar10: no CIFAR-10 python batches under {data_dir}",
            hint="extract cifar-10-python.tar.gz there (torchvision layout), or point --data-dir at it",
        ) from exc
    return np.asarray(ds.data), np.asarray(ds.targets, dtype=np.int64)


def _load_raw(name: str, train: bool, data_dir: str | os.PathLike[str] | None, digits_test_fraction: float,
              seed: int, labels_only: bool) -> tuple[np.ndarray | None, np.ndarray]:
    """(raw images or None with ``labels_only``, labels) of one split."""
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}", hint=f"use one of {', '.join(DATASETS)}")
    if name == "digits":
        x, y = _load_digits()
        rng = np.random.default_rng(seed)
        test_mask = np.zeros(len(y), dtype=bool)
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            test_mask[idx[: round(len(idx) * digits_test_fraction)]] = True
        keep = ~test_mask if train else test_mask
        return x[keep], y[keep]
    if name == "fmnist":
        return load_idx_dataset(name, Path(data_dir) if data_dir else FMNIST_DIR, train, labels_only=labels_only)
    if name == "mnist":
        if data_dir is None:
            raise DataError("mnist needs --data-dir", hint="point it at the four MNIST IDX files")
        d = Path(data_dir)
        raw = d / "MNIST" / "raw"  # torchvision's layout
        return load_idx_dataset(name, raw if raw.is_dir() else d, train, labels_only=labels_only)
    if data_dir is None:
        raise DataError("cifar10 needs --data-dir", hint="point it at the torchvision CIFAR-10 root")
    return _load_cifar10(Path(data_dir), train)  # torchvision reads images and labels together


def load_dataset(name: str, *, train: bool, data_dir: str | os.PathLike[str] | None = None,
                 digits_test_fraction: float = 0.25, seed: int = 0, image_size: int = 32,
                 channels: int = 1) -> Dataset:
    """Load a split of ``name`` and run it through the shared preprocessing.

    ``digits`` has no official split: a fixed stratified ``digits_test_fraction``
    is held out as its global test set. ``image_size``/``channels``: the model's input
    (``[data] image_size``), to which every image is resized (grey repeated for RGB models). A 1-D data set
    (:data:`fedge.common.catalog.SIGNAL_SHAPES`) keeps its own shape and ignores both.
    """
    if name in SIGNAL_SHAPES:
        split = load_signal_split(name, train=train, data_dir=data_dir, seed=seed)
        log.info("loaded %s %s: %d samples", name, "train" if train else "test", len(split.y))
        return Dataset(name, split.x, split.y, CLASS_NAMES[name], split.norm)
    x, y = _load_raw(name, train, data_dir, digits_test_fraction, seed, labels_only=False)
    assert x is not None  # images were asked for
    norm = dataclasses.replace(NORMALIZATION[name], size=image_size, channels=channels)
    log.info("loaded %s %s: %d images", name, "train" if train else "test", len(y))
    return Dataset(name, preprocess(x, norm), y, CLASS_NAMES[name], norm)


def load_labels(name: str, *, train: bool, data_dir: str | os.PathLike[str] | None = None,
                digits_test_fraction: float = 0.25, seed: int = 0) -> np.ndarray:
    """The labels of a split of ``name`` alone (int64, the order :func:`load_dataset` gives), without
    preprocessing images: what partitioning a fleet needs. IDX sets read only their label file."""
    if name in SIGNAL_SHAPES:
        return load_signal_split(name, train=train, data_dir=data_dir, seed=seed).y
    return _load_raw(name, train, data_dir, digits_test_fraction, seed, labels_only=True)[1]


def load_groups(name: str, *, train: bool, data_dir: str | os.PathLike[str] | None = None,
                seed: int = 0) -> np.ndarray:
    """Each sample's speaker or subject (the order :func:`load_dataset` gives): what ``[partition] kind =
    "group"`` splits by. Image data sets have none."""
    if name not in SIGNAL_SHAPES:
        raise DataError(f"{name} has no speakers or subjects to partition by",
                        hint='use kind = "iid", "dirichlet" or "shards", or a data set of '
                             f"{', '.join(SIGNAL_SHAPES)}")
    return load_signal_split(name, train=train, data_dir=data_dir, seed=seed).groups
