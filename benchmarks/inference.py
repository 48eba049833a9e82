"""On-device inference benchmark (issue 5): ONNX size, batch-1 latency and accuracy per model.

For each GeFL CNN (CNN-1 ... CNN-10, published sizes) and each planner tier (tier-xs ... tier-xl):
parameters; ONNX file size at fp32, fp16, int8 static (QDQ, per-channel) and int8 dynamic;
batch-1 single-thread latency of PyTorch eager, ONNX Runtime fp32 and ONNX Runtime int8,
interleaved in one run (medians); top-1 accuracy of fp32 and int8 on the full Fashion-MNIST
test set.

Each model is first trained briefly on Fashion-MNIST (default: 2 epochs on a fixed random
12 000-image subset of the training set, SGD lr 0.02, momentum 0.9, batch 64), enough for a
meaningful accuracy, not a tuned one. int8 static is calibrated on 256 training images.

    python -m benchmarks.inference                 # everything, ~5 min on one core
    python -m benchmarks.inference --archs cnn1 tier-m --train-images 2000 --epochs 1   # smoke run
    python -m benchmarks.inference --overhead-only  # only fedge's runtime overhead, ~3 min

Runtime overhead (issue 16): ``EdgeModel.logits`` and ``EdgeModel.predict(...).labels`` on a
preprocessed batch-1 input vs a bare ``InferenceSession.run(None, feed)`` with a pre-built feed,
on the same session, input and thread, interleaved; --repeats measurements, the median ratio
reported with the spread, and the execution provider that ran. Also timed: the C++ session under
the Python wrapper (``InferenceSession._sess.run``, "core"), which fedge calls directly: the
``/ core`` columns are what the wrapper, and what fedge, add to ONNX Runtime's own floor.

Targets: ORT fp32 >= 3x faster than PyTorch eager at batch 1 on one thread; int8 files <= 0.3x
the fp32 size; int8 accuracy within 1 point of fp32; fedge's runtime <= 1.10x a bare session run.
Writes benchmarks/results/inference.json (per-model cells are cached under
benchmarks/results/inference/ and inference-overhead/ so an interrupted run resumes; --force
recomputes) and prints a table; --docs rewrites the figures section of docs/export.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import REPO, RESULTS, cached_cell, markdown_table, text_table, write_docs_section
from fedge.common.archs import TIERS, ArchSpec, arch_by_name, gefl_cnn, tier_arch
from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.models.zoo import build_model
from fedge.edge.training import TrainConfig, train_epochs
from fedge.export.probe import detect_hardware
from fedge.export.variants import model_variants
from fedge.export.verify import interleaved_medians, run_onnx
from fedge.runtime import EdgeModel
from fedge.runtime.manifest import FileEntry, Manifest
from fedge.runtime.model import open_session

DOCS = REPO / "docs" / "export.md"
ALL_ARCHS = [f"cnn{k}" for k in range(1, 11)] + [f"tier-{t}" for t in TIERS]
QUANTS = ("fp32", "fp16", "int8-static", "int8-dynamic")
TRAIN = TrainConfig(lr=0.02, batch_size=64, momentum=0.9)
SPEEDUP_TARGET, SIZE_TARGET, DROP_TARGET = 3.0, 0.3, 1.0


def spec_of(name: str) -> ArchSpec:
    if name.startswith("tier-"):
        return tier_arch(name.removeprefix("tier-"))
    if name.startswith("cnn") and name[3:].isdigit():
        return gefl_cnn(int(name[3:]))
    return arch_by_name(name)


def run_model(name: str, train: Dataset, test: Dataset, *, epochs: int, runs: int, seed: int) -> dict[str, Any]:
    spec = spec_of(name)
    torch.manual_seed(seed)
    net = build_model(spec, seed=seed, num_classes=train.num_classes)
    t0 = time.perf_counter()
    train_epochs(net, train.x, train.y, TRAIN, np.random.default_rng(seed), epochs=epochs)
    train_s = time.perf_counter() - t0
    net.eval()
    calib = train.x[np.random.default_rng(seed).choice(len(train), 256, replace=False)]
    x1 = torch.from_numpy(test.x[:1].copy())
    with tempfile.TemporaryDirectory(prefix="fedge-bench-") as work:
        paths = model_variants(net, work, quants=QUANTS, calib=calib)
        sizes = {q: p.stat().st_size for q, p in paths.items()}
        sessions = {q: open_session(p, threads=1) for q, p in paths.items()}
        with torch.no_grad():
            torch_logits = torch.cat([net(torch.from_numpy(test.x[i : i + 1000])) for i in range(0, len(test), 1000)])
        logits = {q: run_onnx(s, test.x) for q, s in sessions.items()}
        acc = {q: float((lg.argmax(1) == test.y).mean()) for q, lg in logits.items()}
        acc["pytorch"] = float((torch_logits.argmax(1).numpy() == test.y).mean())
        agreement = float((logits["fp32"].argmax(1) == torch_logits.argmax(1).numpy()).mean())
        max_diff = float(np.abs(logits["fp32"][:64] - torch_logits[:64].numpy()).max())

        def eager() -> None:
            with torch.inference_mode():
                net(x1)

        feed = {"image": test.x[:1]}

        def ort(session: Any) -> Callable[[], Any]:
            return lambda: session.run(None, feed)

        fns: dict[str, Callable[[], Any]] = {"pytorch": eager}
        fns.update({f"ort-{q}": ort(s) for q, s in sessions.items()})
        latency = interleaved_medians(fns, runs=runs)
    return {
        "arch": spec.name, "params": spec.num_params(), "macs": spec.macs(),
        "bytes": sizes, "latency_ms": latency, "accuracy": acc,
        "fp32_agreement_with_pytorch": agreement, "fp32_max_abs_diff": max_diff,
        "train_seconds": train_s, "train_images": len(train), "epochs": epochs, "runs": runs,
        "load_average": os.getloadavg()[0],  # the machine may be shared: how quiet it was
    }


OVERHEAD_TARGET = 1.10


def edge_model(fp32: Path, spec: ArchSpec, test: Dataset) -> EdgeModel:
    """An :class:`EdgeModel` over one fused graph: the runtime's own code path, as on a device."""
    manifest = Manifest(
        arch=spec.name, quant="fp32", opset=17, input_shape=("batch", 1, 32, 32),
        normalization={"dataset": test.name, **test.norm.to_dict()}, classes=tuple(test.classes),
        files={fp32.name: FileEntry.of(fp32)},
        graphs={"model": {"file": fp32.name, "input": "image", "output": "logits"}},
    )
    model = EdgeModel(fp32.parent, manifest, threads=1)
    model.graph("model")
    return model


