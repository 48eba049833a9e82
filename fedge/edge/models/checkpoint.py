"""Self-describing checkpoints: one safetensors file with the builder name and its arguments.

A checkpoint loads without knowing the class in advance::

    save_checkpoint(model, "cnn3.safetensors")
    model = load_checkpoint("cnn3.safetensors")   # a FedgeNet, built from the stored spec

Anything with a ``build_args()`` method and a builder registered under its class
name can be saved this way. Models are built in; other modules register their
builders when they are imported (:mod:`fedge.edge.generators.modules` does, for
generators and decoders), so this format depends on nothing above it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from fedge.common.atomicfile import write_atomic
from fedge.errors import CheckpointError

log = logging.getLogger(__name__)

_BUILDERS: dict[str, Callable[..., nn.Module]] = {}


def register_builder(name: str, builder: Callable[..., nn.Module]) -> None:
    """Make ``load_checkpoint`` able to rebuild modules saved under ``name``."""
    _BUILDERS[name] = builder


def _ensure_builtin_builders() -> None:
    if "FedgeNet" not in _BUILDERS:
        from fedge.edge.models.families import rebuild_family_net
        from fedge.edge.models.zoo import build_fedgenet

        register_builder("FedgeNet", build_fedgenet)
        register_builder("FamilyNet", rebuild_family_net)


def save_checkpoint(module: nn.Module, path: str | os.PathLike[str],
                    extra: dict[str, str] | None = None) -> Path:
    """Write ``module`` (weights + how to rebuild it) atomically to ``path``."""
    build_args = getattr(module, "build_args", None)
    if build_args is None:
        raise CheckpointError(f"{type(module).__name__} has no build_args(); it cannot be checkpointed")
    meta = {
        "fedge.kind": "module",
        "fedge.builder": type(module).__name__,
        "fedge.args": json.dumps(build_args(), sort_keys=True),
    }
    meta.update(extra or {})
    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    write_atomic(path, safetensors.torch.save(state, metadata=meta))
    return path


def read_checkpoint_meta(path: str | os.PathLike[str]) -> dict[str, str]:
    """The string metadata of a checkpoint (builder, args, extras)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:
        raise CheckpointError(f"{path} is not a safetensors checkpoint: {exc}") from exc


def load_checkpoint(path: str | os.PathLike[str], *, expect: type[nn.Module] | None = None) -> Any:
    """Rebuild the module stored at ``path``; ``expect`` checks its class."""
    _ensure_builtin_builders()
    meta = read_checkpoint_meta(path)
    builder_name = meta.get("fedge.builder")
    if builder_name not in _BUILDERS:
        raise CheckpointError(
            f"{path}: unknown builder {builder_name!r}",
            hint=f"known builders: {', '.join(sorted(_BUILDERS))} (a generator checkpoint loads with "
                 "fedge.edge.generators.modules.load_generator)",
        )
    try:
        args = json.loads(meta.get("fedge.args", "{}"))
        module = _BUILDERS[builder_name](**args)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: stored arguments do not build a {builder_name}: {exc}") from exc
    if expect is not None and not isinstance(module, expect):
        raise CheckpointError(
            f"{path} holds a {type(module).__name__}, expected a {expect.__name__}"
        )
    state = safetensors.torch.load_file(str(path))
    load_state(module, state, source=str(path))
    return module


def load_state(module: nn.Module, state: dict[str, torch.Tensor], *, source: str) -> None:
    """Strictly load ``state``, naming missing/unexpected keys and shape mismatches."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:5]}")
        if wrong:
            parts.append(f"wrong shapes {wrong[:5]}")
        raise CheckpointError(
            f"{source} does not fit {type(module).__name__}: " + "; ".join(parts),
            hint="load it into the architecture it was saved from",
        )
    module.load_state_dict(state)
