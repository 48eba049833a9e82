"""The checks a device runs on a new model version before it switches it in.

* **Smoke test** (:func:`smoke_test`): in a *child process* (``python -m fedge.runtime.checks DIR``), so a
  model that crashes ONNX Runtime, or exhausts the device's memory, fails the check instead of killing the
  agent: load the model (checksums verified), run a batch, check the logits' shape and that they are
  finite, time a batch-1 inference. Bounded by a timeout. The child raises its own ``oom_score_adj`` to
  1000 first, so that when the device (or its container's memory cgroup) runs out of memory the kernel kills
  the child, not the agent, which holds more memory (torch) and would otherwise be chosen.
* **Local accuracy** (:func:`accuracy`): the model's accuracy on the device's own validation split (the
  preprocessed local test split it already holds), compared by the updater with the current model's. Given
  ``validation`` (and ``current``), :func:`smoke_test` measures both in the same child: the agent never loads
  ONNX Runtime or a model itself (on a Pi Zero 2 W's 432 MiB, the agent's torch plus the sessions and arenas of
  two in-process accuracy checks got it killed by the third update; ``benchmarks/ota_emulate.py``).

numpy and ONNX Runtime only, like the rest of :mod:`fedge.runtime`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SMOKE_TIMEOUT_S = 120.0
OOM_SCORE_ADJ = 1000  # the check's child is the first process the kernel kills when memory runs out


@dataclass(frozen=True)
class SmokeResult:
    """What the child process found (``ok`` False: ``error`` says why)."""

    ok: bool
    error: str = ""
    latency_ms: float | None = None
    seconds: float = 0.0
    accuracy: dict[str, float] | None = None  # with validation: {"new": ..., "current": ...} (current: if given)
    oom_score_adj: int | None = None  # the child's, as it read it back

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "error": self.error, "latency_ms": self.latency_ms, "seconds": round(self.seconds, 3)}


def smoke_test(model_dir: str | os.PathLike[str], *, timeout_s: float = SMOKE_TIMEOUT_S,
               validation: tuple[np.ndarray, np.ndarray] | None = None,
               current: str | os.PathLike[str] | None = None) -> SmokeResult:
    """Run the model in a child process (see the module docstring); with ``validation`` = (x, y), also its
    accuracy there and, with ``current``, the current model's (``SmokeResult.accuracy``)."""
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "fedge.runtime.checks", str(model_dir)]
    with tempfile.TemporaryDirectory(prefix="fedge-check-") as tmp:
        if validation is not None:
            x, y = validation
            split = Path(tmp) / "validation.npz"
            np.savez(split, x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64))
            cmd += ["--validation", str(split)] + (["--current", str(current)] if current is not None else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
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
        acc = out.get("accuracy")
        return SmokeResult(bool(out["ok"]), str(out.get("error", "")), out.get("latency_ms"), spent,
                           {str(k): float(v) for k, v in acc.items()} if isinstance(acc, dict) else None,
                           out.get("oom_score_adj"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return SmokeResult(False, f"the model's test process printed no result: {last[:200]!r}", seconds=spent)


def accuracy(model_dir: str | os.PathLike[str], x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of the model on preprocessed inputs ``x`` (N, C, S, S) with labels ``y``."""
    from fedge.runtime.model import EdgeModel

    model = EdgeModel.load(model_dir)
    if len(y) == 0:
        return float("nan")
    labels = model.predict(np.asarray(x, dtype=np.float32), preprocessed=True).labels
    return float(np.mean(labels == np.asarray(y)))


def _prefer_to_be_killed() -> int | None:
    """Raise this process's ``oom_score_adj`` (an unprivileged process may raise its own) and read it back."""
    path = Path("/proc/self/oom_score_adj")
    with contextlib.suppress(OSError):
        path.write_text(str(OOM_SCORE_ADJ))
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text())
    return None


def _child(model_dir: str, validation: str | None = None, current: str | None = None) -> dict[str, Any]:
    from fedge.runtime.model import EdgeModel

    model = EdgeModel.load(model_dir)
    rng = np.random.default_rng(0)
    # within every kind's preprocessed range (normalized pixels, audio samples in [-1, 1], sensor values)
    batch = rng.uniform(-1, 1, (8, *model.input_shape)).astype(np.float32)
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
    out: dict[str, Any] = {"ok": True, "latency_ms": (time.perf_counter() - t0) / 5 * 1e3}
    if validation is not None:
        del model  # one model in memory at a time
        with np.load(validation, allow_pickle=False) as split:
            x, y = split["x"], split["y"]
        acc = {"new": accuracy(model_dir, x, y)}
        if current is not None:
            acc["current"] = accuracy(current, x, y)
        out["accuracy"] = {k: (v if math.isfinite(v) else None) for k, v in acc.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m fedge.runtime.checks MODEL_DIR [--validation SPLIT.npz [--current DIR]]``: print one JSON
    line, the smoke test's result (and the accuracies)."""
    oom = _prefer_to_be_killed()
    args = sys.argv[1:] if argv is None else argv
    opts = dict(zip(args[1::2], args[2::2], strict=False))
    if len(args) % 2 != 1 or set(opts) - {"--validation", "--current"} or not Path(args[0]).is_dir():
        print(json.dumps({"ok": False, "error": "usage: python -m fedge.runtime.checks MODEL_DIR [--validation "
                                                f"SPLIT.npz [--current DIR]] ({args})"}))
        return 2
    try:
        result = _child(args[0], opts.get("--validation"), opts.get("--current"))
    except Exception as exc:  # the parent reports it as a failed check
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps({**result, "oom_score_adj": oom}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
