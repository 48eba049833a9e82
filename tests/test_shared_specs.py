"""The torch-free specs both halves share agree with what the torch side produces, and the
coordinator side names them without importing the device side."""

from __future__ import annotations

import subprocess
import sys

import pytest
from generative_helpers import skewed_fleet

from fedge.common.rounds import TRAIN_PHASE, RoundInfo, class_stats_spec
from fedge.coordinator.validation import check_arrays


@pytest.mark.parametrize(("method", "with_sigma"), [("fedproto", False), ("fedvtc", True)])
def test_statistics_uploads_match_the_torch_free_spec(method: str, with_sigma: bool) -> None:
    fleet = skewed_fleet(method, rounds=1, epochs=1, archs=("cnn3-p32", "cnn1-p32"),
                         method_config={"generator_tier": "tiny"} if method == "fedvtc" else {})
    for dev in fleet.methods():
        arrays, _ = dev.train_round(RoundInfo(1, TRAIN_PHASE, method))
        spec = class_stats_spec(10, dev.ctx.model.spec.feature_dim, with_sigma=with_sigma)
        assert {k: (tuple(v.shape), v.dtype.kind) for k, v in arrays.items()} == {
            k: (shape, "f" if kind == "float" else "i") for k, (shape, kind) in spec.items()}
        check_arrays(arrays, spec, dev.ctx.device_id)  # what the engine enforces, passes as-is


def test_coordinator_side_never_imports_the_device_side() -> None:
    code = (
        "import sys\n"
        "import fedge.coordinator.strategies, fedge.coordinator.engine, fedge.common.generators\n"
        "print(sorted(m for m in sys.modules if m.startswith('fedge.edge')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
