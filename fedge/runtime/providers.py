"""ONNX Runtime execution providers: which ones a session uses, in a stated order, and which one ran.

ONNX Runtime assigns each node of a graph to the first provider in the session's
list that supports it; nodes no accelerator takes run on the CPU provider, which
is always last. fedge asks for every provider of :data:`PREFERRED` that the
installed ONNX Runtime reports available (``onnxruntime.get_available_providers()``),
in that order: TensorRT before CUDA (TensorRT fuses the graph into one engine and
runs fp16 and int8 natively), vendor GPU and NPU providers next, the CPU last.
Providers that are not local accelerators (``AzureExecutionProvider`` sends
requests to a cloud endpoint) or that need device-specific options to start (XNNPACK,
NNAPI) are only used when named explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedge.errors import ConfigError

CPU = "CPUExecutionProvider"

PREFERRED: tuple[str, ...] = (
    "TensorrtExecutionProvider",  # NVIDIA TensorRT (Jetson, data-centre GPUs)
    "CUDAExecutionProvider",  # NVIDIA CUDA
    "ROCMExecutionProvider",  # AMD ROCm
    "MIGraphXExecutionProvider",  # AMD MIGraphX
    "OpenVINOExecutionProvider",  # Intel CPUs, GPUs and NPUs
    "DmlExecutionProvider",  # DirectML (Windows GPUs)
    "CoreMLExecutionProvider",  # Apple Neural Engine / GPU
    "QNNExecutionProvider",  # Qualcomm NPUs
    CPU,
)

# Providers on which an fp16 graph runs natively (half-precision arithmetic), so fp16
# pays in latency, not only in file size. ONNX Runtime's CPU provider has few fp16
# kernels and computes around them with casts: no faster than fp32.
FP16_PROVIDERS: frozenset[str] = frozenset({
    "TensorrtExecutionProvider", "CUDAExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider",
    "DmlExecutionProvider", "CoreMLExecutionProvider",
})


def available() -> list[str]:
    """What the installed ONNX Runtime build reports available."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


def select(requested: Sequence[str] | None = None, *, present: Sequence[str] | None = None) -> list[str]:
    """The providers a session asks for, best first, the CPU provider always last.

    ``requested`` (e.g. ``fedge infer --provider``) must name available providers;
    by default every available provider of :data:`PREFERRED`, in that order.
    """
    have = list(present) if present is not None else available()
    if requested:
        missing = [p for p in requested if p not in have]
        if missing:
            raise ConfigError(
                f"execution provider {', '.join(missing)} is not available in this ONNX Runtime "
                f"(available: {', '.join(have)})",
                hint="install the onnxruntime build for the accelerator (e.g. onnxruntime-gpu), "
                     "or leave the choice to fedge",
            )
        chosen = list(dict.fromkeys(requested))
        return chosen if CPU in chosen else [*chosen, CPU]
    return [p for p in PREFERRED if p in have] or [CPU]


def short(provider: str) -> str:
    """``CUDAExecutionProvider`` → ``CUDA``."""
    return provider.removesuffix("ExecutionProvider")
