"""``reports.jsonl``: what the store appends, :func:`read_reports` reads back, and a bad line is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedge.coordinator.report import RoundReport
from fedge.coordinator.store import REPORTS_FILE, EngineState, EngineStore, read_reports
from fedge.errors import CheckpointError

REPORTS = [RoundReport(1, "train", accepted=["a", "b"], bytes_up={"a": 10, "b": 12}, seconds=0.5),
           RoundReport(2, "final", accepted=["a"], metrics={"a": {"acc_global": 0.9}}, seconds=1.0)]


def saved(tmp_path: Path) -> Path:
    """A state directory with two rounds checkpointed by the store."""
    store = EngineStore(tmp_path)
    for report in REPORTS:
        store.save(EngineState(completed=report.round, method="fedproto", fleet="f"), report)
    return tmp_path / REPORTS_FILE


def test_what_the_store_appends_reads_back(tmp_path: Path) -> None:
    path = saved(tmp_path)
    assert read_reports(path) == REPORTS
    assert EngineStore(tmp_path).load(method="fedproto", fleet="f").reports == REPORTS


def test_a_missing_file_holds_no_report(tmp_path: Path) -> None:
    assert read_reports(tmp_path / REPORTS_FILE) == []


@pytest.mark.parametrize("line, why", [
    (b"{not json\n", "Expecting property name"),
    (b"[1, 2]\n", "a JSON list, not an object"),
    (b'{"round": "two", "phase": "train"}\n', "wrong type of round"),
    (b'{"round": 2, "phase": "train", "accepted": "a"}\n', "wrong type of accepted"),
    (b'{"round": 2, "phase": "train", "colour": "red"}\n', "unexpected keyword argument 'colour'"),
    (b'{"round": 2}\n', "missing 1 required positional argument: 'phase'"),
    (b"\xff\xfe\n", "codec can't decode"),
])
def test_a_bad_line_is_named_with_its_file_and_number(tmp_path: Path, line: bytes, why: str) -> None:
    path = saved(tmp_path)
    with path.open("ab") as f:
        f.write(line)
    with pytest.raises(CheckpointError, match=rf"reports\.jsonl, line 3: not a round report: .*{why}"):
        read_reports(path)


def test_a_bad_line_within_the_saved_rounds_stops_the_store(tmp_path: Path) -> None:
    path = saved(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"{}\n")
    with pytest.raises(CheckpointError, match=r"line 2: not a round report"):
        EngineStore(tmp_path).load(method="fedproto", fleet="f")


def test_a_line_being_appended_is_left_out_only_when_reading_a_live_file(tmp_path: Path) -> None:
    path = saved(tmp_path)
    whole = json.dumps({"round": 3, "phase": "train"}).encode()
    with path.open("ab") as f:
        f.write(whole[:10])  # the coordinator is writing round 3's report
    assert read_reports(path, live=True) == REPORTS
    with pytest.raises(CheckpointError, match="line 3"):
        read_reports(path)
    with path.open("ab") as f:
        f.write(whole[10:] + b"\n")
    assert read_reports(path, live=True)[-1] == RoundReport(3, "train")
