"""The strategy state's append-only logs (fedge.coordinator.statelog): a checkpoint writes what changed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedge.common.asyncmode import AsyncSettings
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.statelog import COMPACT_FACTOR, COMPACT_SLACK
from fedge.coordinator.store import STATE_FILE, EngineState, EngineStore
from fedge.coordinator.strategies.fedproto import FedProtoStrategy
from fedge.coordinator.strategy import Contribution, LogDoc
from fedge.errors import CheckpointError


def _save(store: EngineStore, completed: int, strategy: dict) -> None:
    store.save(EngineState(completed=completed, method="fedproto", fleet="f", strategy=strategy), None)


def _load(path: Path) -> dict:
    return EngineStore(path).load(method="fedproto", fleet="f").strategy


def _log_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.jsonl") if p.name != "reports.jsonl")


def test_a_checkpoint_appends_only_the_keys_changed_since_the_last(tmp_path: Path) -> None:
    doc = LogDoc()
    for i in range(50):
        doc[f"d{i:02d}"] = {"v": i, "pad": "x" * 100}
    store = EngineStore(tmp_path)
    _save(store, 1, {"latest": doc, "other": 3})
    [name] = _log_files(tmp_path)
    first = (tmp_path / name).stat().st_size
    ref = json.loads((tmp_path / STATE_FILE).read_text())["strategy"]["latest"]
    assert ref == {"$log": name, "bytes": first, "keys": 50}
    doc["d07"] = {"v": -7}
    del doc["d08"]
    _save(store, 2, {"latest": doc, "other": 4})
    appended = (tmp_path / name).stat().st_size - first
    assert appended == len(b'["d07",{"v":-7}]\n') + len(b'["d08"]\n')
    want = {k: v for k, v in doc.items()}
    assert _load(tmp_path) == {"latest": want, "other": 4}
    assert want["d07"] == {"v": -7} and "d08" not in want and len(want) == 49


def test_lines_of_a_checkpoint_that_never_completed_do_not_count(tmp_path: Path) -> None:
    """The log is appended before state.json is replaced: a crash in between leaves lines state.json does not
    name; a reader ignores them and the next checkpoint cuts them off before appending."""
    doc = LogDoc()
    doc["a"], doc["b"] = 1, 2
    store = EngineStore(tmp_path)
    _save(store, 1, {"latest": doc})
    [name] = _log_files(tmp_path)
    with (tmp_path / name).open("ab") as f:
        f.write(b'["a",99]\n["c",')  # a later checkpoint's lines, the last torn: it died before state.json
    assert _load(tmp_path) == {"latest": {"a": 1, "b": 2}}
    doc["b"] = 3
    _save(store, 2, {"latest": doc})
    assert (tmp_path / name).read_bytes() == b'["a",1]\n["b",2]\n["b",3]\n'
    assert _load(tmp_path) == {"latest": {"a": 1, "b": 3}}


def test_a_failed_checkpoint_keeps_the_changes_for_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fedge.coordinator.store as store_mod

    doc = LogDoc()
    doc["a"] = 1
    store = EngineStore(tmp_path)
    _save(store, 1, {"latest": doc})
    doc["a"] = 2
    real = store_mod._write_state_file

    def full_disk(path: Path, data: bytes) -> None:
        if path.name == STATE_FILE:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(store_mod, "_write_state_file", full_disk)
    with pytest.raises(OSError):
        _save(store, 2, {"latest": doc})
    assert doc.changed == {"a"} and _load(tmp_path) == {"latest": {"a": 1}}
    monkeypatch.setattr(store_mod, "_write_state_file", real)
    _save(store, 2, {"latest": doc})
    assert _load(tmp_path) == {"latest": {"a": 2}} and not doc.changed


def test_the_log_is_compacted_and_the_old_generation_removed(tmp_path: Path) -> None:
    doc = LogDoc()
    for i in range(10):
        doc[str(i)] = "y" * 1000
    store = EngineStore(tmp_path)
    _save(store, 0, {"latest": doc})
    [first] = _log_files(tmp_path)
    live = (tmp_path / first).stat().st_size
    rounds = (COMPACT_FACTOR * live + COMPACT_SLACK) // (1007 * 3) + 2  # three keys rewritten per checkpoint
    for r in range(1, rounds + 1):
        for i in range(3):
            doc[str((3 * r + i) % 10)] = str(r) * 1000
        _save(store, r, {"latest": doc})
    [now] = _log_files(tmp_path)
    assert now != first and (tmp_path / now).stat().st_size <= COMPACT_FACTOR * live + COMPACT_SLACK
    assert _load(tmp_path) == {"latest": dict(doc)}


def test_a_restarted_store_writes_a_new_generation_and_resumes(tmp_path: Path) -> None:
    a = AsyncSettings(buffer_size=2, max_staleness=4)
    strat = FedProtoStrategy(num_classes=3, rounds=9)
    strat.asynchronous = a
    rng = np.random.default_rng(0)

    def deliver(s: FedProtoStrategy, rnd: int, dev: str) -> None:
        s.accumulate(DeviceInfo(dev, "tier-xs", "p"), {"protos": rng.normal(size=(3, 4)).astype(np.float32),
                                                      "counts": rng.integers(1, 9, 3)}, {}, Contribution(version=rnd))

    store = EngineStore(tmp_path)
    for rnd in (1, 2):
        strat.begin_round(rnd)
        for dev in ("d1", "d2", "d3"):
            deliver(strat, rnd, dev)
        strat.finish_round(rnd)
        _save(store, rnd, strat.state_dict())
    [gen0] = _log_files(tmp_path)
    again = FedProtoStrategy(num_classes=3, rounds=9)
    again.asynchronous = a
    restarted = EngineStore(tmp_path)
    again.load_state_dict(restarted.load(method="fedproto", fleet="f").strategy)
    again.begin_round(3)
    deliver(again, 3, "d2")
    _save(restarted, 3, again.state_dict())
    [gen1] = _log_files(tmp_path)
    assert gen1 != gen0  # the loaded state went whole into the next generation, the old one is gone
    resumed = FedProtoStrategy(num_classes=3, rounds=9)
    resumed.asynchronous = a
    resumed.load_state_dict(_load(tmp_path))
    for s in (again, resumed):
        s.begin_round(4)
    np.testing.assert_array_equal(resumed.finish_round(4)["prototypes"]["protos"],
                                  again.finish_round(4)["prototypes"]["protos"])


def test_states_written_before_the_logs_still_load(tmp_path: Path) -> None:
    EngineStore(tmp_path).save(EngineState(completed=1, method="fedproto", fleet="f"), None)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["strategy"] = {"latest": {"d1": {"version": 1, "arrays": {}}}}  # inline, as before
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert _load(tmp_path) == {"latest": {"d1": {"version": 1, "arrays": {}}}}


@pytest.mark.parametrize(("ref", "contents", "error"), [
    ({"$log": "../../etc/passwd", "bytes": 3}, None, "not a file name and a size"),
    ({"$log": "strategy.latest-0.jsonl", "bytes": -1}, None, "not a file name and a size"),
    ({"$log": "strategy.latest-0.jsonl", "bytes": 5}, None, "strategy.latest-0.jsonl is unreadable"),
    ({"$log": "strategy.latest-0.jsonl", "bytes": 50}, b'["a",1]\n', "holds 8 bytes, state.json names 50"),
    ({"$log": "strategy.latest-0.jsonl", "bytes": 16}, b'["a",1]\n{"a":1}\n', "line 2: not [key] or [key, value]"),
    ({"$log": "strategy.latest-0.jsonl", "bytes": 7}, b'["a",1\n', "line 1: Expecting"),
])
def test_a_damaged_reference_or_log_is_refused_naming_it(tmp_path: Path, ref: dict, contents: bytes | None,
                                                           error: str) -> None:
    EngineStore(tmp_path).save(EngineState(completed=1, method="fedproto", fleet="f"), None)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["strategy"] = {"latest": ref}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    if contents is not None:
        (tmp_path / ref["$log"]).write_bytes(contents)
    with pytest.raises(CheckpointError, match=re.escape(error)) as exc:
        _load(tmp_path)
    assert "state directory" in (exc.value.hint or "")


def test_a_deeply_nested_log_line_is_refused_not_a_crash(tmp_path: Path) -> None:
    """A log line is parsed with the nesting limit of untrusted JSON (fedge.common.boundedjson): 100,000 nested
    lists are a CheckpointError naming the line, not a RecursionError."""
    EngineStore(tmp_path).save(EngineState(completed=1, method="fedproto", fleet="f"), None)
    line = b'["a",' + b"[" * 100_000 + b"]" * 100_000 + b"]\n"
    (tmp_path / "strategy.latest-0.jsonl").write_bytes(line)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["strategy"] = {"latest": {"$log": "strategy.latest-0.jsonl", "bytes": len(line)}}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"strategy\.latest-0\.jsonl, line 1: the line is nested 100001 deep"):
        _load(tmp_path)


def test_running_sums_follow_joins_and_leaves_without_summing_the_fleet_again() -> None:
    """A version moves K devices between version groups: the kept sums take their terms in and out (the terms
    function runs for the K newcomers, not the fleet) and equal the groups summed afresh, as a restart sums
    them."""
    from fedge.coordinator.strategies.fedproto import _terms
    from fedge.coordinator.strategies.running import LatestUploads

    rng = np.random.default_rng(3)
    calls: list[int] = []

    def counted(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        calls.append(1)
        return _terms(arrays)

    def upload() -> dict[str, np.ndarray]:
        return {"protos": rng.normal(size=(4, 6)).astype(np.float32), "counts": rng.integers(0, 50, 4)}

    latest = LatestUploads()
    for i in range(40):
        latest.put(f"d{i:02d}", upload(), i % 5)  # five groups of eight
    latest.version_sums("p", counted)
    assert len(calls) == 40
    for version in range(5, 12):
        calls.clear()
        movers = rng.choice(40, 6, replace=False)
        for j in movers:  # into the newest group and into groups summed before
            latest.put(f"d{j:02d}", upload(), int(rng.integers(version - 5, version + 1)))
        got = latest.version_sums("p", counted)
        assert len(calls) <= 6  # the newcomers' terms; no group summed over again
        fresh = LatestUploads()
        fresh.load_state_dict(json.loads(json.dumps(dict(latest.state_dict()))))
        want = fresh.version_sums("p", _terms)
        assert [v for v, _ in got] == [v for v, _ in want]
        for (_, g), (_, w) in zip(got, want, strict=True):
            np.testing.assert_allclose(g[0], w[0], rtol=1e-12, atol=1e-9)
            np.testing.assert_array_equal(g[1], w[1])  # counts: integers, exact


def test_an_upload_entry_is_the_json_of_its_arrays() -> None:
    """The entry's text, put together by hand, is the JSON of the entry (names escaped) and loads back."""
    from fedge.coordinator.strategies.running import _array, _entry

    arrays: dict[str, np.ndarray] = {'pro"to\\s': np.arange(6, dtype=np.float32).reshape(2, 3),
                                     "counts": np.arange(3, dtype=np.int64)}
    e = _entry(arrays, 7)
    assert json.loads(e.text) == json.loads(json.dumps(dict(e)))
    back = json.loads(e.text)
    assert back["version"] == 7
    for k, a in arrays.items():
        np.testing.assert_array_equal(_array(back["arrays"][k]), a)
        assert _array(back["arrays"][k]).dtype == a.dtype