def run_overhead(name: str, test: Dataset, *, runs: int, repeats: int, seed: int) -> dict[str, Any]:
    """fedge's runtime vs a bare ``InferenceSession.run`` on the same session, input and thread.

    Timing does not depend on the weights, so the model is not trained. ``repeats``
    interleaved measurements; the ratio of each is kept and their median reported.
    """
    spec = spec_of(name)
    torch.manual_seed(seed)
    net = build_model(spec, seed=seed, num_classes=test.num_classes).eval()
    with tempfile.TemporaryDirectory(prefix="fedge-bench-") as work:
        fp32 = model_variants(net, work, quants=("fp32",))["fp32"]
        model = edge_model(fp32, spec, test)
        sess = model.session("model")
        x1 = np.ascontiguousarray(test.x[:1])
        feed = {"image": x1}  # the bare run gets a pre-built feed: its best case
        core = sess._sess  # the C++ session under the Python wrapper: ONNX Runtime's own floor
        fns: dict[str, Callable[[], Any]] = {
            "bare": lambda: sess.run(None, feed),
            "core": lambda: core.run(["logits"], feed, None),
            "logits": lambda: model.logits(x1, preprocessed=True),
            "predict": lambda: model.predict(x1, preprocessed=True).labels,
        }
        reps = [interleaved_medians(fns, runs=runs, rounds=10, warmup=100) for _ in range(repeats)]
        provider = model.provider
    ratios = {k: [r[k] / r["bare"] for r in reps] for k in ("logits", "predict")}
    # What fedge adds to ONNX Runtime's core (fedge calls it directly, skipping the wrapper's checks).
    core_ratios = {k: [r[k] / r["core"] for r in reps] for k in ("bare", "logits", "predict")}
    return {
        "arch": spec.name, "provider": provider, "runs": runs, "repeats": repeats,
        "latency_ms": {k: float(np.median([r[k] for r in reps])) for k in fns},
        "ratio": {k: float(np.median(v)) for k, v in ratios.items()},
        "ratio_range": {k: [float(min(v)), float(max(v))] for k, v in ratios.items()},
        "ratio_to_core": {k: float(np.median(v)) for k, v in core_ratios.items()},
        "load_average": os.getloadavg()[0],
    }


def derived(cell: dict[str, Any]) -> dict[str, float]:
    lat, b, acc = cell["latency_ms"], cell["bytes"], cell["accuracy"]
    return {
        "speedup_fp32": lat["pytorch"] / lat["ort-fp32"],
        "speedup_int8": lat["pytorch"] / lat["ort-int8-static"],
        "int8_vs_fp32_latency": lat["ort-int8-static"] / lat["ort-fp32"],
        "size_int8": b["int8-static"] / b["fp32"],
        "size_int8_dynamic": b["int8-dynamic"] / b["fp32"],
        "size_fp16": b["fp16"] / b["fp32"],
        "drop_int8": 100 * (acc["fp32"] - acc["int8-static"]),
        "drop_int8_dynamic": 100 * (acc["fp32"] - acc["int8-dynamic"]),
    }


