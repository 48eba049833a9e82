"""The checks a device runs on a new model version before it switches it in.

* **Smoke test** (:func:`smoke_test`): in a *child process* (``python -m fedge.runtime.checks DIR``), so a
  model that crashes ONNX Runtime, or exhausts the device's memory, fails the check instead of killing the
  agent: load the model (checksums verified), run a batch, check the logits' shape and that they are
  finite, time a batch-1 inference. Bounded by a timeout.
* **Local accuracy** (:func:`accuracy`): the model's accuracy on the device's own validation split (the
  preprocessed local test split it already holds), compared by the updater with the current model's.

numpy and ONNX Runtime only, like the rest of :mod:`fedge.runtime`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SMOKE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SmokeResult:
    """What the child process found (``ok`` False: ``error`` says why)."""

    ok: bool
    error: str = ""
    latency_ms: float | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "error": self.error, "latency_ms": self.latency_ms, "seconds": round(self.seconds, 3)}


def smoke_test(model_dir: str | os.PathLike[str], *, timeout_s: float = SMOKE_TIMEOUT_S) -> SmokeResult:
    """Run the model in a child process (see the module docstring)."""
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.run([sys.executable, "-m", "fedge.runtime.checks", str(model_dir)], capture_output=True,
                              text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return SmokeResult(False, f"the model did not answer within {timeout_s:.0f} s", seconds=timeout_s)
    spent = time.monotonic() - t0
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0:
        why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        detail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
        return SmokeResult(False, f"the model's test process failed ({why}){': ' + detail if detail else ''}",
                           seconds=spent)
    try:
        out = json.loads(last)
        return SmokeResult(bool(out["ok"]), str(out.get("error", "")), out.get("latency_ms"), spent)
    except (ValueError, KeyError, TypeError):
        return SmokeResult(False, f"the model's test process printed no result: {last[:200]!r}", seconds=spent)


def accuracy(model_dir: str | os.PathLike[str], x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of the model on preprocessed inputs ``x`` (N, C, S, S) with labels ``y``."""
    from fedge.runtime.model import EdgeModel

    model = EdgeModel.load(model_dir)
    if len(y) == 0:
        return float("nan")
    labels = model.predict(np.asarray(x, dtype=np.float32), preprocessed=True).labels
    return float(np.mean(labels == np.asarray(y)))


def _child(model_dir: str) -> dict[str, Any]:
    from fedge.runtime.model import EdgeModel

    model = EdgeModel.load(model_dir)
    c, s, _ = model.input_shape
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((8, c, s, s)).astype(np.float32)
    logits = model.predict(batch, preprocessed=True).logits
    if logits.shape != (8, len(model.classes)):
        return {"ok": False, "error": f"logits of shape {logits.shape}, expected (8, {len(model.classes)})"}
    if not np.isfinite(logits).all():
        return {"ok": False, "error": "the model produced NaN or infinite logits"}
    one = batch[:1]
    model.predict(one, preprocessed=True)
    t0 = time.perf_counter()
    for _ in range(5):
        model.predict(one, preprocessed=True)
    return {"ok": True, "latency_ms": (time.perf_counter() - t0) / 5 * 1e3}


def main(argv: list[str] | None = None) -> int:
    """``python -m fedge.runtime.checks MODEL_DIR``: print one JSON line, the smoke test's result."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(json.dumps({"ok": False, "error": f"usage: python -m fedge.runtime.checks MODEL_DIR ({args})"}))
        return 2
    try:
        result = _child(args[0])
    except Exception as exc:  # the parent reports it as a failed check
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
