"""Which pip extra of fedge provides which optional module, and the error that says so.

fedge's core (numpy, safetensors, paho-mqtt) runs the coordinator's bookkeeping,
profiles, the planner and the broker set-up; everything heavier sits in an
extra (pyproject.toml) and is imported only by the commands that need it. When
such an import fails, :func:`missing_extra` turns the ``ModuleNotFoundError``
into a :class:`MissingExtraError` naming the extra to install; the CLI prints it
instead of a traceback.
"""

from __future__ import annotations

from fedge.errors import FedgeError

# import name -> (distribution, the smallest extra that brings it)
EXTRA_OF: dict[str, tuple[str, str]] = {
    "onnxruntime": ("onnxruntime", "runtime"),
    "PIL": ("pillow", "runtime"),
    "torch": ("torch", "device"),
    "onnx": ("onnx", "export"),
    "onnxscript": ("onnxscript", "export"),
    "torchvision": ("torchvision", "sim"),
    "matplotlib": ("matplotlib", "sim"),
    "tqdm": ("tqdm", "sim"),
    "sklearn": ("scikit-learn", "sim"),
    "amqtt": ("amqtt", "sim"),
    "yaml": ("pyyaml", "flash"),
    "dp_accounting": ("dp-accounting", "privacy"),
    "ray": ("ray", "ray"),
    "prometheus_client": ("prometheus-client", "observe"),
}


class MissingExtraError(FedgeError):
    """An optional dependency is not installed: the message names the pip extra that provides it."""

    exit_code = 8

    def __init__(self, module: str, extra: str, distribution: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(f"this command needs {distribution} (module {module!r}), which is not installed",
                         hint=f"pip install 'fedge[{extra}]' (or 'fedge[all]' for everything)")


def missing_extra(exc: ImportError) -> MissingExtraError | None:
    """The extra that provides the module ``exc`` failed to import, or None if fedge has no extra for it."""
    top = (exc.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    dist, extra = EXTRA_OF[top]
    return MissingExtraError(top, extra, dist)
