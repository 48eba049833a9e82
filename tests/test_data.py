"""Datasets, the shared preprocessing, and partitioners."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from fedge.common.preprocess import NORMALIZATION, preprocess, resize_bilinear
from fedge.edge.data.datasets import load_dataset, read_idx
from fedge.edge.data.partition import dirichlet, iid_fraction, local_splits, shards
from fedge.errors import DataError, PayloadError


def test_resize_matches_torch_bilinear() -> None:
    x = np.random.default_rng(0).random((3, 1, 28, 28)).astype(np.float32)
    ours = resize_bilinear(x, 32)
    ref = torch.nn.functional.interpolate(torch.from_numpy(x), size=(32, 32), mode="bilinear", align_corners=False)
    np.testing.assert_allclose(ours, ref.numpy(), atol=1e-5)


def test_preprocess_layouts_agree_and_normalize() -> None:
    img = np.random.default_rng(1).integers(0, 256, (2, 28, 28)).astype(np.uint8)
    norm = NORMALIZATION["fmnist"]
    a = preprocess(img, norm)
    b = preprocess(img[:, None], norm)
    c = preprocess(img[..., None], norm)
    assert a.shape == (2, 1, 32, 32) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    zero = preprocess(np.zeros((1, 28, 28)), norm)
    assert np.allclose(zero, -norm.mean / norm.std)


def test_preprocess_rejects_bad_shape() -> None:
    with pytest.raises(PayloadError, match="images must be"):
        preprocess(np.zeros((1, 2, 3, 4, 5)), NORMALIZATION["fmnist"])


def test_fashion_mnist_from_debian_package(fashion_mnist: Path) -> None:
    # .ci/run installs the Debian package dataset-fashion-mnist; without it the fixture fails this test (make
    # test), never skips it, except in the quick loop (make check), where it skips saying what to install.
    test = load_dataset("fmnist", train=False)
    assert test.x.shape == (10000, 1, 32, 32)
    assert np.bincount(test.y).tolist() == [1000] * 10
    assert abs(float(test.x.mean())) < 0.1  # normalized with the training statistics
    assert test.classes[9] == "Ankle boot"


def test_digits_split_is_stratified_and_disjoint() -> None:
    tr, te = load_dataset("digits", train=True), load_dataset("digits", train=False)
    assert len(tr) + len(te) == 1797
    assert abs(len(te) - 0.25 * 1797) < 10
    assert np.bincount(te.y).min() >= 40


def test_missing_dataset_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        load_dataset("fmnist", train=True, data_dir=tmp_path)
    assert "apt-get install dataset-fashion-mnist" in (e.value.hint or "")
    with pytest.raises(DataError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet", train=True)


def test_idx_reader_rejects_corrupt_files(tmp_path: Path) -> None:
    p = tmp_path / "x-idx3-ubyte.gz"
    with gzip.open(p, "wb") as f:
        f.write(bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2]) + b"\x00" * 5)
    with pytest.raises(DataError, match="holds 5 bytes, its header says 8"):
        read_idx(p)


LABELS = np.repeat(np.arange(10), 100)


def test_iid_fraction_is_the_gefl_protocol_and_deterministic() -> None:
    labels = np.repeat(np.arange(10), 6000)
    parts = iid_fraction(labels, 10, 0.1, seed=3)
    assert [len(p) for p in parts] == [600] * 10
    assert len(np.unique(np.concatenate(parts))) == 6000
    again = iid_fraction(labels, 10, 0.1, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = iid_fraction(labels, 10, 0.1, seed=4)
    assert not np.array_equal(parts[0], other[0])


def _skew(parts: list[np.ndarray]) -> float:
    """Mean over devices of the largest class share."""
    return float(np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    low = dirichlet(LABELS, 10, 0.1, seed=0)
    high = dirichlet(LABELS, 10, 100.0, seed=0)
    assert _skew(low) > 0.5 > 0.25 > _skew(high)
    for parts in (low, high):
        flat = np.concatenate(parts)
        assert len(flat) == len(LABELS) == len(np.unique(flat))  # a partition: no loss, no overlap
        assert min(len(p) for p in parts) >= 10
    assert all(np.array_equal(a, b) for a, b in zip(low, dirichlet(LABELS, 10, 0.1, seed=0), strict=True))


def test_dirichlet_impossible_request() -> None:
    with pytest.raises(DataError, match="could not give each of 500 devices 10 samples"):
        dirichlet(LABELS, 500, 0.1, seed=0, max_tries=3)


def test_shards_give_few_classes_per_device() -> None:
    parts = shards(LABELS, 10, 2, seed=0)
    assert all(len(np.unique(LABELS[p])) <= 2 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))


def test_local_splits_hold_out_a_fraction() -> None:
    parts = iid_fraction(LABELS, 4, 1.0, seed=0)
    splits = local_splits(parts, 0.2, seed=0)
    for p, s in zip(parts, splits, strict=True):
        assert len(s.test) == 50 and len(s.train) == 200
        assert set(s.train) | set(s.test) == set(p) and not set(s.train) & set(s.test)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_mnist_from_a_torchvision_layout_directory(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (5, 28, 28)), np.array([3, 1, 4, 1, 5])
    _write_idx(raw / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(raw / "t10k-labels-idx1-ubyte.gz", labels)
    ds = load_dataset("mnist", train=False, data_dir=tmp_path)
    assert ds.x.shape == (5, 1, 32, 32) and ds.y.tolist() == [3, 1, 4, 1, 5]
    np.testing.assert_allclose(ds.x, preprocess(images, NORMALIZATION["mnist"]))
    with pytest.raises(DataError, match="no train-images-idx3-ubyte"):
        load_dataset("mnist", train=True, data_dir=tmp_path)
    with pytest.raises(DataError, match="mnist needs --data-dir"):
        load_dataset("mnist", train=False)
