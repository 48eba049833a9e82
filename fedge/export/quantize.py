"""Quantization passes on fp32 ONNX graphs: fp16, int8 dynamic, int8 static (QDQ, per-channel).

* ``fp16``: ``onnxruntime.transformers.float16`` (shipped with onnxruntime, so
  no extra dependency); inputs and outputs stay float32 so the device feeds the
  same arrays whatever the precision.
* ``int8-dynamic``: ``quantize_dynamic``, int8 weights, activations quantized
  on the fly (ConvInteger / MatMulInteger).
* ``int8-static``: ``quant_pre_process`` then ``quantize_static`` in QDQ
  format, S8S8, per-channel weights, MinMax calibration on 100–500
  representative inputs (ONNX Runtime's recommendation for CNNs).

An audio model's MFCC front end (:mod:`fedge.edge.models.frontend`) stays float32 at every level: its power
spectrum spans ten orders of magnitude, which int8 (one scale per tensor) flattens to the log floor and fp16
overflows above 65504; :func:`front_end_nodes` finds it in the graph (everything from the input to the DCT
``MatMul`` after the first ``Log``) and the passes leave those nodes alone.

Calibration inputs come from a :data:`CalibrationSource`: an array of model
inputs, an iterable of such batches, or a callable ``f(n) -> (n, C, S, S)``
such as a generator's sampler, so calibration data never has to leave the
device.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Union

import numpy as np

from fedge.errors import ExportError
from fedge.runtime.manifest import QUANTS

log = logging.getLogger(__name__)

CalibrationSource = Union[np.ndarray, Callable[[int], Any], Iterable[Any]]  # noqa: UP007 (runtime alias)
DEFAULT_CALIBRATION_SAMPLES = 256


def _to_numpy(batch: Any) -> np.ndarray:
    if hasattr(batch, "detach"):  # a torch tensor from a generator
        batch = batch.detach().cpu().numpy()
    return np.asarray(batch, dtype=np.float32)


def calibration_inputs(source: CalibrationSource, n: int, shape: tuple[int, ...], *, seed: int = 0) -> np.ndarray:
    """Up to ``n`` model inputs of per-sample ``shape`` from ``source`` (see :data:`CalibrationSource`).

    An array larger than ``n`` is subsampled with a fixed seed, so exports are reproducible.
    """
    if n < 1:
        raise ExportError(f"calibration needs at least 1 sample, got n={n}")
    if isinstance(source, np.ndarray) or (hasattr(source, "__array__") and not callable(source)):
        x = _to_numpy(source)
        if len(x) > n:
            x = x[np.sort(np.random.default_rng(seed).choice(len(x), n, replace=False))]
    elif callable(source):
        x = _to_numpy(source(n))
    else:
        parts: list[np.ndarray] = []
        count = 0
        for batch in source:
            b = _to_numpy(batch)
            if b.ndim == len(shape):
                b = b[None]
            parts.append(b)
            count += len(b)
            if count >= n:
                break
        if not parts:
            raise ExportError("the calibration source yielded no inputs")
        x = np.concatenate(parts)[:n]
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != tuple(shape):
        raise ExportError(
            f"calibration inputs have shape {x.shape}, the model expects (N, {', '.join(map(str, shape))})",
            hint="pass preprocessed model inputs (fedge.common.preprocess), e.g. Dataset.x or generator samples",
        )
    if len(x) == 0:
        raise ExportError("the calibration source gave 0 samples")
    if not np.isfinite(x).all():
        raise ExportError("calibration inputs contain NaN or infinity")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise ExportError(f"unknown quantization {quant!r}", hint=f"use one of {', '.join(QUANTS)}")


def front_end_nodes(model: Any) -> list[str]:
    """Names of the nodes of an MFCC front end in ``model`` (an ``onnx.ModelProto``; unnamed nodes are named
    here): every node computed from the graph input up to the first ``MatMul`` after a ``Log`` (the DCT).
    A graph without a ``Log`` (an image model) has none."""
    if not any(n.op_type == "Log" for n in model.graph.node):
        return []
    for i, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"fedge_node_{i}"
    reached = {model.graph.input[0].name}
    out, seen_log = [], False
    for node in model.graph.node:  # topological order (the exporter's, kept by every pass before this one)
        if not any(t in reached for t in node.input):
            continue
        out.append(node.name)
        reached.update(node.output)
        seen_log = seen_log or node.op_type == "Log"
        if seen_log and node.op_type == "MatMul":
            return out
    return out


def _named_front_end(src: Path, dst: Path) -> list[str]:
    """``src`` saved as ``dst`` with its nodes named; the names of its front end's nodes."""
    import onnx

    model = onnx.load(str(src))
    names = front_end_nodes(model)
    onnx.save(model, str(dst))
    return names


