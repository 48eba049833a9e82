"""Sensor windows: UCI HAR's on-disk layout (written here, synthetic: UCI HAR cannot be downloaded), folders of
.npy / .csv windows, the refusals that name the file, and a 1-D CNN fleet partitioned by subject."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fedge.edge.models  # noqa: F401  (registers the measurer, as every training process does)
from fedge.common.catalog import HAR_CLASSES
from fedge.edge.data.datasets import load_dataset, load_groups
from fedge.edge.data.har_synth import write_uci_har
from fedge.edge.data.sensors import HAR_SIGNALS, load_uci_har, load_window_folder
from fedge.errors import ConfigError, DataError, PayloadError
from fedge.fleet.config import parse_fleet
from fedge.fleet.slots import device_slots, fleet_splits
from fedge.runtime.inputs import load_inputs
from fedge.runtime.signals import read_window


@pytest.fixture(scope="module")
def har(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 synthetic subjects (2 of them the test split) x 6 activities x 4 windows, in UCI HAR's layout."""
    return write_uci_har(tmp_path_factory.mktemp("har") / "UCI HAR Dataset", subjects=6, test_subjects=2,
                         windows_per_activity=4)


def test_the_uci_har_layout_reads_as_windows_labels_and_subjects(har: Path) -> None:
    train = load_uci_har(har.parent, split="train")  # the folder above 'UCI HAR Dataset' works too
    assert train.x.shape == (4 * 6 * 4, 9, 128) and train.x.dtype == np.float32
    assert np.bincount(train.y).tolist() == [16] * 6 and train.classes == HAR_CLASSES
    assert sorted(set(train.subjects)) == ["subject1", "subject2", "subject3", "subject4"]
    test = load_uci_har(har, split="test")
    assert sorted(set(test.subjects)) == ["subject5", "subject6"] and len(test) == 48
    # channel 0 is body_acc_x of the file, row for row; labels 1..6 became 0..5
    first = np.loadtxt(har / "train" / "Inertial Signals" / "body_acc_x_train.txt")[0]
    np.testing.assert_allclose(train.x[0, 0], first, rtol=1e-6)
    assert int((har / "train" / "y_train.txt").read_text().split()[0]) - 1 == train.y[0]
    # total acceleration carries gravity: |mean total acc| is about 1 g in every still window
    still = np.isin(train.y, [3, 4, 5])
    g = np.linalg.norm(train.x[still, 6:9].mean(axis=2), axis=1)
    assert np.all(np.abs(g - 1.0) < 0.1)


def _corrupt(har: Path, tmp_path: Path, edit: Any) -> Path:
    import shutil

    copy = tmp_path / "har"
    shutil.copytree(har, copy)
    edit(copy)
    return copy


def test_malformed_har_files_are_refused_naming_file_and_line(har: Path, tmp_path: Path) -> None:
    def short_row(d: Path) -> None:
        f = d / "train" / "Inertial Signals" / "body_gyro_y_train.txt"
        lines = f.read_text().splitlines()
        lines[4] = " ".join(lines[4].split()[:100])
        f.write_text("\n".join(lines) + "\n")

    bad = _corrupt(har, tmp_path / "a", short_row)
    with pytest.raises(DataError, match=r"body_gyro_y_train.txt, line 5: 100 values, expected 128"):
        load_uci_har(bad)

    def nan(d: Path) -> None:
        f = d / "train" / "Inertial Signals" / "total_acc_z_train.txt"
        lines = f.read_text().splitlines()
        lines[2] = " ".join(["nan", *lines[2].split()[1:]])
        f.write_text("\n".join(lines) + "\n")

    with pytest.raises(DataError, match=r"total_acc_z_train.txt, line 3: NaN or infinite value"):
        load_uci_har(_corrupt(har, tmp_path / "b", nan))
    with pytest.raises(DataError, match=r"y_train.txt: missing") as err:
        load_uci_har(_corrupt(har, tmp_path / "c", lambda d: (d / "train" / "y_train.txt").unlink()))
    assert "re-copy" in (err.value.hint or "")

    def one_less(d: Path) -> None:
        f = d / "train" / "subject_train.txt"
        f.write_text("\n".join(f.read_text().splitlines()[:-1]) + "\n")

    with pytest.raises(DataError, match=r"different numbers of windows.*'subject_train.txt': 95"):
        load_uci_har(_corrupt(har, tmp_path / "d", one_less))
    with pytest.raises(DataError, match="no train/ folder") as err:
        load_uci_har(tmp_path)
    assert "cannot be downloaded" in (err.value.hint or "")


