"""``fedge infer``: classify images, .npy arrays or audio with a directory written by ``fedge export``.

The runtime's own command, on the device-sized install: numpy, ONNX Runtime and Pillow, never torch or onnx
(the ``runtime`` contract of ``[tool.importlinter]``). The fleet key's check (cryptography) is imported only
when ``--fleet-key`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from fedge.errors import ConfigError

if TYPE_CHECKING:
    from fedge.runtime.model import EdgeModel

Parsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # argparse's type, generic for mypy only


def add_parser(sub: Parsers) -> None:
    """Register ``fedge infer``."""
    inf = sub.add_parser(
        "infer", help="classify images or .npy arrays with an exported model",
        description="Run an exported model directory on PNG/JPEG images, .npy arrays of raw pixels, or every "
                    "image in a directory (numpy and ONNX Runtime only). Checksums are verified first.",
    )
    which = inf.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="a directory written by `fedge export`")
    which.add_argument("--store", metavar="DIR",
                       help="a device's model store (`fedge edge run --model-store`): the version in use; a new "
                            "version that keeps crashing before it classified anything is rolled back by itself")
    inf.add_argument("inputs", nargs="*", metavar="INPUT",
                     help="image files, .npy arrays, or directories (each image and .npy array directly in them)")
    inf.add_argument("--preprocessed", action="store_true",
                     help=".npy files already hold model inputs (N, C, S, S) at the model's size, not raw pixels")
    inf.add_argument("--top", type=int, default=1, help="show the K most likely classes (default 1)")
    inf.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inf.add_argument("--out", metavar="FILE.csv|FILE.json",
                     help="write the predictions to a CSV or JSON file instead of printing them")
    inf.add_argument("--provider", action="append", metavar="NAME",
                     help="ONNX Runtime execution provider to use (repeatable; default: every available one in "
                          "fedge's order, see docs/export.md)")
    inf.add_argument("--check", action="store_true",
                     help="verify the export and report the execution provider that runs it; no inputs needed")
    inf.add_argument("--fleet-key", metavar="FILE", default=os.environ.get("FEDGE_FLEET_KEY"),
                     help="the fleet's public key (a bundle's fleet.pub; default: $FEDGE_FLEET_KEY): the manifest must "
                          "carry the fleet's signature, or nothing runs")
    inf.add_argument("-v", "--verbose", action="store_true",
                     help="report the model, its quantization and the execution provider that ran it (on stderr)")
    inf.set_defaults(func=_infer)


INFER_CHUNK = 256  # files read and classified at a time: memory stays bounded on a large directory


def _model_report(model: EdgeModel) -> list[str]:
    from fedge.runtime import providers as eps

    m = model.manifest
    lines = [f"{model.dir}: {m.arch} as {m.quant}, {len(m.classes)} classes, {len(m.files)} files verified "
             "(size and sha256)"]
    decision = m.extra.get("quantization") or {}
    if decision.get("reason"):
        lines.append(f"  quantization: {decision['reason']}")
    lines.append(f"  execution provider: {model.provider} (session providers: {', '.join(model.providers)}; "
                 f"available here: {', '.join(eps.available())})")
    if m.quant == "fp16" and model.provider not in eps.FP16_PROVIDERS:
        lines.append(f"  note: an fp16 model on {model.provider} runs through casts, no faster than fp32")
    return lines


def _infer(args: argparse.Namespace) -> int:
    import sys

    from fedge.runtime import EdgeModel, load_inputs
    from fedge.runtime.inputs import expand_inputs

    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    if args.out and Path(args.out).suffix.lower() not in (".csv", ".json"):
        raise ConfigError(f"--out {args.out}: write a .csv or a .json file")
    if not args.inputs and not args.check:
        raise ConfigError("no inputs given", hint="pass image files, .npy arrays or directories, or --check")
    verifier = None
    if args.fleet_key:
        from fedge.common.signing import Verifier

        verifier = Verifier.from_file(args.fleet_key)
    store = None
    if args.store:
        from fedge.runtime.store import ModelStore

        store = ModelStore(args.store)
        args.model = str(store.open_current())  # counts a start of a version on trial (rolls back a crashing one)
    model = EdgeModel.load(args.model, providers=args.provider, verifier=verifier)
    if store is not None and args.check:
        store.confirm()
    if args.check or args.verbose:
        print("\n".join(_model_report(model)), file=sys.stderr if not args.check else sys.stdout)
    if not args.inputs:
        return 0
    files = expand_inputs(args.inputs)
    k = min(args.top, len(model.classes))
    rows: list[dict[str, Any]] = []
    from fedge.common.progress import Progress  # not tqdm: the device-sized install has none

    with Progress(len(files), desc="classifying", unit="file", stream=sys.stderr) as bar:
        for start in range(0, len(files), INFER_CHUNK):
            chunk = files[start : start + INFER_CHUNK]
            batch = load_inputs(chunk, model.norm, preprocessed=args.preprocessed)
            probs = model.predict(batch.x, preprocessed=True).probs
            if store is not None and start == 0:
                store.confirm()  # it ran inference: the version's trial is over
            order = probs.argsort(axis=1)[:, ::-1][:, :k]
            rows += [
                {"input": name, "top": [{"class": model.classes[j], "index": int(j),
                                         "prob": float(probs[i, j])} for j in order[i]]}
                for i, name in enumerate(batch.names)
            ]
            bar.update(len(chunk))
    if args.out:
        _write_predictions(Path(args.out), rows)
        print(f"wrote {len(rows)} predictions to {args.out}", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["input"]) for r in rows)
    for r in rows:
        print(f"{r['input'].ljust(width)}  " + "  ".join(f"{t['class']} ({t['prob']:.1%})" for t in r["top"]))
    return 0


def _write_predictions(path: Path, rows: list[dict[str, Any]]) -> None:
    """``--out``: JSON as printed by --json, or CSV with one row per input and rank."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        return
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["input", "rank", "class", "index", "prob"])
        for r in rows:
            for rank, t in enumerate(r["top"], 1):
                w.writerow([r["input"], rank, t["class"], t["index"], f"{t['prob']:.6f}"])