def to_fp16(src: Path, dst: Path) -> None:
    """fp16 weights and compute, fp32 inputs and outputs."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    model = convert_float_to_float16(model, keep_io_types=True, node_block_list=front_end_nodes(model) or None)
    onnx.save(model, str(dst))


def int8_dynamic(src: Path, dst: Path) -> None:
    """Dynamic quantization: int8 weights, activation ranges computed at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(prefix="fedge-quant-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre))
        keep = _named_front_end(pre, pre)
        quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8, per_channel=False, nodes_to_exclude=keep)


def _reader(input_name: str, x: np.ndarray, batch: int = 64) -> Any:
    """A ``CalibrationDataReader`` over an array, in batches (the graph has a dynamic batch axis)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = [{input_name: x[i : i + batch]} for i in range(0, len(x), batch)]
            self.pos = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self.pos >= len(self.items):
                return None
            self.pos += 1
            return self.items[self.pos - 1]

        def rewind(self) -> None:
            self.pos = 0

    return Reader()


def int8_static(src: Path, dst: Path, calib: np.ndarray, input_name: str, *, per_channel: bool = True) -> None:
    """Static QDQ quantization (S8S8, MinMax) calibrated on ``calib``."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(prefix="fedge-quant-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre))
        keep = _named_front_end(pre, pre)
        quantize_static(
            str(pre), str(dst), _reader(input_name, calib),
            nodes_to_exclude=keep,
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )


def _toposort(graph: Any) -> None:
    """Order nodes so every input is produced before use (the fp16 converter appends its casts)."""
    ready = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = list(graph.node)
    ordered = []
    while pending:
        rest = []
        for node in pending:
            if all(i in ready for i in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ExportError(f"the graph has a cycle or an undefined input (at a {rest[0].op_type} node)")
        pending = rest
    copies = [type(n)() for n in ordered]
    for c, n in zip(copies, ordered, strict=True):
        c.CopyFrom(n)
    del graph.node[:]
    graph.node.extend(copies)


def _inline_initializer_copies(g: Any, keep: set[str]) -> None:
    """Replace ``Identity`` nodes that copy an initializer by a copy of the initializer itself.

    The TorchScript exporter stores equal constants once and copies them with ``Identity``: a freshly
    built network whose folded BatchNorm biases are all zero (the model families' bias-free convs) has
    several. ONNX Runtime's static quantizer fails on the copies (``KeyError`` on a tensor name), and
    on one bias shared by two convolutions (each needs its own int32 scale: an invalid graph), so
    every consumer gets a tensor of its own.
    """
    inits = {t.name: t for t in g.initializer}
    copies = [n for n in g.node if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in keep]
    for n in copies:
        t = type(inits[n.input[0]])()
        t.CopyFrom(inits[n.input[0]])
        t.name = n.output[0]
        g.initializer.append(t)
        g.node.remove(n)


def compact(path: Path) -> None:
    """Shrink a graph's file without changing its computation.

    Exporters and quantizers name every tensor after its module path
    (``/body/body.8/Conv_output_0_quantized_scale``) and keep inferred
    ``value_info``; for our small CNNs those strings are a large part of the
    file. Internal names become short ids; node names, doc strings and
    ``value_info`` go. (Dropping the all-zero int32 bias zero points, optional in
    ONNX, would save a little more but stops ONNX Runtime fusing some QDQ
    groups: measured 10 % slower on tier-m.)
    """
    import onnx

    model = onnx.load(str(path))
    g = model.graph
    keep = {v.name for v in g.input} | {v.name for v in g.output}
    names: dict[str, str] = {}

    def short(name: str) -> str:
        if not name or name in keep:
            return name
        if name not in names:
            names[name] = f"t{len(names)}"
        return names[name]

    _inline_initializer_copies(g, keep)
    for t in g.initializer:
        t.name = short(t.name)
        t.doc_string = ""
    for node in g.node:
        node.name = ""
        node.doc_string = ""
        node.input[:] = [short(i) for i in node.input]
        node.output[:] = [short(o) for o in node.output]
    del g.value_info[:]
    _toposort(g)
    model.doc_string = ""
    g.doc_string = ""
    onnx.save(model, str(path))
    log.debug("compacted %s: %d names shortened", path.name, len(names))


def quantize_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str, *,
                  calib: np.ndarray | None = None, input_name: str = "image") -> Path:
    """Write ``src`` quantized to ``quant`` as ``dst`` (fp32 copies), then compact and check it."""
    from fedge.export.onnx_export import check_onnx

    _check_quant(quant)
    src, dst = Path(src), Path(dst)
    try:
        if quant == "fp32":
            dst.write_bytes(src.read_bytes())
        elif quant == "fp16":
            to_fp16(src, dst)
        elif quant == "int8-dynamic":
            int8_dynamic(src, dst)
        else:
            if calib is None:
                raise ExportError("int8-static needs calibration inputs",
                                  hint="pass the device's data or a generator as the calibration source")
            int8_static(src, dst, calib, input_name)
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"{quant} quantization of {src.name} failed: {exc}",
                          hint="try another quantization (fp32, fp16, int8-dynamic)") from exc
    compact(dst)
    check_onnx(dst)
    return dst