def table_rows(cells: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "params", "fp32 KiB", "fp16", "int8", "int8 dyn", "PyTorch ms", "ORT fp32 ms", "ORT int8 ms",
              "fp32 speedup", "acc fp32", "acc int8", "drop", "acc int8 dyn"]
    rows = []
    for c in cells:
        d, lat, acc = derived(c), c["latency_ms"], c["accuracy"]
        rows.append([
            c["arch"], f"{c['params']:,}", f"{c['bytes']['fp32'] / 1024:.1f}", f"{d['size_fp16']:.2f}x",
            f"{d['size_int8']:.2f}x", f"{d['size_int8_dynamic']:.2f}x", f"{lat['pytorch']:.3f}",
            f"{lat['ort-fp32']:.3f}", f"{lat['ort-int8-static']:.3f}", f"{d['speedup_fp32']:.1f}x",
            f"{100 * acc['fp32']:.2f}", f"{100 * acc['int8-static']:.2f}", f"{d['drop_int8']:+.2f}",
            f"{100 * acc['int8-dynamic']:.2f}",
        ])
    return header, rows


def overhead_rows(cells: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "provider", "bare ORT ms", "fedge logits ms", "fedge predict ms", "logits / bare",
              "predict / bare", "logits range", "predict range", "bare / core", "predict / core"]
    rows = []
    for c in cells:
        lat, r, rr = c["latency_ms"], c["ratio"], c["ratio_range"]
        rc = c.get("ratio_to_core", {})
        rows.append([
            c["arch"], c["provider"].removesuffix("ExecutionProvider"), f"{lat['bare']:.4f}", f"{lat['logits']:.4f}",
            f"{lat['predict']:.4f}", f"{r['logits']:.3f}x", f"{r['predict']:.3f}x",
            f"{rr['logits'][0]:.3f}-{rr['logits'][1]:.3f}", f"{rr['predict'][0]:.3f}-{rr['predict'][1]:.3f}",
            *(f"{rc[k]:.3f}x" if k in rc else "-" for k in ("bare", "predict")),
        ])
    return header, rows


def overhead_summary(cells: list[dict[str, Any]]) -> str:
    bad = [f"{c['arch']} {k} ({c['ratio'][k]:.3f})" for c in cells for k in ("logits", "predict")
           if c["ratio"][k] > OVERHEAD_TARGET]
    worst = max(max(c["ratio"].values()) for c in cells)
    return (f"fedge runtime <= {OVERHEAD_TARGET:g}x bare InferenceSession.run (median of the repeats): "
            + ("met by all" if not bad else f"missed by {len(bad)}: {', '.join(bad)}") + f"; worst {worst:.3f}x")


def target_summary(cells: list[dict[str, Any]]) -> list[str]:
    ds = {c["arch"]: derived(c) for c in cells}

    def misses(key: str, ok: Callable[[float], bool]) -> str:
        bad = [f"{a} ({d[key]:.3f})" for a, d in ds.items() if not ok(d[key])]
        return "met by all" if not bad else f"missed by {len(bad)}/{len(ds)}: {', '.join(bad)}"

    return [
        f"ORT fp32 >= {SPEEDUP_TARGET:g}x faster than PyTorch eager: {misses('speedup_fp32', lambda v: v >= 3.0)}",
        f"int8 (static QDQ) file <= {SIZE_TARGET:g}x fp32: {misses('size_int8', lambda v: v <= SIZE_TARGET)}",
        f"int8 accuracy within {DROP_TARGET:g} point: {misses('drop_int8', lambda v: v <= DROP_TARGET)}",
        "int8 static faster than ORT fp32 on: "
        + (", ".join(a for a, d in ds.items() if d["int8_vs_fp32_latency"] < 1) or "none"),
    ]


