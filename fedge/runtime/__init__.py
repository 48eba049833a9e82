"""The on-device inference runtime: numpy and ONNX Runtime only (PIL lazily, for image files).

Importing this package must never import torch (a test checks it), so a device
only needs ``numpy``, ``onnxruntime`` and, to read PNG/JPEG files, ``pillow``.
"""

from fedge.runtime.inputs import Batch, load_inputs
from fedge.runtime.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest, verify_files
from fedge.runtime.model import EdgeModel, Prediction

__all__ = [
    "MANIFEST_NAME",
    "Batch",
    "EdgeModel",
    "FileEntry",
    "Manifest",
    "Prediction",
    "load_inputs",
    "read_manifest",
    "verify_files",
]
