"""One exception hierarchy for fedge.

Every error that can reach a user says *what* failed, *where* (file, key, tensor
name, shape) and *how to fix it*. The CLI turns a :class:`FedgeError` into a
one-paragraph message and the subclass's exit code instead of a traceback.
"""

from __future__ import annotations


class FedgeError(Exception):
    """Base class of every error fedge raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  fix: {hint}")


class ConfigError(FedgeError):
    """A profile, fleet config or CLI argument is invalid."""

    exit_code = 2


class ProfileError(ConfigError):
    """A device profile is unknown or invalid."""


class DataError(FedgeError):
    """A dataset is missing, corrupt, or a partition cannot be built."""

    exit_code = 3


class CheckpointError(FedgeError):
    """A checkpoint is missing, corrupt, or does not fit the model."""

    exit_code = 4


class PayloadError(FedgeError):
    """An encoded message or tensor payload is malformed or violates its schema."""

    exit_code = 5


class TransportError(FedgeError):
    """The transport (in-process or MQTT) failed."""

    exit_code = 6


class ExportError(FedgeError):
    """ONNX export, quantization or verification failed."""

    exit_code = 7


class EmulationError(FedgeError):
    """The Docker emulation of a fleet cannot run (no engine, no image, no binfmt) or a container failed."""

    exit_code = 9
