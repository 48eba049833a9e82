"""PyTorch → ONNX for the three graphs of an export, each checked by the ONNX checker.

* ``model.onnx``: image (B, C, S, S) → logits (B, classes), the fused network;
* ``extractor.onnx``: image → embedding (B, p), i.e. ``FedgeNet.features``
  (stem, body and embedding: everything before the head);
* ``head.onnx``: embedding (B, p) → logits, so ``head(extractor(x)) == model(x)``.

Exporter choice: the TorchScript exporter (``dynamo=False``) with
``dynamic_axes``. On this stack (torch 2.14, onnx 1.23) it exports our plain
conv/linear networks in ~0.1 s, silently, with exactly the input/output names
and the symbolic batch axis we ask for, and it folds eval-mode BatchNorm into
the convolutions. The dynamo exporter (the default since torch 2.9) gives the
same numbers but takes ~3.5 s per graph and prints progress to stdout, which a
library must not do. It stays available (``exporter="dynamo"``) for the day
the TorchScript exporter is removed; a test keeps it working.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from fedge.edge.models.split import SplitNet
from fedge.errors import ExportError
from fedge.runtime.manifest import GRAPHS

log = logging.getLogger(__name__)

OPSET = 17
BATCH = "batch"
Exporter = Literal["torchscript", "dynamo"]


class _Extractor(nn.Module):
    """``FedgeNet.features`` as a module of its own: image → embedding."""

    def __init__(self, net: SplitNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x)


def graph_modules(net: SplitNet) -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Graph name → (module, example input shape without the batch axis)."""
    spec = net.spec
    image = tuple(spec.input_shape)
    return {
        "model": (net, image),
        "extractor": (_Extractor(net), image),
        "head": (net.head, (spec.feature_dim,)),
    }


def torch_to_onnx(module: nn.Module, example: torch.Tensor, path: str | os.PathLike[str], *,
                  input_name: str, output_name: str, opset: int = OPSET,
                  exporter: Exporter = "torchscript") -> Path:
    """Export one module with a dynamic batch axis and named input/output, then check it."""
    path = Path(path)
    module = module.eval()
    try:
        with warnings.catch_warnings():
            # The TorchScript exporter warns that it is deprecated on every call: see the module docstring.
            warnings.simplefilter("ignore")
            if exporter == "torchscript":
                torch.onnx.export(
                    module, (example,), str(path), dynamo=False, opset_version=opset,
                    input_names=[input_name], output_names=[output_name],
                    dynamic_axes={input_name: {0: BATCH}, output_name: {0: BATCH}},
                    do_constant_folding=True,
                )
            else:
                # The dynamo exporter reports progress on stdout; keep the library quiet.
                with contextlib.redirect_stdout(io.StringIO()):
                    program = torch.onnx.export(
                        module, (example,), dynamo=True, opset_version=opset,
                        input_names=[input_name], output_names=[output_name],
                        dynamic_shapes=({0: torch.export.Dim(BATCH)},), verbose=False,
                    )
                    if program is None:  # pragma: no cover - torch always returns a program here
                        raise ExportError("the dynamo exporter returned no program")
                    program.save(str(path))
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"torch.onnx.export ({exporter}) failed for {path.name}: {exc}",
                          hint="call model.eval() first; try the other exporter (exporter='dynamo')") from exc
    check_onnx(path)
    return path


def check_onnx(path: str | os.PathLike[str]) -> None:
    """ONNX checker plus strict shape inference; any failure is an :class:`ExportError` naming the file."""
    import onnx

    path = Path(path)
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # DecodeError, OSError ...
        raise ExportError(f"{path} is not a readable ONNX file (corrupt or truncated?): {exc}",
                          hint="re-export the model") from exc
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:  # ValidationError, InferenceError
        raise ExportError(f"{path} fails the ONNX checker: {exc}", hint="re-export the model") from exc
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < OPSET:
        raise ExportError(f"{path} uses opset {opset}, fedge needs >= {OPSET}")


def export_graphs(net: SplitNet, out_dir: str | os.PathLike[str], *, opset: int = OPSET,
                  exporter: Exporter = "torchscript") -> dict[str, Path]:
    """Write ``model.onnx``, ``extractor.onnx`` and ``head.onnx`` (fp32) into ``out_dir``."""
    if opset < OPSET:
        raise ExportError(f"opset {opset} is too old", hint=f"use opset >= {OPSET}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    net = net.eval()
    paths: dict[str, Path] = {}
    for name, (module, shape) in graph_modules(net).items():
        input_name, output_name = GRAPHS[name]
        example = torch.zeros((2, *shape))  # batch 2: nothing may specialize to a batch of 1
        paths[name] = torch_to_onnx(module, example, out / f"{name}.onnx", input_name=input_name,
                                    output_name=output_name, opset=opset, exporter=exporter)
        log.debug("exported %s (%d bytes)", paths[name], paths[name].stat().st_size)
    return paths
