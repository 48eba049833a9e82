"""Run an exported model on the device: :class:`EdgeModel` (numpy + ONNX Runtime, no torch).

    model = EdgeModel.load("export/dev-1")        # checks manifest checksums first
    pred = model.predict(raw_images)              # (N, H, W) uint8 → labels, probabilities
    emb = model.embed(raw_images)                 # extractor.onnx: (N, p) embeddings
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.common.preprocess import Normalization
from fedge.errors import ExportError, PayloadError
from fedge.runtime.inputs import check_model_input, prepare
from fedge.runtime.manifest import Manifest, read_manifest, verify_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """Labels (N,), class names and softmax probabilities (N, classes)."""

    labels: np.ndarray
    names: tuple[str, ...]
    probs: np.ndarray


def open_session(path: str | os.PathLike[str], *, threads: int = 1) -> Any:
    """An ONNX Runtime CPU session; a corrupt or truncated file is an :class:`ExportError`."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # errors only: ORT's warnings would go straight to stderr
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own pybind classes (InvalidProtobuf, Fail, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"{path} is not a loadable ONNX model (corrupt or truncated?): {first[:300]}",
            hint="re-copy the model directory or re-export it",
        ) from exc


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class EdgeModel:
    """An exported fedge model directory: manifest, preprocessing and ONNX Runtime sessions."""

    def __init__(self, model_dir: str | os.PathLike[str], manifest: Manifest, *, threads: int = 1) -> None:
        self.dir = Path(model_dir)
        self.manifest = manifest
        self.threads = threads
        n = manifest.normalization
        self.norm = Normalization(float(n["mean"]), float(n["std"]), int(n["size"]), int(n["channels"]))
        self._sessions: dict[str, Any] = {}

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str], *, verify: bool = True, threads: int = 1) -> EdgeModel:
        """Open an export; ``verify`` checks every file's size and sha256 against the manifest."""
        manifest = read_manifest(model_dir)
        if verify:
            verify_files(model_dir, manifest)
        model = cls(model_dir, manifest, threads=threads)
        model.session("model")  # fail now, not at the first prediction, if the model is unusable
        return model

    # -- properties -----------------------------------------------------------------
    @property
    def classes(self) -> tuple[str, ...]:
        return self.manifest.classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, S, S) of one preprocessed image."""
        return (self.norm.channels, self.norm.size, self.norm.size)

    def session(self, graph: str) -> Any:
        """The (cached) session of ``model``, ``extractor`` or ``head``."""
        if graph not in self._sessions:
            if graph not in self.manifest.graphs:
                raise ExportError(f"{self.dir}: the export has no {graph!r} graph",
                                  hint=f"it has {', '.join(sorted(self.manifest.graphs))}")
            self._sessions[graph] = open_session(self.dir / self.manifest.graphs[graph]["file"], threads=self.threads)
        return self._sessions[graph]

    # -- inference --------------------------------------------------------------------
    def inputs(self, images: np.ndarray, *, preprocessed: bool = False, max_value: float = 255.0) -> np.ndarray:
        """Model inputs (N, C, S, S) float32 from raw pixels, or validated if already ``preprocessed``."""
        if preprocessed:
            return check_model_input(images, self.norm)
        return prepare(images, self.norm, max_value=max_value)

    def run(self, graph: str, x: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
        """Run one graph on an already valid input, in chunks of ``batch_size``."""
        sess = self.session(graph)
        spec = self.manifest.graphs[graph]
        inp = sess.get_inputs()[0]
        want = tuple(d for d in inp.shape[1:])
        if tuple(x.shape[1:]) != want:
            raise PayloadError(f"{graph}: input of shape {x.shape}, expected (N, {', '.join(map(str, want))})")
        dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
        outs = [
            sess.run([spec["output"]], {spec["input"]: np.ascontiguousarray(x[i : i + batch_size], dtype=dtype)})[0]
            for i in range(0, len(x), batch_size)
        ]
        return np.concatenate(outs).astype(np.float32)

    def logits(self, images: np.ndarray, *, preprocessed: bool = False) -> np.ndarray:
        """Logits (N, classes) of the fused model."""
        return self.run("model", self.inputs(images, preprocessed=preprocessed))

    def predict(self, images: np.ndarray, *, preprocessed: bool = False) -> Prediction:
        """Top-1 labels, their class names and the probabilities."""
        probs = softmax(self.logits(images, preprocessed=preprocessed))
        labels = probs.argmax(axis=1)
        return Prediction(labels, tuple(self.classes[i] for i in labels), probs)

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
        return self.run("head", emb)
