"""ONNX export, per-profile quantization and verification (the device side is :mod:`fedge.runtime`).

    from fedge.export import export_model, export_checkpoint, export_run, probe

The names are imported lazily: importing this package (the CLI does, to register
``fedge export``) must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ExportOptions": "fedge.export.exporter",
    "export_model": "fedge.export.exporter",
    "export_checkpoint": "fedge.export.fleet",
    "export_run": "fedge.export.fleet",
    "probe": "fedge.export.probe",
    "write_measured_profile": "fedge.export.probe",
    "calibration_inputs": "fedge.export.quantize",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
