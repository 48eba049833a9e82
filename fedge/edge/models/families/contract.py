"""Loading a family's builder and holding it to the contract of docs/models.md, before any training.

A family is a function ``build(tier, in_channels, input_size, num_classes, embed_dim)`` returning an
``nn.Module`` with four submodules, ``extractor``, ``body``, ``embed`` and ``head``, such that
``head(embed(body(extractor(x))))`` are the logits; its tiers, smallest first, are the ``TIERS`` of its
module (or the function's ``tiers`` attribute). It is named by

* a built-in name (``mobilenet``, ``resnet8``, ``dscnn``, ``cnn1d``);
* ``path/to/my_family.py:build`` (the fleet config resolves a relative path against its directory);
* ``package.module:build`` (an importable module), or the name of an entry point in the group
  ``fedge.families``.

Each violation is refused with a :class:`~fedge.errors.ConfigError` naming what is wrong and how to fix it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import io
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedge.edge.models.families.builtin import BUILDERS, Parts
from fedge.errors import ConfigError

log = logging.getLogger(__name__)

PARTS = ("extractor", "body", "embed", "head")
ENTRY_POINT_GROUP = "fedge.families"
Builder = Callable[..., nn.Module]


def _from_file(path: Path, func: str, family: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"[model] family = {family!r}: {path} does not exist",
                          hint="give the file's path relative to the fleet config, "
                               "e.g. family = \"my_family.py:build\"")
    spec = importlib.util.spec_from_file_location(f"fedge_family_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"[model] family = {family!r}: {path} is not a Python module", hint="name a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"[model] family = {family!r}: importing {path} failed: {exc!r}",
                          hint="fix the error in the family's module (it is imported before any training)") from exc
    return module


def _target(family: str) -> tuple[Any, str]:
    """(module, function name) of a family reference that is not built in."""
    ref, sep, func = family.rpartition(":")
    if not sep or not func:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == family:
                fn = ep.load()
                return importlib.import_module(fn.__module__), fn.__name__
        raise ConfigError(f"[model] family = {family!r} is not a built-in family, a file or an entry point",
                          hint=f"use one of {', '.join(BUILDERS)}, \"my_family.py:build\", \"package.module:build\", "
                               f"or an entry point of the group {ENTRY_POINT_GROUP!r}")
    if ref.endswith(".py"):
        return _from_file(Path(ref), func, family), func
    try:
        return importlib.import_module(ref), func
    except ImportError as exc:
        raise ConfigError(f"[model] family = {family!r}: cannot import {ref}: {exc}",
                          hint="install the package that holds the family, or name its .py file") from exc


def load_family(family: str) -> tuple[Builder, tuple[str, ...]]:
    """The builder of ``family`` and its tiers, smallest first."""
    from fedge.common.families import BUILTIN_TIERS

    if family in BUILDERS:
        return BUILDERS[family], BUILTIN_TIERS[family]
    module, func = _target(family)
    build = getattr(module, func, None)
    if not callable(build):
        where = getattr(module, "__name__", module)
        raise ConfigError(f"[model] family = {family!r}: {where} has no function {func!r}",
                          hint=f"define def {func}(tier, in_channels, input_size, num_classes, embed_dim) -> nn.Module")
    tiers = getattr(build, "tiers", None) or getattr(module, "TIERS", None)
    if not tiers or not isinstance(tiers, Sequence) or isinstance(tiers, str) or not all(
            isinstance(t, str) and t for t in tiers):
        raise ConfigError(f"[model] family = {family!r} declares no tiers",
                          hint="set TIERS = (\"s\", \"m\", \"l\") in its module (smallest first), or build.tiers")
    return build, tuple(tiers)


def build_parts(family: str, tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int,
                embed_dim: int) -> tuple[nn.Module, ...]:
    """Build one network of ``family`` and check it: four parts, the right shapes, forward = composition."""
    build, tiers = load_family(family)
    if tier not in tiers:
        raise ConfigError(f"family {family!r} has no tier {tier!r}", hint=f"use one of {', '.join(tiers)}")
    what = f"family {family!r} at tier {tier!r}"
    try:
        net = build(tier, in_channels, tuple(input_size), num_classes, embed_dim)
    except Exception as exc:
        raise ConfigError(f"{what}: build(...) raised {exc!r}",
                          hint="build(tier, in_channels, input_size, num_classes, embed_dim) must return an nn.Module "
                               f"for every tier in {tiers} and this input") from exc
    if not isinstance(net, nn.Module):
        raise ConfigError(f"{what}: build(...) returned a {type(net).__name__}, not an nn.Module",
                          hint="return a module with extractor, body, embed and head submodules")
    missing = [p for p in PARTS if not isinstance(getattr(net, p, None), nn.Module)]
    if missing:
        raise ConfigError(f"{what}: the module declares no {', '.join(missing)} (missing split)",
                          hint="set self.extractor, self.body, self.embed and self.head to nn.Modules such that "
                               "head(embed(body(extractor(x)))) are the logits (nn.Identity() for an empty part)")
    parts = tuple(getattr(net, p) for p in PARTS)
    _check_shapes(what, net, parts, (in_channels, *input_size), num_classes, embed_dim)
    return parts


def _check_shapes(what: str, net: nn.Module, parts: tuple[nn.Module, ...], input_shape: tuple[int, ...],
                  num_classes: int, embed_dim: int) -> None:
    x = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(0))
    extractor, body, embed, head = parts
    net.eval()
    try:
        with torch.no_grad():
            stem = extractor(x)
            feats = embed(body(stem))
            logits = head(feats)
    except Exception as exc:
        raise ConfigError(f"{what}: forward on an input of shape {tuple(x.shape)} fails: {exc}",
                          hint="the network must take (batch, *input) and run head(embed(body(extractor(x))))"
                               "; check the layers' channel counts against in_channels and input_size") from exc
    finally:
        net.train()
    if feats.dim() != 2 or feats.shape[1] != embed_dim:
        raise ConfigError(f"{what}: embed outputs {tuple(feats.shape)}, not (batch, {embed_dim})",
                          hint="end body with a flatten (or a global pool and a flatten) and make embed output "
                               "embed_dim features: prototype methods compare embeddings across the fleet")
    if tuple(logits.shape) != (2, num_classes):
        raise ConfigError(f"{what}: forward gives {tuple(logits.shape)}, not (batch, {num_classes}) logits",
                          hint="make head map embed_dim features to num_classes logits")
    if type(net).forward is not nn.Module.forward and not isinstance(net, Parts):
        with torch.no_grad():
            net.eval()
            own = net(x)
            net.train()
        if not isinstance(own, torch.Tensor) or own.shape != logits.shape or not torch.allclose(own, logits,
                                                                                                atol=1e-5):
            raise ConfigError(f"{what}: its forward differs from head(embed(body(extractor(x))))",
                              hint="fedge runs the four parts in that order (methods train and share them "
                                   "separately): move any extra step into one of the parts")


def check_onnx_export(module: nn.Module, input_shape: tuple[int, ...], what: str) -> None:
    """Refuse a network the ONNX exporter cannot take (what fedge export needs), at load."""
    module.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.zeros(2, *input_shape),), io.BytesIO(),  # type: ignore[arg-type]
                              dynamo=False, opset_version=17,
                              input_names=["input"], output_names=["output"],
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    except Exception as exc:
        raise ConfigError(f"{what}: the network does not export to ONNX (opset 17): {exc}",
                          hint="use layers ONNX has operators for and no Python control flow on tensor values "
                               "(fedge export ships ONNX to the devices)") from exc
    finally:
        module.train()
