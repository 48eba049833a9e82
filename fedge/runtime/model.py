"""Run an exported model on the device: :class:`EdgeModel` (numpy + ONNX Runtime, no torch).

    model = EdgeModel.load("export/dev-1")        # checks manifest checksums first
    pred = model.predict(raw_images)              # (N, H, W) uint8 → labels, probabilities
    emb = model.embed(raw_images)                 # extractor.onnx: (N, p) embeddings

The hot path (``logits``/``predict`` on preprocessed float32 batches) does what a
bare ``InferenceSession.run`` with a pre-built feed does plus one BLAS dot product
(the NaN and raw-pixel check): no copies, no dtype conversions, output names and
input name resolved once at load, probabilities and class names computed only
when asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedge.common.preprocess import Normalization
from fedge.errors import ExportError, PayloadError
from fedge.runtime import providers as eps
from fedge.runtime.inputs import check_model_input, largest_normalized, prepare, prepare_signal
from fedge.runtime.manifest import Manifest, read_manifest, verify_files

if TYPE_CHECKING:  # only a hint here: an unsigned model never loads `cryptography` (10 MB of RSS on a board)
    from fedge.common.signing import Verifier

log = logging.getLogger(__name__)

_F32 = np.dtype(np.float32)
_vdot = np.vdot
_ndarray = np.ndarray


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class Prediction:
    """Top-1 ``labels`` (N,) of ``logits`` (N, classes); ``probs`` and ``names`` are computed when read.

    (A slotted plain class: a dataclass's ``__init__`` is a measurable share of a batch-1 prediction.)
    """

    __slots__ = ("classes", "labels", "logits")

    def __init__(self, logits: np.ndarray, labels: np.ndarray, classes: tuple[str, ...]) -> None:
        self.logits = logits
        self.labels = labels
        self.classes = classes

    @property
    def probs(self) -> np.ndarray:
        """Softmax probabilities (N, classes), computed on each read."""
        return softmax(self.logits)

    @property
    def names(self) -> tuple[str, ...]:
        """The class name of each label."""
        return tuple(self.classes[i] for i in self.labels)

    def __repr__(self) -> str:
        return f"Prediction(labels={self.labels!r}, classes={len(self.classes)})"


def open_session(path: str | os.PathLike[str], *, threads: int = 1,
                 providers: Sequence[str] | None = None) -> Any:
    """An ONNX Runtime session on the best available providers (:mod:`fedge.runtime.providers`).

    A corrupt or truncated file is an :class:`ExportError`. If an accelerator's
    provider fails to start (missing driver libraries), the session falls back to
    the CPU provider with a warning.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # errors only: ORT's warnings would go straight to stderr
    chosen = eps.select(providers)
    attempts = [chosen] if chosen == [eps.CPU] else [chosen, [eps.CPU]]
    for i, attempt in enumerate(attempts):
        try:
            return ort.InferenceSession(str(path), opts, providers=attempt)
        except Exception as exc:  # ORT raises its own pybind classes (InvalidProtobuf, Fail, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if i + 1 < len(attempts):
                log.warning("%s: providers %s failed (%s); falling back to the CPU provider", path,
                            ", ".join(attempt), first[:200])
                continue
            raise ExportError(
                f"{path} is not a loadable ONNX model (corrupt or truncated?): {first[:300]}",
                hint="re-copy the model directory or re-export it",
            ) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def _direct_run(session: Any) -> Any:
    """The C++ session's ``run(output_names, feed, run_options)``, without the Python wrapper.

    ``InferenceSession.run`` re-validates the feed's names, the graph-capture mode and
    OrtValue ownership on every call (~8 µs at batch 1 on the benchmark machine, a
    tenth of a tier-xs inference); fedge checks its feed once, at load. The wrapped
    C++ session (``_sess``, present in every ONNX Runtime release since 1.0) is called
    directly; callers retry any error through the public ``run``, which keeps its
    provider fallback and its error messages. Without ``_sess``, the public ``run``.
    """
    inner = getattr(session, "_sess", None)
    if inner is not None and callable(getattr(inner, "run", None)):
        return inner.run
    return lambda outputs, feed, options: session.run(outputs, feed, options)


@dataclass(frozen=True)
class _Graph:
    """One graph's session and what running it needs, resolved once."""

    session: Any
    input: str
    outputs: list[str]
    sample_shape: tuple[Any, ...]
    dtype: np.dtype[Any]


class EdgeModel:
    """An exported fedge model directory: manifest, preprocessing and ONNX Runtime sessions."""

    batch_size = 256
    """Larger batches run in chunks of this many."""

    def __init__(self, model_dir: str | os.PathLike[str], manifest: Manifest, *, threads: int = 1,
                 providers: Sequence[str] | None = None) -> None:
        self.dir = Path(model_dir)
        self.manifest = manifest
        self.threads = threads
        self.requested_providers = list(providers) if providers else None
        n = manifest.normalization
        self.norm = Normalization(float(n["mean"]), float(n["std"]), int(n["size"]), int(n["channels"]),
                                  str(n.get("kind", "image")))
        self._sample = self.norm.sample_shape
        self._graphs: dict[str, _Graph] = {}
        # (C++ run, [output], input name, the shape of a batch of 1, bound on the sum of squares
        # of one sample, class names): everything the fast path needs, resolved once.
        self._fast: tuple[Any, list[str], str, tuple[int, ...], float, tuple[str, ...]] | None = None

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str], *, verify: bool = True, threads: int = 1,
             providers: Sequence[str] | None = None, verifier: Verifier | None = None) -> EdgeModel:
        """Open an export; ``verify`` checks every file's size and sha256 against the manifest.

        ``providers`` names ONNX Runtime execution providers to use (default: every
        available one of :data:`fedge.runtime.providers.PREFERRED`, in that order).
        ``verifier`` (the fleet key): the manifest must carry the fleet's signature
        (:mod:`fedge.runtime.signature`), checked before anything else is read.
        """
        if verifier is not None:
            from fedge.runtime.signature import verify_manifest

            verify_manifest(model_dir, verifier)
        manifest = read_manifest(model_dir)
        if verify:
            verify_files(model_dir, manifest)
        model = cls(model_dir, manifest, threads=threads, providers=providers)
        model.graph("model")  # fail now, not at the first prediction, if the model is unusable
        if manifest.quant == "fp16" and model.provider not in eps.FP16_PROVIDERS:
            log.warning("%s is fp16 but runs on %s, which computes fp16 through casts: no faster than fp32 here",
                        model.dir, model.provider)
        return model

    # -- properties -----------------------------------------------------------------
    @property
    def classes(self) -> tuple[str, ...]:
        return self.manifest.classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """(C, S, S) of one preprocessed image; (C, T) of an audio clip or sensor window."""
        return self._sample

    @property
    def providers(self) -> list[str]:
        """The execution providers of the model's session, in priority order (the CPU provider last)."""
        return list(self.graph("model").session.get_providers())

    @property
    def provider(self) -> str:
        """The provider that runs the model: the first of :attr:`providers` (nodes it cannot take fall back)."""
        return self.providers[0]

    def session(self, graph: str) -> Any:
        """The (cached) ONNX Runtime session of ``model``, ``extractor`` or ``head``."""
        return self.graph(graph).session

    def graph(self, name: str) -> _Graph:
        """The (cached) session of a graph with its input and output names, checked against the manifest."""
        g = self._graphs.get(name)
        if g is not None:
            return g
        if name not in self.manifest.graphs:
            raise ExportError(f"{self.dir}: the export has no {name!r} graph",
                              hint=f"it has {', '.join(sorted(self.manifest.graphs))}")
        spec = self.manifest.graphs[name]
        sess = open_session(self.dir / spec["file"], threads=self.threads, providers=self.requested_providers)
        inp, outs = sess.get_inputs(), sess.get_outputs()
        if spec["input"] not in [i.name for i in inp] or spec["output"] not in [o.name for o in outs]:
            raise ExportError(
                f"{self.dir / spec['file']}: the manifest names input {spec['input']!r} and output "
                f"{spec['output']!r}, the graph has {[i.name for i in inp]} → {[o.name for o in outs]}",
                hint="the manifest and the model do not belong together: re-copy the directory or re-export",
            )
        out_dim = next(o for o in outs if o.name == spec["output"]).shape[-1]
        if spec["output"] == "logits" and isinstance(out_dim, int) and out_dim != len(self.classes):
            raise ExportError(
                f"{self.dir / 'manifest.json'} lists {len(self.classes)} classes, but {spec['file']} outputs "
                f"{out_dim} logits",
                hint="the manifest and the model do not belong together: re-copy the directory or re-export",
            )
        first = next(i for i in inp if i.name == spec["input"])
        dtype = np.dtype(np.float16) if first.type == "tensor(float16)" else _F32
        g = _Graph(sess, spec["input"], [spec["output"]], tuple(first.shape[1:]), dtype)
        self._graphs[name] = g
        if name == "model" and dtype == _F32:
            size = int(np.prod(self._sample))
            self._fast = (_direct_run(sess), g.outputs, g.input, (1, *self._sample),
                          size * (2.0 * largest_normalized(self.norm)) ** 2, self.manifest.classes)
        return g

    # -- inference --------------------------------------------------------------------
    def inputs(self, images: np.ndarray, *, preprocessed: bool = False, max_value: float = 255.0) -> np.ndarray:
        """Model inputs (N, C, S, S) float32 from raw pixels, or validated if already ``preprocessed``; audio
        clips and sensor windows (N, C, T) are only checked (they need no preprocessing)."""
        if self.norm.kind != "image":
            return prepare_signal(images, self.norm)
        if preprocessed:
            return check_model_input(images, self.norm)
        return prepare(images, self.norm, max_value=max_value)

    def run(self, graph: str, x: np.ndarray) -> np.ndarray:
        """Run one graph on an already valid input, in chunks of :attr:`batch_size`."""
        g = self.graph(graph)
        if tuple(x.shape[1:]) != g.sample_shape:
            raise PayloadError(f"{graph}: input of shape {x.shape}, "
                               f"expected (N, {', '.join(map(str, g.sample_shape))})")
        x = np.ascontiguousarray(x, dtype=g.dtype)
        n = self.batch_size
        if len(x) <= n:
            out = g.session.run(g.outputs, {g.input: x})[0]
        else:
            out = np.concatenate([g.session.run(g.outputs, {g.input: x[i : i + n]})[0] for i in range(0, len(x), n)])
        return out.astype(np.float32, copy=False)

    def _fast_logits(self, images: np.ndarray) -> np.ndarray | None:
        """Logits of a preprocessed float32 batch of the right shape, or None if it needs the full path.

        One dot product checks the values (NaN and infinity make it non-finite, raw
        pixels make it far too large; the full path then says which), then straight to
        ONNX Runtime. At batch 1 every numpy call here costs microseconds (measured: a
        reduction between two runs costs several times what it costs in a tight loop).
        """
        fast = self._fast
        if fast is None or images.__class__ is not _ndarray or images.dtype is not _F32:
            return None
        shape = images.shape
        if (shape[1:] == self._sample and 0 < shape[0] <= self.batch_size
                and float(_vdot(images, images)) <= fast[4] * shape[0]):
            try:
                return fast[0](fast[1], {fast[2]: images}, None)[0]
            except Exception:  # retried through the public API below: its fallback, its errors
                return None
        return None

    # logits() and predict() repeat the batch-1 case of _fast_logits inline: on the device's
    # common call (one preprocessed image) a Python call, a tuple slice or a global lookup
    # is a measurable share of a small model's inference (benchmarks/inference.py).
    def logits(self, images: np.ndarray, *, preprocessed: bool = False, max_value: float = 255.0) -> np.ndarray:
        """Logits (N, classes) of the fused model."""
        if preprocessed:
            fast = self._fast
            if (fast is not None and images.__class__ is _ndarray and images.dtype is _F32
                    and images.shape == fast[3] and float(_vdot(images, images)) <= fast[4]):
                try:
                    return fast[0](fast[1], {fast[2]: images}, None)[0]
                except Exception:  # retried through the public API below: its fallback, its errors
                    pass
            elif (out := self._fast_logits(images)) is not None:
                return out
        return self.run("model", self.inputs(images, preprocessed=preprocessed, max_value=max_value))

    def predict(self, images: np.ndarray, *, preprocessed: bool = False, max_value: float = 255.0) -> Prediction:
        """Top-1 labels; their class names and the probabilities on first use."""
        if preprocessed:
            fast = self._fast
            if (fast is not None and images.__class__ is _ndarray and images.dtype is _F32
                    and images.shape == fast[3] and float(_vdot(images, images)) <= fast[4]):
                try:
                    logits = fast[0](fast[1], {fast[2]: images}, None)[0]
                    return Prediction(logits, logits.argmax(1), fast[5])
                except Exception:  # retried through the public API below: its fallback, its errors
                    pass
            else:
                logits = self._fast_logits(images)
                if logits is not None:
                    return Prediction(logits, logits.argmax(1), fast[5] if fast is not None else self.classes)
        logits = self.run("model", self.inputs(images, preprocessed=preprocessed, max_value=max_value))
        return Prediction(logits, logits.argmax(1), self.manifest.classes)

    def embed(self, images: np.ndarray, *, preprocessed: bool = False) -> np.ndarray:
        """Embeddings (N, p) from ``extractor.onnx``."""
        return self.run("extractor", self.inputs(images, preprocessed=preprocessed))

    def head_logits(self, embeddings: np.ndarray) -> np.ndarray:
        """Logits (N, classes) from embeddings (N, p) through ``head.onnx``."""
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.ndim == 1:
            emb = emb[None]
        if emb.ndim != 2:
            raise PayloadError(f"embeddings must be (N, p), got shape {np.shape(embeddings)}")
        if not np.isfinite(emb).all():
            raise PayloadError(f"embeddings hold {int(emb.size - np.isfinite(emb).sum())} NaN or infinite values")
        return self.run("head", emb)