def load_note(cells: list[dict[str, Any]]) -> str:
    loads = [c["load_average"] for c in cells if c.get("load_average") is not None]
    return f", 1-min load average {min(loads):.1f}-{max(loads):.1f} while timing" if loads else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=ALL_ARCHS)
    ap.add_argument("--train-images", type=int, default=12_000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=500, help="timed batch-1 runs per engine and model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", help="Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)")
    ap.add_argument("--overhead-runs", type=int, default=3000,
                    help="timed batch-1 calls per variant in each runtime-overhead repeat")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the runtime-overhead measurement")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only measure fedge's runtime overhead (no training, no accuracy)")
    ap.add_argument("--force", action="store_true", help="recompute cached per-model cells")
    ap.add_argument("--docs", action="store_true", help="rewrite the figures section of docs/export.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    test = load_dataset("fmnist", train=False, data_dir=args.data_dir)
    overhead = []
    for name in args.archs:
        cell = cached_cell(RESULTS / "inference-overhead" / f"{name}-r{args.overhead_runs}x{args.repeats}.json",
                           functools.partial(run_overhead, name, test, runs=args.overhead_runs,
                                             repeats=args.repeats, seed=args.seed), force=args.force)
        overhead.append(cell)
        print(f"{name}: fedge logits {cell['ratio']['logits']:.3f}x, predict {cell['ratio']['predict']:.3f}x "
              f"a bare InferenceSession.run on {cell['provider']}", flush=True)
    oheader, orows = overhead_rows(overhead)
    if args.overhead_only:
        print()
        print(text_table(oheader, orows))
        print(overhead_summary(overhead))
        return 0
    full = load_dataset("fmnist", train=True, data_dir=args.data_dir)
    idx = np.sort(np.random.default_rng(args.seed).choice(len(full), min(args.train_images, len(full)),
                                                          replace=False))
    train = full.subset(idx)
    tag = f"n{len(train)}-e{args.epochs}-r{args.runs}-s{args.seed}"
    cells = []
    for name in args.archs:
        t0 = time.perf_counter()
        cell = cached_cell(RESULTS / "inference" / f"{name}-{tag}.json",
                           functools.partial(run_model, name, train, test, epochs=args.epochs, runs=args.runs,
                                             seed=args.seed), force=args.force)
        cells.append(cell)
        d = derived(cell)
        print(f"{name}: fp32 speedup {d['speedup_fp32']:.1f}x, int8 size {d['size_int8']:.2f}x, "
              f"drop {d['drop_int8']:+.2f} points ({time.perf_counter() - t0:.0f} s)", flush=True)

    import onnxruntime

    command = "python -m benchmarks.inference " + " ".join(sys.argv[1:])
    meta: dict[str, Any] = {
        "command": command.strip(),
        "machine": {"platform": platform.platform(), "cpu": detect_hardware()["cpu"],
                    "python": platform.python_version(), "torch": torch.__version__,
                    "onnxruntime": onnxruntime.__version__},
        # The machine may be shared: how quiet it was while each model was timed.
        "load_average": [c.get("load_average") for c in cells],
        "threads": 1, "batch": 1, "statistic": "median", "dataset": "fmnist",
        "train": {"images": len(train), "epochs": args.epochs, "lr": TRAIN.lr, "momentum": TRAIN.momentum,
                  "batch_size": TRAIN.batch_size, "seed": args.seed},
        "test_images": len(test), "calibration_images": 256,
        "targets": [*target_summary(cells), overhead_summary(overhead)],
        "overhead": {"runs": args.overhead_runs, "repeats": args.repeats,
                     "what": "EdgeModel.logits / predict(x, preprocessed=True) vs InferenceSession.run(None, "
                             "pre-built feed) on the same session, batch 1, one thread, interleaved"},
    }
    out = RESULTS / "inference.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "models": [{**c, "derived": derived(c)} for c in cells],
                               "overhead": overhead}, indent=1))
    header, rows = table_rows(cells)
    print()
    print(text_table(header, rows))
    print()
    print(text_table(oheader, orows))
    print()
    print("\n".join(meta["targets"]))
    print(f"\nwrote {out}")
    if args.docs:
        body = (f"Measured with `{meta['command']}` on {meta['machine']['cpu']} "
                f"({meta['machine']['platform']}{load_note(cells)}), torch "
                f"{torch.__version__}, onnxruntime {onnxruntime.__version__}; one thread, batch 1, medians of "
                f"{args.runs} interleaved runs; "
                f"accuracy on the {len(test):,} Fashion-MNIST test images after {args.epochs} epochs on "
                f"{len(train):,} training images. Sizes are relative to the fp32 file.\n\n"
                + markdown_table(header, rows) + "\n\n"
                + f"fedge's runtime vs a bare `InferenceSession.run` (same session, same input, pre-built feed, one "
                  f"thread, batch 1{load_note(overhead)}): {args.repeats} repeats of {args.overhead_runs} "
                  "interleaved calls each; the ratio is the median over the repeats, the range their spread. "
                  "*core* is the C++ session under the Python wrapper (`InferenceSession._sess.run`), which fedge "
                  "calls directly: `bare / core` is what the wrapper adds, `predict / core` what fedge adds to "
                  "ONNX Runtime's own floor.\n\n"
                + markdown_table(oheader, orows) + "\n\n" + "\n".join(f"- {t}" for t in meta["targets"]))
        write_docs_section("inference-benchmark", body, path=DOCS)
        print(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
