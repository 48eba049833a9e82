"""One fused model at several precisions, side by side: what the probe and the benchmark measure.

Unlike :func:`fedge.export.exporter.export_model` nothing here fails on an
accuracy drop: the point is to measure it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedge.edge.models.split import SplitNet
from fedge.export.onnx_export import OPSET, torch_to_onnx
from fedge.export.quantize import compact, quantize_file
from fedge.runtime.manifest import GRAPHS, QUANTS

log = logging.getLogger(__name__)


def model_variants(net: SplitNet, work_dir: str | os.PathLike[str], *, quants: Sequence[str] = QUANTS,
                   calib: np.ndarray | None = None, opset: int = OPSET) -> dict[str, Path]:
    """Write ``<quant>.onnx`` of the fused model for each of ``quants`` into ``work_dir``.

    ``calib`` (model inputs) is required when ``quants`` holds int8-static.
    """
    import torch

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    spec = net.spec
    example = torch.zeros(2, *spec.input_shape)
    input_name, output_name = GRAPHS["model"]
    fp32 = torch_to_onnx(net.eval(), example, work / "fp32.onnx", input_name=input_name,
                         output_name=output_name, opset=opset)
    compact(fp32)
    out = {"fp32": fp32}
    for q in quants:
        if q != "fp32":
            out[q] = quantize_file(fp32, work / f"{q}.onnx", q, calib=calib, input_name=input_name)
    return {q: out[q] for q in quants}
