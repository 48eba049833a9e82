"""Export a trained network for a device: ONNX graphs, quantization per plan, checks, manifest.

Everything is written into a hidden staging directory beside ``out`` and moved
into place only after every check passed, so a failed export leaves nothing
half-written in the output directory.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import logging
import os
import platform
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedge import __version__
from fedge.common.atomicfile import rename_atomic
from fedge.common.families import ModelSpec
from fedge.common.preprocess import NORMALIZATION
from fedge.edge.data.datasets import Dataset
from fedge.edge.models.split import SplitNet
from fedge.errors import ExportError
from fedge.export import verify
from fedge.export.decide import QuantRequest, settle
from fedge.export.onnx_export import OPSET, Exporter, export_graphs
from fedge.export.probe import detect_hardware
from fedge.export.quantize import (
    DEFAULT_CALIBRATION_SAMPLES,
    CalibrationSource,
    calibration_inputs,
    compact,
    quantize_file,
)
from fedge.runtime import providers
from fedge.runtime.manifest import GRAPHS, QUANTS, FileEntry, Manifest, write_manifest
from fedge.runtime.model import open_session

log = logging.getLogger(__name__)

PARITY_BATCH = 64  # the fixed batch: the first test images


@dataclass(frozen=True)
class ExportOptions:
    """Knobs of one export (defaults are what ``fedge export`` uses)."""

    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    max_accuracy_drop: float = verify.MAX_ACCURACY_DROP
    fp32_tolerance: float = verify.FP32_TOLERANCE
    latency_runs: int = 100
    opset: int = OPSET
    exporter: Exporter = "torchscript"
    seed: int = 0


@contextmanager
def staged_output(out: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory that replaces ``out`` when the block succeeds.

    The staging directory is a hidden sibling of ``out`` (same file system, so the
    final move is a rename) and is removed if the block raises.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory", hint="choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} already exists and is not empty", hint="pass --force to replace it, or another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the export is an ordinary directory
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    if out.exists():
        rename_atomic(out, old, durable=False)
    rename_atomic(stage, out, durable=False)  # an export promises whole files, not survival of a power cut
    shutil.rmtree(old, ignore_errors=True)


def _quant_request(quant: str | QuantRequest) -> QuantRequest:
    """The level asked for: a level name (shipped as asked) or a :class:`QuantRequest`."""
    if isinstance(quant, str) and quant not in QUANTS:
        raise ExportError(f"unknown quantization {quant!r}", hint=f"use one of {', '.join(QUANTS)}")
    return QuantRequest.explicit(quant) if isinstance(quant, str) else quant


def _check_fits(net: SplitNet, test: Dataset) -> None:
    """Refuse what cannot be exported and verified: not a fedge network, or a test set it does not take."""
    if not isinstance(net, SplitNet):
        raise ExportError(f"can only export fedge networks (FedgeNet, FamilyNet), got {type(net).__name__}")
    spec = net.spec
    if test.norm.sample_shape != tuple(spec.input_shape):
        raise ExportError(
            f"{test.name} inputs are {'x'.join(map(str, test.norm.sample_shape))}, "
            f"but {spec.name} takes {'x'.join(map(str, spec.input_shape))}",
            hint="export with the data set the model was trained on",
        )
    if test.num_classes != spec.num_classes:
        raise ExportError(f"{test.name} has {test.num_classes} classes, {spec.name} predicts {spec.num_classes}",
                          hint="export with the data set the model was trained on")
    if len(test) == 0:
        raise ExportError(f"the {test.name} test set is empty: nothing to verify the export on")


def _normalization(test: Dataset) -> dict[str, Any]:
    """The manifest's preprocessing entry: the test set's normalization, which must be the shared one (at the
    model's input size and channels)."""
    ref = NORMALIZATION.get(test.name)
    if ref is not None:
        ref = dataclasses.replace(ref, size=test.norm.size, channels=test.norm.channels)
    if ref is not None and ref != test.norm:
        raise ExportError(f"{test.name} was normalized with {test.norm}, not the shared {ref}",
                          hint="load data through fedge.edge.data.load_dataset")
    return {"dataset": test.name, **test.norm.to_dict()}


@dataclass(frozen=True)
class Fp32Graphs:
    """The fp32 graphs in the work directory and how they compare with PyTorch."""

    paths: dict[str, Path]
    parity: verify.Parity
    """Max |ORT − PyTorch| per graph on the fixed batch (checked against ``fp32_tolerance``)."""
    accuracy: float
    """Of the fp32 model.onnx on the test set."""
    agreement: float
    """Share of test images on which fp32 ONNX and PyTorch predict the same class."""
    fixed: np.ndarray
    """The fixed batch (the first test images): parity, and latency at batch 1."""


@dataclass(frozen=True)
class Candidate:
    """The requested level's graphs in ``out``, verified; fp32 copies when fp32 was requested."""

    quant: str
    paths: dict[str, Path]
    accuracy: dict[str, float]
    """fp32, and the requested level's (when quantized)."""
    chain: dict[str, float] = field(default_factory=dict)
    """Accuracy of head(extractor(x)), the requested level's graphs chained (when quantized)."""
    dependence: dict[str, Any] | None = None
    """int8-dynamic only: how much a prediction depends on the rest of the batch."""
    calibration: dict[str, Any] | None = None
    """int8-static only: where the calibration inputs came from and how they were used."""


@dataclass(frozen=True)
class Shipped:
    """What goes into the export after the ship decision, and the measurements behind it."""

    quant: str
    paths: dict[str, Path]
    decision: dict[str, Any]
    calibration: dict[str, Any] | None
    latency: dict[str, float]
    cpu: str
    provider: str


def _export_fp32(net: SplitNet, work: Path, opt: ExportOptions) -> dict[str, Path]:
    """Step 1: the extractor, head and fused model as fp32 ONNX graphs in ``work``, compacted."""
    fp32 = export_graphs(net, work, opset=opt.opset, exporter=opt.exporter)
    for p in fp32.values():
        compact(p)
    return fp32


def _check_fp32(net: SplitNet, fp32: dict[str, Path], test: Dataset, opt: ExportOptions) -> Fp32Graphs:
    """Step 2: parity with PyTorch on the fixed batch, the fp32 accuracy and its agreement with PyTorch."""
    fixed = test.x[:PARITY_BATCH]
    parity = verify.check_fp32_parity(net, fp32, fixed, tol=opt.fp32_tolerance)
    fp32_logits = verify.run_onnx(open_session(fp32["model"]), test.x)
    accuracy = float((fp32_logits.argmax(1) == test.y).mean())
    with torch.no_grad():  # in chunks: activations of 10 000 images would take gigabytes
        torch_pred = np.concatenate([
            net(torch.from_numpy(np.ascontiguousarray(test.x[i : i + 500]))).argmax(1).numpy()
            for i in range(0, len(test), 500)
        ])
    agreement = float((fp32_logits.argmax(1) == torch_pred).mean())
    return Fp32Graphs(fp32, parity, accuracy, agreement, fixed)


def _calibration(quant: str, source: CalibrationSource | None, label: str, image_shape: tuple[int, int, int],
                 opt: ExportOptions) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """Step 3: int8-static's calibration inputs and their description (nothing for the other levels)."""
    if quant != "int8-static":
        return None, None
    if source is None:
        raise ExportError("int8-static needs calibration inputs",
                          hint="pass the device's own data or a generator sampler as calibration")
    calib = calibration_inputs(source, opt.calibration_samples, image_shape, seed=opt.seed)
    meta = {"source": label, "samples": len(calib), "method": "minmax", "format": "QDQ", "per_channel": True,
            "activations": "int8", "weights": "int8"}
    return calib, meta


def _quantize(fp32: Fp32Graphs, out: Path, quant: str, calib: np.ndarray | None,
              calib_meta: dict[str, Any] | None, test: Dataset, opt: ExportOptions) -> Candidate:
    """Step 4: the requested level's graphs in ``out`` (fp32: copies), checked against the fp32 accuracy
    as a whole model and as head(extractor(x))."""
    acc = {"fp32": fp32.accuracy}
    if quant == "fp32":
        return Candidate(quant, {name: Path(shutil.copy2(p, out / p.name)) for name, p in fp32.paths.items()}, acc)
    paths = {}
    for name, src in fp32.paths.items():
        feed = calib
        if calib is not None and GRAPHS[name][0] == "embedding":
            # The head is calibrated on what it will see: fp32 embeddings of the calibration images.
            feed = verify.run_onnx(open_session(fp32.paths["extractor"]), calib)
        paths[name] = quantize_file(src, out / src.name, quant, calib=feed, input_name=GRAPHS[name][0])
    acc[quant] = verify.onnx_accuracy(paths["model"], test.x, test.y)
    verify.check_accuracy(quant, acc[quant], acc["fp32"], n=len(test), where="model.onnx",
                          max_drop=opt.max_accuracy_drop)
    dependence = verify.batch_dependence(paths["model"], test.x) if quant == "int8-dynamic" else None
    chain = {quant: verify.chained_accuracy(paths["extractor"], paths["head"], test.x, test.y)}
    verify.check_accuracy(quant, chain[quant], acc["fp32"], n=len(test), where="head(extractor(x))",
                          max_drop=opt.max_accuracy_drop)
    return Candidate(quant, paths, acc, chain, dependence, calib_meta)


def _ship(request: QuantRequest, fp32: Fp32Graphs, candidate: Candidate, out: Path,
          opt: ExportOptions) -> Shipped:
    """Step 5: time fp32 and the candidate on this host and settle the level to ship (:mod:`.decide`); an
    int8 level measured slower than fp32 under a speed check is replaced in ``out`` by the fp32 graphs."""
    quant = candidate.quant
    timed = {"fp32": fp32.paths["model"]} if quant == "fp32" else {"fp32": fp32.paths["model"],
                                                                     quant: candidate.paths["model"]}
    latency = verify.onnx_latencies_ms(timed, fp32.fixed, runs=opt.latency_runs)
    hw_cpu = detect_hardware()["cpu"]
    provider = providers.select()[0]  # what open_session puts first on this host
    shipped, why = settle(request, latency, provider=provider,
                          how=f"batch 1, 1 thread, median of {opt.latency_runs} interleaved runs on {hw_cpu}, "
                              f"{provider}")
    decision: dict[str, Any] = {"requested": quant, "source": request.source, "shipped": shipped, "reason": why}
    paths, calib_meta = candidate.paths, candidate.calibration
    if shipped != quant:
        # Measured slower: ship the verified fp32 graphs; the candidate's figures stay in the metrics.
        for p in paths.values():
            p.unlink()
        paths = {name: Path(shutil.copy2(p, out / p.name)) for name, p in fp32.paths.items()}
        decision["calibration"], calib_meta = calib_meta, None
    return Shipped(shipped, paths, decision, calib_meta, latency, hw_cpu, provider)


def _manifest(spec: ModelSpec, test: Dataset, norm: dict[str, Any], fp32: Fp32Graphs, candidate: Candidate,
              shipped: Shipped, fp32_bytes: dict[str, int], *, profile: str | None, plan: dict[str, Any] | None,
              opt: ExportOptions) -> Manifest:
    """Step 6: the manifest: files, graphs, figures and the decision."""
    import onnxruntime

    image_shape = tuple(spec.input_shape)
    return Manifest(
        arch=spec.name,
        quant=shipped.quant,
        opset=opt.opset,
        input_shape=("batch", *image_shape),
        normalization=norm,
        classes=tuple(test.classes),
        files={p.name: FileEntry.of(p) for p in shipped.paths.values()},
        graphs={name: {"file": shipped.paths[name].name, "input": GRAPHS[name][0], "output": GRAPHS[name][1]}
                for name in GRAPHS},
        profile=profile,
        plan=plan,
        metrics={
            "test_set": {"dataset": test.name, "images": len(test)},
            "accuracy": candidate.accuracy,
            "accuracy_extractor_head": candidate.chain,
            "fp32_agreement_with_pytorch": fp32.agreement,
            "fp32_max_abs_diff": {**fp32.parity.max_abs_diff, "batch": fp32.parity.batch,
                                  "tolerance": opt.fp32_tolerance},
            "latency_ms": shipped.latency,
            "latency": {"batch": 1, "threads": 1, "statistic": "median", "runs": opt.latency_runs,
                        "interleaved": True, "machine": platform.machine(), "cpu": shipped.cpu,
                        "provider": shipped.provider},
            "fp32_bytes": fp32_bytes,
            **({"batch_dependence": candidate.dependence} if candidate.dependence is not None else {}),
        },
        extra={
            "spec": spec.to_dict(),
            "params": spec.num_params(),
            "calibration": shipped.calibration,
            "quantization": shipped.decision,
            "exporter": opt.exporter,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "versions": {"fedge": __version__, "torch": torch.__version__,
                         "onnxruntime": onnxruntime.__version__},
        },
    )


def export_into(
    net: SplitNet,
    out: Path,
    *,
    quant: str | QuantRequest,
    test: Dataset,
    calibration: CalibrationSource | None = None,
    calibration_label: str = "caller-supplied inputs",
    profile: str | None = None,
    plan: dict[str, Any] | None = None,
    options: ExportOptions | None = None,
) -> Manifest:
    """Export ``net`` into the existing empty directory ``out`` (no staging; see :func:`export_model`).

    ``quant`` is a level (shipped as asked) or a :class:`QuantRequest` whose int8
    level may be replaced by fp32 when measured slower on this model (see
    :mod:`fedge.export.decide`); the manifest's ``quantization`` entry says which and why.
    """
    opt = options or ExportOptions()
    request = _quant_request(quant)
    _check_fits(net, test)
    norm = _normalization(test)
    net = copy.deepcopy(net).eval()
    spec = net.spec
    image_shape = tuple(spec.input_shape)
    with tempfile.TemporaryDirectory(prefix="fedge-export-") as work_dir:
        fp32_paths = _export_fp32(net, Path(work_dir), opt)
        fp32 = _check_fp32(net, fp32_paths, test, opt)
        calib, calib_meta = _calibration(request.quant, calibration, calibration_label, image_shape, opt)
        candidate = _quantize(fp32, out, request.quant, calib, calib_meta, test, opt)
        shipped = _ship(request, fp32, candidate, out, opt)
        fp32_bytes = {p.name: p.stat().st_size for p in fp32.paths.values()}
    manifest = _manifest(spec, test, norm, fp32, candidate, shipped, fp32_bytes, profile=profile, plan=plan, opt=opt)
    write_manifest(out, manifest)
    log.info("exported %s as %s into %s (accuracy %s)", spec.name, shipped.quant, out,
             ", ".join(f"{k} {v:.2%}" for k, v in candidate.accuracy.items()))
    return manifest


def export_model(net: SplitNet, out: str | os.PathLike[str], *, quant: str | QuantRequest, test: Dataset,
                 calibration: CalibrationSource | None = None, calibration_label: str = "caller-supplied inputs",
                 profile: str | None = None, plan: dict[str, Any] | None = None,
                 options: ExportOptions | None = None, overwrite: bool = False) -> Manifest:
    """Export, quantize, verify and write ``net`` to ``out`` atomically; returns the manifest.

    ``test`` is the labelled set the checks run on; ``calibration`` (needed for
    int8-static) is an array of model inputs, an iterable of batches, or a
    callable ``f(n)`` returning ``n`` inputs (e.g. a generator's sampler).
    """
    with staged_output(out, overwrite=overwrite) as stage:
        return export_into(net, stage, quant=quant, test=test, calibration=calibration,
                           calibration_label=calibration_label, profile=profile, plan=plan, options=options)
