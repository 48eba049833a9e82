"""Export a trained network for a device: ONNX graphs, quantization per plan, checks, manifest.

Everything is written into a hidden staging directory beside ``out`` and moved
into place only after every check passed, so a failed export leaves nothing
half-written in the output directory.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import os
import platform
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedge import __version__
from fedge.common.preprocess import NORMALIZATION
from fedge.edge.data.datasets import Dataset
from fedge.edge.models.zoo import FedgeNet
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
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)


def _check_fits(net: FedgeNet, test: Dataset) -> None:
    spec = net.spec
    if (test.norm.channels, test.norm.size) != (spec.in_channels, spec.image_size):
        raise ExportError(
            f"{test.name} images are {test.norm.channels}x{test.norm.size}x{test.norm.size}, "
            f"but {spec.name} takes {spec.in_channels}x{spec.image_size}x{spec.image_size}",
            hint="export with the data set the model was trained on",
        )
    if test.num_classes != spec.num_classes:
        raise ExportError(f"{test.name} has {test.num_classes} classes, {spec.name} predicts {spec.num_classes}",
                          hint="export with the data set the model was trained on")
    if len(test) == 0:
        raise ExportError(f"the {test.name} test set is empty: nothing to verify the export on")


def _normalization(test: Dataset) -> dict[str, Any]:
    ref = NORMALIZATION.get(test.name)
    if ref is not None and ref != test.norm:
        raise ExportError(f"{test.name} was normalized with {test.norm}, not the shared {ref}",
                          hint="load data through fedge.edge.data.load_dataset")
    return {"dataset": test.name, **test.norm.to_dict()}


def export_into(
    net: FedgeNet,
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
    if isinstance(quant, str) and quant not in QUANTS:
        raise ExportError(f"unknown quantization {quant!r}", hint=f"use one of {', '.join(QUANTS)}")
    request = QuantRequest.explicit(quant) if isinstance(quant, str) else quant
    quant = request.quant
    if not isinstance(net, FedgeNet):
        raise ExportError(f"can only export FedgeNet models, got {type(net).__name__}")
    _check_fits(net, test)
    norm = _normalization(test)
    net = copy.deepcopy(net).eval()
    spec = net.spec
    image_shape = (spec.in_channels, spec.image_size, spec.image_size)
    with tempfile.TemporaryDirectory(prefix="fedge-export-") as work_dir:
        work = Path(work_dir)
        fp32 = export_graphs(net, work, opset=opt.opset, exporter=opt.exporter)
        for p in fp32.values():
            compact(p)
        fixed = test.x[:PARITY_BATCH]
        parity = verify.check_fp32_parity(net, fp32, fixed, tol=opt.fp32_tolerance)

        # Accuracy of fp32 ONNX on the test set, and its agreement with PyTorch.
        fp32_logits = verify.run_onnx(open_session(fp32["model"]), test.x)
        acc: dict[str, float] = {"fp32": float((fp32_logits.argmax(1) == test.y).mean())}
        with torch.no_grad():  # in chunks: activations of 10 000 images would take gigabytes
            torch_pred = np.concatenate([
                net(torch.from_numpy(np.ascontiguousarray(test.x[i : i + 500]))).argmax(1).numpy()
                for i in range(0, len(test), 500)
            ])
        agreement = float((fp32_logits.argmax(1) == torch_pred).mean())
        chain: dict[str, float] = {}
        dependence: dict[str, Any] | None = None

        calib_meta: dict[str, Any] | None = None
        if quant == "fp32":
            final = {name: Path(shutil.copy2(p, out / p.name)) for name, p in fp32.items()}
        else:
            calib = None
            if quant == "int8-static":
                if calibration is None:
                    raise ExportError("int8-static needs calibration inputs",
                                      hint="pass the device's own data or a generator sampler as calibration")
                calib = calibration_inputs(calibration, opt.calibration_samples, image_shape, seed=opt.seed)
                calib_meta = {"source": calibration_label, "samples": len(calib), "method": "minmax",
                              "format": "QDQ", "per_channel": True, "activations": "int8", "weights": "int8"}
            final = {}
            for name, src in fp32.items():
                feed = calib
                if calib is not None and GRAPHS[name][0] == "embedding":
                    # The head is calibrated on what it will see: fp32 embeddings of the calibration images.
                    feed = verify.run_onnx(open_session(fp32["extractor"]), calib)
                final[name] = quantize_file(src, out / src.name, quant, calib=feed, input_name=GRAPHS[name][0])
            acc[quant] = verify.onnx_accuracy(final["model"], test.x, test.y)
            verify.check_accuracy(quant, acc[quant], acc["fp32"], n=len(test), where="model.onnx",
                                  max_drop=opt.max_accuracy_drop)
            if quant == "int8-dynamic":
                dependence = verify.batch_dependence(final["model"], test.x)
            chain[quant] = verify.chained_accuracy(final["extractor"], final["head"], test.x, test.y)
            verify.check_accuracy(quant, chain[quant], acc["fp32"], n=len(test), where="head(extractor(x))",
                                  max_drop=opt.max_accuracy_drop)

        timed = {"fp32": fp32["model"]} if quant == "fp32" else {"fp32": fp32["model"], quant: final["model"]}
        latency = verify.onnx_latencies_ms(timed, fixed, runs=opt.latency_runs)
        hw_cpu = detect_hardware()["cpu"]
        provider = providers.select()[0]  # what open_session puts first on this host
        shipped, why = settle(request, latency, provider=provider,
                              how=f"batch 1, 1 thread, median of {opt.latency_runs} interleaved runs on {hw_cpu}, "
                                  f"{provider}")
        decision: dict[str, Any] = {"requested": quant, "source": request.source, "shipped": shipped,
                                    "reason": why}
        if shipped != quant:
            # Measured slower: ship the verified fp32 graphs; the candidate's figures stay in the metrics.
            for p in final.values():
                p.unlink()
            final = {name: Path(shutil.copy2(p, out / p.name)) for name, p in fp32.items()}
            decision["calibration"], calib_meta = calib_meta, None
        fp32_bytes = {p.name: p.stat().st_size for p in fp32.values()}

    import onnxruntime

    manifest = Manifest(
        arch=spec.name,
        quant=shipped,
        opset=opt.opset,
        input_shape=("batch", *image_shape),
        normalization=norm,
        classes=tuple(test.classes),
        files={p.name: FileEntry.of(p) for p in final.values()},
        graphs={name: {"file": final[name].name, "input": GRAPHS[name][0], "output": GRAPHS[name][1]}
                for name in GRAPHS},
        profile=profile,
        plan=plan,
        metrics={
            "test_set": {"dataset": test.name, "images": len(test)},
            "accuracy": acc,
            "accuracy_extractor_head": chain,
            "fp32_agreement_with_pytorch": agreement,
            "fp32_max_abs_diff": {**parity.max_abs_diff, "batch": parity.batch, "tolerance": opt.fp32_tolerance},
            "latency_ms": latency,
            "latency": {"batch": 1, "threads": 1, "statistic": "median", "runs": opt.latency_runs,
                        "interleaved": True, "machine": platform.machine(), "cpu": hw_cpu, "provider": provider},
            "fp32_bytes": fp32_bytes,
            **({"batch_dependence": dependence} if dependence is not None else {}),
        },
        extra={
            "spec": spec.to_dict(),
            "params": spec.num_params(),
            "calibration": calib_meta,
            "quantization": decision,
            "exporter": opt.exporter,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "versions": {"fedge": __version__, "torch": torch.__version__,
                         "onnxruntime": onnxruntime.__version__},
        },
    )
    write_manifest(out, manifest)
    log.info("exported %s as %s into %s (accuracy %s)", spec.name, shipped, out,
             ", ".join(f"{k} {v:.2%}" for k, v in acc.items()))
    return manifest


def export_model(net: FedgeNet, out: str | os.PathLike[str], *, quant: str | QuantRequest, test: Dataset,
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
