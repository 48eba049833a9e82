"""Checks an export must pass before it is written, and the measurements it records.

* fp32 parity: max |ONNX Runtime − PyTorch| ≤ :data:`FP32_TOLERANCE` on a fixed batch, per graph;
* quantized accuracy: within :data:`MAX_ACCURACY_DROP` (1 point) of the fp32 graph on a test set;
* latency: median of repeated batch-1 runs on one thread.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedge.errors import ExportError
from fedge.export.onnx_export import graph_modules
from fedge.runtime.manifest import GRAPHS
from fedge.runtime.model import open_session

log = logging.getLogger(__name__)

FP32_TOLERANCE = 1e-4
MAX_ACCURACY_DROP = 0.01  # accuracy is a fraction: 0.01 = 1 percentage point


def run_onnx(session: Any, x: np.ndarray, *, batch_size: int = 512) -> np.ndarray:
    """All outputs of the first graph output for ``x``, in chunks."""
    name = session.get_inputs()[0].name
    return np.concatenate([
        session.run(None, {name: np.ascontiguousarray(x[i : i + batch_size], dtype=np.float32)})[0]
        for i in range(0, len(x), batch_size)
    ]).astype(np.float32)


@torch.no_grad()
def reference_outputs(net: torch.nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
    """PyTorch outputs of every graph for ``x`` (the head is fed the PyTorch embeddings)."""
    mods = graph_modules(net.eval())  # type: ignore[arg-type]
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    emb = mods["extractor"][0](xt)
    return {
        "model": mods["model"][0](xt).numpy(),
        "extractor": emb.numpy(),
        "head": mods["head"][0](emb).numpy(),
        "_embedding": emb.numpy(),
    }


@dataclass(frozen=True)
class Parity:
    """Max |ORT − PyTorch| per graph on the fixed batch."""

    max_abs_diff: dict[str, float]
    batch: int


def check_fp32_parity(net: torch.nn.Module, paths: dict[str, Path], x: np.ndarray,
                      tol: float = FP32_TOLERANCE) -> Parity:
    """Compare every fp32 graph with PyTorch on ``x``; beyond ``tol`` is an :class:`ExportError`."""
    ref = reference_outputs(net, x)
    diffs: dict[str, float] = {}
    for name, path in paths.items():
        feed = ref["_embedding"] if GRAPHS[name][0] == "embedding" else x
        out = run_onnx(open_session(path), feed)
        if out.shape != ref[name].shape:
            raise ExportError(f"{path.name}: ONNX output shape {out.shape} differs from PyTorch {ref[name].shape}")
        diffs[name] = float(np.abs(out - ref[name]).max())
    worst = max(diffs, key=lambda k: diffs[k])
    if diffs[worst] > tol:
        raise ExportError(
            f"fp32 ONNX drifted from PyTorch: max |ORT − PyTorch| = {diffs[worst]:.3g} > {tol:g} on "
            f"{worst}.onnx (output {GRAPHS[worst][1]!r}, fixed batch of {len(x)})",
            hint="call model.eval() before exporting (training-mode BatchNorm differs), "
                 "or try exporter='dynamo'",
        )
    log.info("fp32 parity: %s", ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))
    return Parity(diffs, len(x))


def onnx_accuracy(path: Path, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of an image → logits graph."""
    return float((run_onnx(open_session(path), x).argmax(1) == y).mean())


def chained_accuracy(extractor: Path, head: Path, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of ``head(extractor(x))`` through the two exported graphs."""
    return float((run_onnx(open_session(head), run_onnx(open_session(extractor), x)).argmax(1) == y).mean())


BATCH_DEPENDENCE_IMAGES = 1000  # enough to see a rare flip, cheap at batch 1 (~0.1 s for tier-xs)


def batch_dependence(path: Path, x: np.ndarray, *, batch: int = 256) -> dict[str, Any]:
    """How much a graph's results depend on what else is in the batch: batch 1 vs batches of ``batch``.

    int8-dynamic quantizes activations with a scale computed at run time over the whole
    input tensor, so an image's logits change with its batch-mates; static levels do not.
    """
    x = x[:BATCH_DEPENDENCE_IMAGES]
    sess = open_session(path)
    batched = run_onnx(sess, x, batch_size=batch)
    single = run_onnx(sess, x, batch_size=1)
    changed = int((batched.argmax(1) != single.argmax(1)).sum())
    return {"images": len(x), "batch": batch, "predictions_changed": changed,
            "max_abs_logit_diff": float(np.abs(batched - single).max())}


def check_accuracy(quant: str, acc: float, fp32_acc: float, *, n: int, where: str,
                   max_drop: float = MAX_ACCURACY_DROP) -> None:
    """A quantized graph may lose at most ``max_drop`` accuracy against fp32."""
    drop = fp32_acc - acc
    if drop > max_drop + 1e-12:
        raise ExportError(
            f"{quant} accuracy drifted: {where} scores {acc:.2%} vs fp32 {fp32_acc:.2%} on {n} test images, "
            f"a drop of {100 * drop:.2f} points (the bound is {100 * max_drop:g})",
            hint=("calibrate on more or more representative samples of the device's data, or "
                  if quant == "int8-static" else "")
                 + "choose a milder quantization for this profile (int8-static → int8-dynamic → fp16 → fp32)",
        )


def median_ms(fn: Callable[[], Any], *, runs: int = 200, warmup: int = 20) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = np.empty(runs)
    for i in range(runs):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return float(np.median(times) * 1e3)


def onnx_latency_ms(path: Path, x1: np.ndarray, *, runs: int = 200, threads: int = 1) -> float:
    """Batch-1 median latency of an ONNX graph on ``threads`` threads."""
    sess = open_session(path, threads=threads)
    name = sess.get_inputs()[0].name
    feed = {name: np.ascontiguousarray(x1[:1], dtype=np.float32)}
    return median_ms(lambda: sess.run(None, feed), runs=runs)


def interleaved_medians(fns: dict[str, Callable[[], Any]], *, runs: int, rounds: int = 10,
                        warmup: int = 20) -> dict[str, float]:
    """Median ms of each fn over ``runs`` calls; the fns take turns in ``rounds`` blocks.

    On a shared or throttling machine the load drifts; taking turns makes the drift
    hit every fn alike, so their ratio is robust even when absolute times are not.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    per = max(1, runs // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {k: float(np.median(v) * 1e3) for k, v in samples.items()}


def onnx_latencies_ms(paths: dict[str, Path], x1: np.ndarray, *, runs: int = 200,
                      threads: int = 1) -> dict[str, float]:
    """Batch-1 median latency of several graphs of the same input, measured taking turns."""
    feed = np.ascontiguousarray(x1[:1], dtype=np.float32)
    fns: dict[str, Callable[[], Any]] = {}
    for key, path in paths.items():
        sess = open_session(path, threads=threads)
        fns[key] = functools.partial(sess.run, None, {sess.get_inputs()[0].name: feed})
    return interleaved_medians(fns, runs=max(runs, 1), rounds=min(10, max(runs, 1)))


def torch_latency_ms(net: torch.nn.Module, x1: np.ndarray, *, runs: int = 200) -> float:
    """Batch-1 median latency of PyTorch eager (inference mode) on the current thread setting."""
    net = net.eval()
    xt = torch.from_numpy(np.ascontiguousarray(x1[:1], dtype=np.float32))

    def step() -> None:
        with torch.inference_mode():
            net(xt)

    return median_ms(step, runs=runs)
