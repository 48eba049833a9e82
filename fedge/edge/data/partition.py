"""Fleet partitioners: deterministic by seed, each returns one index array per device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedge.errors import DataError

PARTITIONERS = ("iid", "dirichlet", "shards")


def iid_fraction(labels: np.ndarray, n_devices: int, fraction: float, seed: int) -> list[np.ndarray]:
    """The GeFL protocol: a random ``fraction`` of the set, split evenly (600 FMNIST images
    each for K = 10, fraction 0.1)."""
    if not 0 < fraction <= 1:
        raise DataError(f"iid fraction must be in (0, 1], got {fraction}")
    rng = np.random.default_rng(seed)
    take = int(len(labels) * fraction)
    per = take // n_devices
    if per == 0:
        raise DataError(f"fraction {fraction} of {len(labels)} samples leaves nothing for {n_devices} devices")
    idx = rng.permutation(len(labels))[: per * n_devices]
    return [np.sort(idx[i * per : (i + 1) * per]) for i in range(n_devices)]


def dirichlet(labels: np.ndarray, n_devices: int, alpha: float, seed: int,
              min_size: int = 10, fraction: float = 1.0, max_tries: int = 100) -> list[np.ndarray]:
    """Label skew: each class is spread over devices with proportions ~ Dir(alpha).

    Redraws until every device has at least ``min_size`` samples (the usual
    HtFLlib/FedLab convention), so tiny alphas do not leave empty devices.
    """
    if alpha <= 0:
        raise DataError(f"dirichlet alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    pool = rng.permutation(len(labels))[: int(len(labels) * fraction)]
    classes = np.unique(labels[pool])
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(n_devices)]
        for c in classes:
            idx = rng.permutation(pool[labels[pool] == c])
            p = rng.dirichlet(np.full(n_devices, alpha))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for dev, chunk in enumerate(np.split(idx, cuts)):
                parts[dev].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise DataError(
        f"could not give each of {n_devices} devices {min_size} samples with alpha={alpha}",
        hint="use more data, fewer devices, a larger alpha or a smaller min_size",
    )


def shards(labels: np.ndarray, n_devices: int, shards_per_device: int, seed: int,
           fraction: float = 1.0) -> list[np.ndarray]:
    """McMahan et al.'s pathological split: sort by label, cut into shards, deal them out."""
    rng = np.random.default_rng(seed)
    pool = rng.permutation(len(labels))[: int(len(labels) * fraction)]
    order = pool[np.argsort(labels[pool], kind="stable")]
    n_shards = n_devices * shards_per_device
    if n_shards > len(order):
        raise DataError(f"{n_shards} shards from {len(order)} samples: too many devices or shards")
    pieces = np.array_split(order, n_shards)
    perm = rng.permutation(n_shards)
    return [
        np.sort(np.concatenate([pieces[j] for j in perm[i * shards_per_device : (i + 1) * shards_per_device]]))
        for i in range(n_devices)
    ]


def by_group(groups: np.ndarray, n_devices: int, seed: int) -> list[np.ndarray]:
    """The natural non-IID split: every group (a speaker, a subject) lives on exactly one device.

    Groups, in a seeded random order, go largest first to the device holding fewest samples so far, so
    shares stay as even as whole groups allow. A sample whose group is ``""`` belongs to nobody (keyword
    spotting's silence, cut from noise every device hears): those are dealt out evenly, in a seeded order.
    """
    groups = np.asarray(groups)
    nobody = np.flatnonzero(groups == "")
    if len(nobody):
        owned = np.flatnonzero(groups != "")
        parts = [owned[p] for p in by_group(groups[owned], n_devices, seed)]
        dealt = np.random.default_rng([seed, 1]).permutation(nobody)
        return [np.sort(np.concatenate([p, dealt[d::n_devices]])) for d, p in enumerate(parts)]
    names, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    if len(names) < n_devices:
        raise DataError(f"{len(names)} speakers/subjects cannot be split over {n_devices} devices",
                        hint="use fewer devices, or a label-based partition (iid, dirichlet)")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(names))
    order = order[np.argsort(-counts[order], kind="stable")]
    load = np.zeros(n_devices, dtype=np.int64)
    owner = np.empty(len(names), dtype=np.int64)
    for g in order:
        owner[g] = int(np.argmin(load))
        load[owner[g]] += counts[g]
    return [np.flatnonzero(owner[inverse] == d) for d in range(n_devices)]


@dataclass(frozen=True)
class DeviceSplit:
    """One device's local train, local test and validation indices (into the training set)."""

    train: np.ndarray
    test: np.ndarray
    val: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Held out of ``train`` to choose the model the device ships (:mod:`fedge.edge.best`); never a test split."""


def local_splits(parts: list[np.ndarray], test_fraction: float, seed: int) -> list[DeviceSplit]:
    """Hold out ``test_fraction`` of each device's share as its local test split."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for p in parts:
        perm = rng.permutation(p)
        n_test = round(len(p) * test_fraction)
        out.append(DeviceSplit(np.sort(perm[n_test:]), np.sort(perm[:n_test])))
    return out


MIN_TRAIN_FOR_VAL = 4  # a share this small keeps every sample for training: nothing to validate on


def validation_folds(splits: list[DeviceSplit], fraction: float, seed: int) -> list[DeviceSplit]:
    """Hold out ``fraction`` of each device's training indices (at least one) as its validation fold.

    Drawn from the training share only, so a fold never overlaps the device's local test split or the
    global test set; ``fraction = 0`` returns ``splits`` unchanged (the published protocols train on
    every sample of the share).
    """
    if fraction <= 0:
        return splits
    rng = np.random.default_rng(seed + 2)
    out = []
    for s in splits:
        perm = rng.permutation(s.train)
        n_val = max(1, round(len(perm) * fraction)) if len(perm) >= MIN_TRAIN_FOR_VAL else 0
        out.append(DeviceSplit(np.sort(perm[n_val:]), s.test, np.sort(perm[:n_val])))
    return out


def class_histogram(labels: np.ndarray, idx: np.ndarray, num_classes: int) -> np.ndarray:
    return np.bincount(labels[idx], minlength=num_classes)
