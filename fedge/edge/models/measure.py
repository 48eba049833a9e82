"""Sizes of a built network, measured with forward hooks: parameters, MACs, saved activations.

The planner, the speed model, ``fedge emulate``'s quotas and the virtual clock need a model's
parameters, multiply-accumulates per sample and the activations training keeps for backward. For a
network of any family these are measured here from the module itself, on one forward pass of one
sample, instead of formulas written for one shape:

* **parameters**: ``sum(p.numel())`` over trainable parameters (BatchNorm statistics are buffers);
* **MACs**: every ``Conv1d``/``Conv2d`` counts ``output elements × (C_in / groups) × kernel``, every
  ``Linear`` ``output elements × in_features`` (bias additions and element-wise layers are free); a module
  with an integer ``macs_per_sample`` attribute (the MFCC front end) counts that;
* **activation elements**: the input plus the output of every leaf module except pure reshapes
  (``Flatten``/``Unflatten``): what autograd keeps for backward, the figure the planner's training
  memory multiplies by the batch (:func:`fedge.profiles.planner.train_memory_mb`).

For the GeFL CNN family these equal :class:`fedge.common.archs.ArchSpec`'s counts exactly (a test checks
every CNN-k and tier), so the published-protocol figures do not move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fedge.common.families import MeasuredSizes

# Leaf modules whose output is a view of their input: no new activation memory.
_RESHAPES = (nn.Flatten, nn.Unflatten)


def _leaves(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if not list(m.children())]


def _macs(m: nn.Module, out: torch.Tensor) -> int:
    fixed = getattr(m, "macs_per_sample", None)  # a module of fixed ops that states its count (the MFCC front end)
    if isinstance(fixed, int):
        return fixed
    per_sample = out[0].numel()
    if isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return per_sample * (m.in_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, nn.Linear):
        return per_sample * m.in_features
    return 0


def measure_forward(module: nn.Module, input_shape: Sequence[int]) -> tuple[int, int]:
    """MACs and saved activation elements of one forward pass of one sample of ``input_shape`` (C, ...)."""
    macs = [0]
    acts = [math.prod(input_shape)]

    def hook(m: nn.Module, _inp: Any, out: Any) -> None:
        if not isinstance(out, torch.Tensor):
            return
        macs[0] += _macs(m, out)
        if not isinstance(m, _RESHAPES):
            acts[0] += out[0].numel()

    handles = [m.register_forward_hook(hook) for m in _leaves(module)]
    was_training = module.training
    try:
        module.eval()  # BatchNorm would refuse a batch of one in training mode; the shapes are the same
        with torch.no_grad():
            module(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
        module.train(was_training)
    return macs[0], acts[0]


def trainable_params(module: nn.Module) -> int:
    """Trainable parameters of ``module``."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def measure(net: nn.Module, input_shape: Sequence[int]) -> MeasuredSizes:
    """Everything the torch-free side needs about a split network (``extractor``/``body``/``embed``/``head``)."""
    macs, acts = measure_forward(net, input_shape)
    extractor = getattr(net, "extractor", None)
    with torch.no_grad():
        was = net.training
        net.eval()
        x = torch.zeros(1, *input_shape)
        stem = extractor(x) if isinstance(extractor, nn.Module) else x
        feats = net.features(x) if hasattr(net, "features") else net(x)  # type: ignore[operator]
        net.train(was)
    return MeasuredSizes(
        params=trainable_params(net),
        macs=macs,
        activation_elems=acts,
        param_shapes={k: tuple(v.shape) for k, v in net.state_dict().items()},
        stem_shape=tuple(stem.shape[1:]),
        feature_dim=int(feats.shape[1]),
    )