def test_the_device_list_follows_a_new_hello_and_a_device_gone(tmp_path: Path) -> None:
    """state.json's device list is kept between checkpoints while no device changed, and is written again
    when one registers anew (a new DeviceInfo) or leaves."""
    store = EngineStore(tmp_path)
    devices = {f"d{i}": DeviceInfo(f"d{i}", "tier-xs", "p", num_samples=10) for i in range(3)}

    def saved() -> dict[str, int]:
        state = EngineStore(tmp_path).load(method="fedproto", fleet="f")
        return {d: info.num_samples for d, info in state.devices.items()}

    store.save(EngineState(completed=1, method="fedproto", fleet="f", devices=devices), None)
    store.save(EngineState(completed=2, method="fedproto", fleet="f", devices=devices), None)
    assert saved() == {"d0": 10, "d1": 10, "d2": 10}
    devices["d1"] = DeviceInfo("d1", "tier-xs", "p", num_samples=99)  # its new hello
    store.save(EngineState(completed=3, method="fedproto", fleet="f", devices=devices), None)
    assert saved() == {"d0": 10, "d1": 99, "d2": 10}
    del devices["d0"]
    store.save(EngineState(completed=4, method="fedproto", fleet="f", devices=devices), None)
    assert saved() == {"d1": 99, "d2": 10}
