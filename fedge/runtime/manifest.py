"""``manifest.json``: what an exported model directory holds, and the proof that it is intact.

The exporter writes it last (see :mod:`fedge.export.exporter`); the runtime reads
it first and checks every listed file's size and sha256 before it opens a
model, so a truncated copy or an edited file is caught with a message that
names the file instead of surfacing as an obscure ONNX Runtime error.

Standard library only: the device runtime must stay light.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.preprocess import INPUT_KINDS
from fedge.errors import ExportError

MANIFEST_NAME = "manifest.json"
FORMAT = "fedge-onnx/1"
QUANTS: tuple[str, ...] = ("fp32", "fp16", "int8-dynamic", "int8-static")

# The three graphs of an export: name -> (input name, output name).
GRAPHS: dict[str, tuple[str, str]] = {
    "model": ("image", "logits"),
    "extractor": ("image", "embedding"),
    "head": ("embedding", "logits"),
}

_REQUIRED = ("format", "arch", "quant", "opset", "input_shape", "normalization", "classes", "files", "graphs")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of an export, relative to its directory."""

    sha256: str
    bytes: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileEntry:
        return cls(sha256_file(path), Path(path).stat().st_size)


@dataclass(frozen=True)
class Manifest:
    """The typed core of ``manifest.json``; everything else is kept in ``extra``."""

    arch: str
    quant: str
    opset: int
    input_shape: tuple[int | str, ...]  # ("batch", C, H, W)
    normalization: dict[str, Any]  # dataset, mean, std, size, channels (and kind, for audio and sensor inputs)
    classes: tuple[str, ...]
    files: dict[str, FileEntry]
    graphs: dict[str, dict[str, str]]  # graph name -> {"file", "input", "output"}
    profile: str | None = None
    plan: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "arch": self.arch,
            "quant": self.quant,
            "opset": self.opset,
            "input_shape": list(self.input_shape),
            "normalization": dict(self.normalization),
            "classes": list(self.classes),
            "profile": self.profile,
            "plan": self.plan,
            "graphs": self.graphs,
            "files": {k: {"sha256": v.sha256, "bytes": v.bytes} for k, v in sorted(self.files.items())},
            "metrics": self.metrics,
            **self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = MANIFEST_NAME) -> Manifest:
        """Validate and build; a missing or malformed key is an :class:`ExportError` naming it."""
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ExportError(f"{source}: missing keys {missing}", hint="re-export the model with `fedge export`")
        if d["format"] != FORMAT:
            raise ExportError(f"{source}: format {d['format']!r} is not {FORMAT!r}",
                              hint="re-export the model with this version of fedge")
        if d["quant"] not in QUANTS:
            raise ExportError(f"{source}: unknown quantization {d['quant']!r}", hint=f"one of {', '.join(QUANTS)}")
        try:
            files = {str(k): FileEntry(str(v["sha256"]), int(v["bytes"])) for k, v in d["files"].items()}
            graphs = {str(k): {"file": str(v["file"]), "input": str(v["input"]), "output": str(v["output"])}
                      for k, v in d["graphs"].items()}
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ExportError(f"{source}: malformed 'files' or 'graphs' entry ({exc!r})") from exc
        for name, g in graphs.items():
            if g["file"] not in files:
                raise ExportError(f"{source}: graph {name!r} uses {g['file']}, which is not listed under 'files'")
        classes = d["classes"]
        if not isinstance(classes, list) or not classes or not all(isinstance(c, str | int) for c in classes):
            raise ExportError(f"{source}: 'classes' must be a non-empty list of class names, got {classes!r}",
                              hint="re-export the model with `fedge export`")
        if not isinstance(d["opset"], int) or isinstance(d["opset"], bool):
            raise ExportError(f"{source}: 'opset' must be an integer, got {d['opset']!r}")
        shape = d["input_shape"]
        if not isinstance(shape, list) or not all(isinstance(v, int | str) and not isinstance(v, bool) for v in shape):
            raise ExportError(f"{source}: 'input_shape' must be a list such as [\"batch\", 1, 32, 32], got {shape!r}",
                              hint="re-export the model with `fedge export`")
        # Optional entries the runtime and `fedge infer -v` read: objects (or absent/null), never anything else.
        for key in ("metrics", "plan", "quantization", "calibration"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise ExportError(f"{source}: '{key}' must be an object, got {d[key]!r}",
                                  hint="re-export the model with `fedge export`")
        if d.get("profile") is not None and not isinstance(d["profile"], str):
            raise ExportError(f"{source}: 'profile' must be a profile name, got {d['profile']!r}")
        known = set(_REQUIRED) | {"profile", "plan", "metrics"}
        return cls(
            arch=str(d["arch"]),
            quant=str(d["quant"]),
            opset=d["opset"],
            input_shape=tuple(d["input_shape"]),
            normalization=_check_normalization(d["normalization"], source),
            classes=tuple(str(c) for c in classes),
            files=files,
            graphs=graphs,
            profile=d.get("profile"),
            plan=d.get("plan"),
            metrics=dict(d.get("metrics") or {}),
            extra={k: v for k, v in d.items() if k not in known},
            format=str(d["format"]),
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_normalization(n: Any, source: str) -> dict[str, Any]:
    """``normalization``: numbers where numbers belong, so preprocessing cannot fail later."""
    hint = "re-export the model with `fedge export` (the manifest was edited or damaged)"
    if not isinstance(n, dict):
        raise ExportError(f"{source}: 'normalization' must be an object, got {n!r}", hint=hint)
    rules = {
        "mean": (lambda v: _number(v), "a number"),
        "std": (lambda v: _number(v) and v > 0, "a positive number"),
        "size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 2, "an integer of at least 2"),
        "channels": (lambda v: v in (1, 3) and not isinstance(v, bool), "1 or 3"),
    }
    kind = n.get("kind", "image")
    if kind not in INPUT_KINDS:
        raise ExportError(f"{source}: normalization.kind must be one of {', '.join(INPUT_KINDS)}, got {kind!r}",
                          hint=hint)
    if kind != "image":  # a sensor window has any number of channels
        rules["channels"] = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1")
    for key, (ok, what) in rules.items():
        if key not in n:
            raise ExportError(f"{source}: normalization.{key} is missing", hint=hint)
        if not ok(n[key]):
            raise ExportError(f"{source}: normalization.{key} must be {what}, got {n[key]!r}", hint=hint)
    return dict(n)


def write_manifest(model_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write ``manifest.json`` into ``model_dir``."""
    path = Path(model_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_manifest(model_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``model_dir/manifest.json`` (files are not checked: see :func:`verify_files`)."""
    data = read_manifest_json(model_dir)
    return Manifest.from_dict(data, source=str(Path(model_dir) / MANIFEST_NAME))


def read_manifest_json(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``model_dir/manifest.json`` as a JSON object, not validated further; an :class:`ExportError` naming the
    file when it is missing or not a JSON object."""
    root = Path(model_dir)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ExportError(f"{root} is not a directory", hint="pass the directory `fedge export --out` wrote")
    if not path.is_file():
        raise ExportError(f"{root} has no {MANIFEST_NAME}", hint="pass the directory `fedge export --out` wrote")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON: {exc}", hint="re-export or re-copy the model directory") from exc
    if not isinstance(data, dict):
        raise ExportError(f"{path} must hold a JSON object")
    return data


def verify_files(model_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Check every file the manifest lists: present, right size, right sha256."""
    root = Path(model_dir)
    for name, entry in sorted(manifest.files.items()):
        path = root / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ExportError(f"{root / MANIFEST_NAME}: file entry {name!r} points outside the model directory")
        if not path.is_file():
            raise ExportError(f"{path} is missing (listed in {MANIFEST_NAME})",
                              hint="re-copy the whole model directory")
        size = path.stat().st_size
        if size != entry.bytes:
            raise ExportError(
                f"{path}: size {size} bytes does not match the manifest's {entry.bytes} (truncated or replaced?)",
                hint="re-copy the model directory or re-export it",
            )
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise ExportError(
                f"{path}: sha256 {digest[:12]}… does not match the manifest's {entry.sha256[:12]}… "
                "(the file was modified or corrupted)",
                hint="re-copy the model directory or re-export it",
            )
