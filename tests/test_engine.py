"""The round engine with the in-process transport: aggregation, bytes, validation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from fleet_helpers import capture_uploads, tiny_fleet, weights

from fedge.common.messages import Message
from fedge.common.rounds import EXTRACTOR_ARTIFACT, PROTOTYPES_ARTIFACT, group_artifact
from fedge.edge.methods.base import model_arrays


def test_fedavg_within_group_equals_hand_computed_average() -> None:
    fleet = tiny_fleet("fedavg", ["tier-xs", "tier-xs", "tier-s"], rounds=1)
    uploads = capture_uploads(fleet.agents)
    fleet.engine.run_round(1)
    by = {u.msg.sender: u.msg for u in uploads}
    n0, n1 = fleet.agents[0].device.num_samples, fleet.agents[1].device.num_samples
    glob = fleet.engine.globals[group_artifact("tier-xs")]
    for name, w0 in by["d0"].tensors.items():
        expected = (n0 * w0.astype(np.float64) + n1 * by["d1"].tensors[name]) / (n0 + n1)
        np.testing.assert_allclose(glob[name], expected, rtol=1e-6, atol=1e-7)
    # the lone tier-s device's group average is its own weights
    for name, w in by["d2"].tensors.items():
        np.testing.assert_array_equal(fleet.engine.globals[group_artifact("tier-s")][name], w)
    assert set(fleet.engine.globals) == {group_artifact("tier-xs"), group_artifact("tier-s")}
    # after the next round's apply, both xs devices hold the group average
    fleet.engine.run_round(2)  # final round (rounds=1): apply + evaluate only
    a, b = weights(fleet, 0), weights(fleet, 1)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_lgfedavg_shares_extractor_across_groups() -> None:
    fleet = tiny_fleet("lgfedavg", ["tier-xs", "tier-s"], rounds=1)
    fleet.engine.run()
    ext0 = model_arrays(fleet.agents[0].method.ctx.model, ["extractor."])
    ext1 = model_arrays(fleet.agents[1].method.ctx.model, ["extractor."])
    for k in ext0:
        np.testing.assert_array_equal(ext0[k], ext1[k])
    assert not any(k.startswith("extractor.") for k in fleet.engine.globals[group_artifact("tier-xs")])
    assert set(fleet.engine.globals[EXTRACTOR_ARTIFACT]) == set(ext0)


def test_fedproto_prototypes_are_count_weighted() -> None:
    fleet = tiny_fleet("fedproto", ["tier-xs", "tier-s", "tier-xs"], rounds=1)
    uploads = capture_uploads(fleet.agents)
    fleet.engine.run_round(1)
    msgs = [u.msg for u in uploads]
    counts = np.sum([m.tensors["counts"] for m in msgs], axis=0)
    sums = np.sum([m.tensors["protos"].astype(np.float64) * m.tensors["counts"][:, None] for m in msgs], axis=0)
    glob = fleet.engine.globals[PROTOTYPES_ARTIFACT]
    np.testing.assert_array_equal(glob["counts"], counts)
    np.testing.assert_allclose(glob["protos"], sums / counts[:, None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_bytes_counted_are_the_encoded_sizes(precision: str) -> None:
    fleet = tiny_fleet("fedavg", ["tier-xs", "tier-xs"], rounds=1, precision=precision)
    uploads = capture_uploads(fleet.agents)
    descriptors: list[bytes] = []  # as published in each round (the run's end withdraws the last one)
    reports = fleet.engine.run(on_round=lambda _: descriptors.append(fleet.bus.round_msg or b""))
    sent = {u.msg.sender: len(u.data) for u in uploads if u.msg.round == 1}
    assert reports[0].bytes_up == sent
    d0_sent = [len(u.data) for u in uploads if u.msg.sender == "d0"]
    assert [t.bytes_up for t in fleet.agents[0].traffic] == d0_sent
    # downlink of round 2 = round descriptor + the group artifact, as published
    down = len(descriptors[1]) + len(fleet.bus.globals[group_artifact("tier-xs")])
    assert fleet.agents[0].traffic[1].bytes_down == down
    params = sum(w.size for w in weights(fleet, 0).values())
    per_value = {"fp32": 4, "fp16": 2, "int8": 1}[precision]
    assert params * per_value < sent["d0"] < params * per_value + 12_000  # payload + header/envelope


def test_rejected_updates_are_counted_and_do_not_touch_the_aggregate() -> None:
    fleet = tiny_fleet("fedproto", ["tier-xs", "tier-xs"], rounds=1)
    bus = fleet.bus
    good_pump = bus.pump
    bad: list[bytes] = []

    def pump() -> None:
        assert good_pump is not None
        good_pump()
        real = [Message.from_bytes(b) for b in bus.updates]
        d0 = next(m for m in real if m.sender == "d0")
        nan = Message("update", "d0", 1, tensors={**d0.tensors, "protos": d0.tensors["protos"] * np.nan})
        wrong = Message("update", "d1", 1, tensors={"protos": np.zeros((10, 3), np.float32),
                                                    "counts": np.zeros(10, np.int64)})
        stale = Message("update", "d1", 0, tensors=d0.tensors)
        ghost = Message("update", "intruder", 1, tensors=d0.tensors)
        bad.extend([nan.to_bytes(), wrong.to_bytes(), stale.to_bytes(), ghost.to_bytes(), b"garbage"])
        # the bad ones arrive first; the replay of d0's real update arrives after the original
        bus.updates.extendleft(reversed(bad))
        bus.updates.append(next(b for b in list(bus.updates) if b not in bad and Message.from_bytes(b).sender == "d0"))

    bus.pump = pump
    report = fleet.engine.run_round(1)
    assert report.rejected == {"nonfinite": 1, "shape": 1, "stale": 1, "unregistered": 1, "malformed": 1,
                               "duplicate": 1}
    assert sorted(report.accepted) == ["d0", "d1"]
    assert np.all(np.isfinite(fleet.engine.globals[PROTOTYPES_ARTIFACT]["protos"]))


def test_evaluation_is_cached_until_the_model_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds that leave the model untouched (GeFL's generator phase) must not re-run the test sets."""
    import fedge.edge.methods.base as base

    fleet = tiny_fleet("fedavg", ["cnn4"])
    method = fleet.agents[0].method
    passes: list[int] = []
    real = base.accuracy

    def counting(model: Any, x: np.ndarray, y: np.ndarray) -> float:
        passes.append(len(y))
        return real(model, x, y)

    monkeypatch.setattr(base, "accuracy", counting)
    first = method.evaluate()
    assert len(passes) == 2  # local split and global test set
    assert method.evaluate() == first and len(passes) == 2  # unchanged model: served from the cache
    # A BatchNorm running statistic is state too: changing only it must invalidate the cache.
    bn = method.ctx.model.get_submodule("extractor.1")
    assert isinstance(bn, torch.nn.BatchNorm2d) and bn.running_mean is not None
    bn.running_mean.add_(0.5)
    assert method._eval_cache is not None
    assert base.state_digest(method.ctx.model) != method._eval_cache[0]
    second = method.evaluate()
    assert len(passes) == 4
    test = method.ctx.global_test
    assert test is not None
    assert second["acc_global"] == pytest.approx(real(method.ctx.model, test.x, test.y))
