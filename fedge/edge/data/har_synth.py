"""Synthetic accelerometer and gyroscope windows for UCI HAR's six activities, written in UCI HAR's layout.

UCI HAR itself cannot be downloaded here; this writes a stand-in that :func:`fedge.edge.data.sensors.load_uci_har`
reads exactly as it reads the real one (``train/`` and ``test/``, ``y_*.txt``, ``subject_*.txt``,
``Inertial Signals/*_{split}.txt``, 128 samples at 50 Hz a window). It is clearly synthetic: each subject has a
cadence (steps per second), a stride amplitude, a phone orientation (a rotation applied to every vector) and a
noise level of their own; walking is a periodic gait pattern at the cadence with harmonics, upstairs and
downstairs add a vertical ramp and change the harmonic mix and amplitude, sitting / standing / laying are still
postures that differ by where gravity points, plus small sway. It shows that the sensor path works and that
methods separate on a subject-partitioned task; it says nothing about real activity-recognition accuracy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.common.catalog import HAR_CLASSES
from fedge.edge.data.sensors import HAR_SIGNALS, HAR_WINDOW

RATE = 50.0  # Hz
WINDOW = HAR_WINDOW
# where gravity points in the phone's frame, per still posture (g units)
_POSTURE = {"sitting": (0.2, 0.8, 0.55), "standing": (0.0, 1.0, 0.05), "laying": (0.1, 0.05, 1.0)}


@dataclass(frozen=True)
class Subject:
    """One synthetic person: cadence (Hz), stride amplitude (g), phone rotation, noise (g)."""

    id: int
    cadence: float
    amplitude: float
    rotation: np.ndarray
    noise: float


def _rotation(rng: np.random.Generator) -> np.ndarray:
    """A random rotation within ~20 degrees of upright (the phone sits a little differently on each waist)."""
    a, b, c = rng.uniform(-0.35, 0.35, 3)
    rx = np.array([[1, 0, 0], [0, np.cos(a), -np.sin(a)], [0, np.sin(a), np.cos(a)]])
    ry = np.array([[np.cos(b), 0, np.sin(b)], [0, 1, 0], [-np.sin(b), 0, np.cos(b)]])
    rz = np.array([[np.cos(c), -np.sin(c), 0], [np.sin(c), np.cos(c), 0], [0, 0, 1]])
    return rx @ ry @ rz


def make_subjects(n: int, seed: int) -> list[Subject]:
    rng = np.random.default_rng([seed, 7])
    return [Subject(i + 1, rng.uniform(1.6, 2.2), rng.uniform(0.15, 0.35), _rotation(rng), rng.uniform(0.01, 0.04))
            for i in range(n)]


def window(activity: str, s: Subject, rng: np.random.Generator) -> np.ndarray:
    """(9, 128): body acc xyz, body gyro xyz, total acc xyz of one window of ``activity`` by ``s``."""
    t = np.arange(WINDOW) / RATE
    phase = rng.uniform(0, 2 * np.pi)
    body = np.zeros((3, WINDOW))
    gyro = np.zeros((3, WINDOW))
    if activity.startswith("walking"):
        up = activity == "walking_upstairs"
        down = activity == "walking_downstairs"
        f = s.cadence * (0.85 if up else 1.1 if down else 1.0)
        amp = s.amplitude * (1.2 if up else 1.5 if down else 1.0)
        w = 2 * np.pi * f * t + phase
        h2 = 0.6 if up else 0.2 if down else 0.4  # the second harmonic: heel strike against push-off
        body[0] = amp * (np.sin(w) + h2 * np.sin(2 * w))
        body[1] = amp * 0.5 * np.sin(w / 2)  # side sway at half the step rate
        body[2] = amp * 0.7 * np.cos(w) + (0.08 if up else -0.08 if down else 0.0)
        gyro[0] = 0.6 * amp * np.cos(w / 2)
        gyro[1] = 0.4 * amp * np.sin(w + 0.5)
        gyro[2] = 0.3 * amp * np.sin(2 * w)
        gravity = np.array([0.0, 1.0, 0.05])
    else:
        gravity = np.array(_POSTURE[activity])
        sway = 2 * np.pi * rng.uniform(0.2, 0.5) * t + phase
        body[:] = 0.01 * np.sin(sway)
        gyro[:] = 0.02 * np.cos(sway)
    gravity = gravity / np.linalg.norm(gravity)
    r = s.rotation
    body, gyro = r @ body, r @ gyro
    total = body + (r @ gravity)[:, None]
    out = np.concatenate([body, gyro, total]) + rng.normal(0, s.noise, (9, WINDOW))
    return out.astype(np.float32)


def write_uci_har(root: str | os.PathLike[str], *, subjects: int = 10, test_subjects: int = 3,
                  windows_per_activity: int = 8, seed: int = 0) -> Path:
    """Write ``subjects`` synthetic subjects in UCI HAR's layout under ``root`` (the last ``test_subjects`` are
    the test split, as UCI HAR holds out whole subjects); ``windows_per_activity`` windows each."""
    base = Path(root)
    rng = np.random.default_rng([seed, 8])
    people = make_subjects(subjects, seed)
    for split, group in (("train", people[: subjects - test_subjects]), ("test", people[subjects - test_subjects :])):
        rows = [(k, s) for s in group for k in range(len(HAR_CLASSES)) for _ in range(windows_per_activity)]
        x = np.stack([window(HAR_CLASSES[k], s, rng) for k, s in rows])  # (N, 9, 128)
        d = base / split
        (d / "Inertial Signals").mkdir(parents=True, exist_ok=True)
        (d / f"y_{split}.txt").write_text("".join(f"{k + 1}\n" for k, _ in rows))
        (d / f"subject_{split}.txt").write_text("".join(f"{s.id}\n" for _, s in rows))
        for c, name in enumerate(HAR_SIGNALS):
            np.savetxt(d / "Inertial Signals" / f"{name}_{split}.txt", x[:, c], fmt="%.7e")
    (base / "activity_labels.txt").write_text("".join(f"{i + 1} {c.upper()}\n" for i, c in enumerate(HAR_CLASSES)))
    return base
