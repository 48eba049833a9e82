"""The 1-D data sets by name (``[run] dataset``): audio clips and sensor windows, with each sample's group.

* ``speech_commands``: a Speech Commands folder (``[run] data_dir``), twelve classes, 1-s clips
  (:mod:`fedge.edge.data.speech`); the test set is ``testing_list.txt``;
* ``espeak_kws``: the same layout, spoken by espeak-ng into ``data_dir`` (default
  ``$XDG_CACHE_HOME/fedge/espeak-kws``) on first use (:mod:`fedge.edge.data.espeak`); its test speakers are
  never heard in training;
* ``uci_har``: UCI HAR's inertial signals (``data_dir``), (9, 128) windows (:mod:`fedge.edge.data.sensors`).

A sample's group is its speaker or subject: ``[partition] kind = "group"`` puts each group on one device.
Splits are read once per process (a fleet asks for labels, groups and samples separately) and kept.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.common.catalog import SIGNAL_SHAPES
from fedge.common.preprocess import Normalization, signal_normalization
from fedge.errors import DataError


@dataclass(frozen=True)
class SignalSplit:
    """One split: x float32 (N, channels, samples), y int64 (N,), each sample's group, the normalization."""

    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray
    norm: Normalization


def default_espeak_dir() -> Path:
    """Where ``espeak_kws`` is made when ``[run] data_dir`` is not set."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fedge" / "espeak-kws"


def _need_dir(name: str, data_dir: str | os.PathLike[str] | None, hint: str) -> Path:
    if data_dir is None:
        raise DataError(f"{name} needs [run] data_dir (--data-dir)", hint=hint)
    return Path(data_dir)


@functools.lru_cache(maxsize=4)
def _load(name: str, train: bool, data_dir: str | None, seed: int) -> SignalSplit:
    channels, samples = SIGNAL_SHAPES[name]
    if name == "uci_har":
        from fedge.edge.data.sensors import load_uci_har

        root = _need_dir(name, data_dir, "point it at the unpacked 'UCI HAR Dataset' folder")
        har = load_uci_har(root, split="train" if train else "test")
        return SignalSplit(har.x, har.y, har.subjects, signal_normalization("series", channels, samples))
    from fedge.edge.data.speech import BACKGROUND, load_speech_commands

    if name == "espeak_kws":
        from fedge.edge.data.espeak import make_keyword_set

        root = make_keyword_set(data_dir or default_espeak_dir())
    else:
        root = _need_dir(name, data_dir, "point it at a Speech Commands folder (docs/audio.md)")
    s = load_speech_commands(root, split="train" if train else "test", seed=seed)
    # silence is cut from recordings every split shares, nobody's voice: group "" (by_group deals those out
    # evenly) rather than one "speaker" whose device would hold all of it
    groups = np.array(["" if g == BACKGROUND else g for g in s.speakers], dtype=object)
    return SignalSplit(s.x[:, None, :], s.y, groups, signal_normalization("audio", channels, samples))


def load_signal_split(name: str, *, train: bool, data_dir: str | os.PathLike[str] | None = None,
                      seed: int = 0) -> SignalSplit:
    """One split of the 1-D data set ``name`` (read once per process, then shared: do not write into it)."""
    if name not in SIGNAL_SHAPES:
        raise DataError(f"{name!r} is not a 1-D data set", hint=f"use one of {', '.join(SIGNAL_SHAPES)}")
    split = _load(name, train, None if data_dir is None else str(data_dir), seed)
    if len(split.y) == 0:
        raise DataError(f"{name} ({data_dir}): the {'training' if train else 'test'} split holds no sample",
                        hint="check the folder's layout (docs/audio.md, docs/sensors.md)")
    return split
