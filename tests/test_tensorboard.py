"""TensorBoard event files written without TensorFlow: TensorBoard's own reader (EventAccumulator) reads every
per-round scalar back, with the values of the round reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.coordinator.report import RoundReport
from fedge.observe.tensorboard import TensorBoardWriter, crc32c


def test_crc32c_known_answers() -> None:
    # RFC 3720's check value and the empty string
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_tensorboard_reads_the_scalars(tmp_path: Path) -> None:
    # TensorBoard's own reader (fedge[dev]; fedge writes the files without it)
    from tensorboard.backend.event_processing import event_accumulator as accumulator

    w = TensorBoardWriter(tmp_path / "tb")
    w.profiles({"a": "rpi4", "b": "rpi4", "c": "x86"})
    reports = [RoundReport(round=r, phase="train", accepted=["a", "b", "c"],
                           bytes_up={"a": 100 * r, "b": 200, "c": 300}, bytes_down={"a": 10, "b": 20, "c": 30},
                           metrics={"a": {"acc_global": 0.1 * r, "acc_local": 0.5}, "b": {"acc_global": 0.3},
                                    "c": {"acc_global": 0.9}}, seconds=1.5 * r, missing=["d"] if r == 2 else [],
                           rejected={"late": 1} if r == 2 else {}) for r in (1, 2, 3)]
    for rep in reports:
        w.round_finished(rep, 0.01 * rep.round)
    acc = accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"fleet/accuracy", "fleet/accuracy_local", "profile/rpi4/accuracy", "profile/x86/accuracy",
            "device/a/accuracy", "round/seconds", "round/aggregation_seconds", "round/accepted", "round/missing",
            "round/refused", "traffic/bytes_up", "traffic/bytes_down"} <= tags

    def values(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert values("round/seconds") == [(1, 1.5), (2, 3.0), (3, 4.5)]
    assert values("traffic/bytes_up") == [(1, 600.0), (2, 700.0), (3, 800.0)]
    assert values("round/missing") == [(1, 0.0), (2, 1.0), (3, 0.0)]
    assert values("round/refused") == [(1, 0.0), (2, 1.0), (3, 0.0)]
    assert [v for _, v in values("profile/rpi4/accuracy")] == pytest.approx([0.2, 0.25, 0.3])
    assert [v for _, v in values("fleet/accuracy")] == pytest.approx([(0.1 * r + 1.2) / 3 for r in (1, 2, 3)])
    assert [v for _, v in values("round/aggregation_seconds")] == pytest.approx([0.01, 0.02, 0.03])