def test_a_folder_of_windows_reads_good_files_and_reports_each_bad_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    root = tmp_path / "mine"
    (root / "walking").mkdir(parents=True)
    (root / "sitting").mkdir()
    (root / "empty_class").mkdir()  # not one of the classes
    good = rng.normal(size=(64, 3))
    np.savetxt(root / "walking" / "ann_nohash_0.csv", good, delimiter=",")
    np.save(root / "walking" / "bob_nohash_0.npy", good)
    np.save(root / "sitting" / "ann_nohash_1.npy", good.T)  # transposed
    np.savetxt(root / "sitting" / "bob_nohash_1.csv", good[:, :2], delimiter=",")  # two columns
    with_nan = good.copy()
    with_nan[3, 1] = np.nan
    np.save(root / "sitting" / "cid_nohash_0.npy", with_nan)
    (root / "sitting" / "notes.txt").write_text("x")
    s = load_window_folder(root, ("walking", "sitting"), window=64, channels=3)
    assert s.x.shape == (2, 3, 64) and s.y.tolist() == [0, 0] and s.subjects.tolist() == ["ann", "bob"]
    np.testing.assert_allclose(s.x[0], good.T, rtol=1e-6)
    reasons = {Path(p).name: r for p, r in s.skipped}
    assert reasons["ann_nohash_1.npy"] == ("shape (3, 64), expected (64, 3) (64 samples x 3 channels) "
                                           "(transposed? save it as time x channels)")
    assert reasons["bob_nohash_1.csv"].startswith("shape (64, 2), expected (64, 3)")
    assert reasons["cid_nohash_0.npy"] == "NaN, infinite or non-numeric values"
    assert reasons["notes.txt"] == "not a .npy or .csv window"
    assert reasons["empty_class"].startswith("not one of the fleet's classes")


def test_the_runtime_reads_a_csv_window_for_a_sensor_model(tmp_path: Path) -> None:
    from fedge.common.preprocess import signal_normalization

    norm = signal_normalization("series", 9, 128)
    w = np.random.default_rng(1).normal(size=(128, 9))
    np.savetxt(tmp_path / "w.csv", w, delimiter=",")
    batch = load_inputs([tmp_path / "w.csv"], norm)
    assert batch.x.shape == (1, 9, 128) and batch.names == (str(tmp_path / "w.csv"),)
    np.testing.assert_allclose(batch.x[0], w.T, rtol=1e-6)
    np.savetxt(tmp_path / "short.csv", w[:100], delimiter=",")
    with pytest.raises(PayloadError, match=r"short.csv: shape \(100, 9\), expected \(128, 9\)"):
        load_inputs([tmp_path / "short.csv"], norm)
    (tmp_path / "clip.wav").write_bytes(b"RIFF")
    with pytest.raises(PayloadError, match=r"a series model does not read \.wav"):
        load_inputs([tmp_path / "clip.wav"], norm)
    with pytest.raises(DataError, match="not a readable window"):
        read_window(_text(tmp_path / "t.csv"), 128, 9)


def _text(path: Path) -> Path:
    path.write_text("a,b,c\n")
    return path


def har_fleet(root: Path, method: str = "fedavg", **extra: Any) -> Any:
    return parse_fleet({
        "run": {"name": "har", "method": method, "rounds": 4, "dataset": "uci_har", "data_dir": str(root)},
        "model": {"family": "cnn1d"},
        "partition": {"kind": "group", "local_test_fraction": 0.2},
        "train": {"lr": 0.05, "momentum": 0.9, "local_epochs": 3, "batch_size": 8,
                  "lr_schedule": "constant"},  # measured at one rate (issue 45's plan anneals it)
        "devices": [{"profile": "rpi4-4gb", "count": 2, "arch": "xs"}, {"profile": "x86-gateway", "count": 2,
                                                                         "arch": "s"}],
        **extra,
    })


def test_a_1d_cnn_fleet_on_uci_har_is_partitioned_by_subject_and_learns(har: Path) -> None:
    from fedge.sim.simulate import simulate

    cfg = har_fleet(har)
    assert cfg.input_shape == (9, 128)
    train = load_dataset("uci_har", train=True, data_dir=har)
    assert train.x.shape == (96, 9, 128) and train.norm.kind == "series"
    subjects = load_groups("uci_har", train=True, data_dir=har)
    splits = fleet_splits(cfg, train.y)
    for s in splits:
        assert len(set(subjects[np.concatenate([s.train, s.test, s.val])])) == 1  # one subject a device
    result = simulate(cfg)
    accs = [m["acc_global"] for m in result.reports[-1].metrics.values()]
    assert len(accs) == 4
    # six activities: chance is 16.7 %; the still postures alone are told apart by gravity's direction
    assert np.mean(accs) > 0.4, accs
    assert {d.info.arch for d in result.devices} == {"cnn1d-xs-128", "cnn1d-s-128"}
    with pytest.raises(ConfigError, match="feature generator imitates a \\(C, H, W\\) stem") as err:
        device_slots(har_fleet(har, method="geflf"))  # refused when the fleet is planned, before any training
    assert "fedavg, lgfedavg or fedproto" in (err.value.hint or "")
    assert HAR_SIGNALS[6:] == ("total_acc_x", "total_acc_y", "total_acc_z")


def test_reading_windows_and_clips_for_inference_imports_no_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    np.savetxt(tmp_path / "w.csv", np.zeros((128, 9)), delimiter=",")
    code = ("import sys\nfrom fedge.common.preprocess import signal_normalization\n"
            "from fedge.runtime import load_inputs\n"
            f"b = load_inputs([{str(tmp_path / 'w.csv')!r}], signal_normalization('series', 9, 128))\n"
            "print(b.x.shape, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "(1, 9, 128) False"
