"""Local training and evaluation loops shared by every device method."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedge.common.lrschedule import CONSTANT, check_schedule, scheduled_lr

# Extra loss term: (model, x, y, logits, features) -> scalar tensor.
ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer settings of local training (from the device's plan, overridable per fleet)."""

    lr: float = 0.1
    batch_size: int = 64
    local_epochs: int = 5
    momentum: float = 0.0
    weight_decay: float = 0.0
    min_tail: int = 1
    """An epoch's last batch smaller than this joins the one before it (1: every batch stands alone)."""
    divergence_margin: float = 0.0
    """Points of validation accuracy a round may lose before the device undoes it (0: never; fedge.edge.divergence)."""
    lr_schedule: str = CONSTANT
    """How ``lr`` changes round by round (:mod:`fedge.common.lrschedule`): ``lr`` is the first round's rate."""
    rounds: int = 0
    """The run's rounds as the device's own config says (a descriptor's ``rounds`` wins; 0: unknown)."""

    def __post_init__(self) -> None:
        check_schedule(self.lr_schedule)

    def at_round(self, rnd: int, total: int = 0) -> TrainConfig:
        """These settings with the learning rate of round ``rnd`` of ``total`` (0: :attr:`rounds`)."""
        lr = scheduled_lr(self.lr, self.lr_schedule, rnd, total or self.rounds)
        return self if lr == self.lr else dataclasses.replace(self, lr=lr)


def make_optimizer(params: list[nn.Parameter] | list[torch.Tensor], cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def batches(n: int, batch_size: int, rng: np.random.Generator, *, shuffle: bool = True,
            min_tail: int = 1) -> Iterator[np.ndarray]:
    """Index batches of one epoch; a last batch of fewer than ``min_tail`` samples joins the one before it.

    A tail of 2 or 3 samples is one SGD step on an almost arbitrary gradient, and with BatchNorm it
    normalizes every feature over those few samples (and moves the running statistics toward them):
    on a device whose share is 2 samples past a multiple of its batch, it is the step that ends
    every epoch. Joined to the batch before, its samples still train every epoch.
    """
    order = rng.permutation(n) if shuffle else np.arange(n)
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] < min_tail:
        starts.pop()
    for j, i in enumerate(starts):
        yield order[i : starts[j + 1] if j + 1 < len(starts) else n]


def train_epochs(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    cfg: TrainConfig,
    rng: np.random.Generator,
    *,
    epochs: int | None = None,
    params: list[nn.Parameter] | None = None,
    forward: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    extra_loss: ExtraLoss | None = None,
) -> float:
    """SGD with cross-entropy for ``epochs`` (default ``cfg.local_epochs``); returns the mean loss.

    ``forward`` maps a batch to (logits, features); by default ``model.features``
    then ``model.head``. ``params`` restricts which parameters are optimized.
    """
    model.train()
    opt = make_optimizer(params if params is not None else list(model.parameters()), cfg)
    fwd = forward or (lambda xb: _default_forward(model, xb))
    xt = torch.from_numpy(np.ascontiguousarray(x))
    yt = torch.from_numpy(np.ascontiguousarray(y))
    total, count = 0.0, 0
    for _ in range(cfg.local_epochs if epochs is None else epochs):
        for idx in batches(len(y), cfg.batch_size, rng, min_tail=cfg.min_tail):
            if len(idx) < 2 and _has_batchnorm(model):
                continue  # BatchNorm cannot train on a batch of one
            xb, yb = xt[idx], yt[idx]
            logits, feats = fwd(xb)
            loss = nn.functional.cross_entropy(logits, yb)
            if extra_loss is not None:
                loss = loss + extra_loss(model, xb, yb, logits, feats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
    return total / max(count, 1)


def _default_forward(model: nn.Module, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    feats = model.features(xb)  # type: ignore[operator]
    return model.head(feats), feats  # type: ignore[operator]


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@torch.no_grad()
def predict(model: nn.Module, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
    """Predicted labels (N,)."""
    model.eval()
    out = []
    for i in range(0, len(x), batch_size):
        out.append(model(torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size]))).argmax(1).numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # inputs -> (logits, features)


@torch.no_grad()
def held_out_metrics(model: nn.Module, x: np.ndarray, y: np.ndarray, forward: Forward | None = None,
                     ) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` (through ``forward``) on ``x``, ``y``; eval mode."""
    model.eval()
    fwd = forward or (lambda xb: (model(xb), xb))
    logits = torch.cat([fwd(torch.from_numpy(np.ascontiguousarray(x[i : i + 1024])))[0]
                        for i in range(0, len(x), 1024)])
    yt = torch.from_numpy(np.ascontiguousarray(y))
    return float((logits.argmax(1) == yt).float().mean()), float(nn.functional.cross_entropy(logits, yt))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy in [0, 1]; NaN for an empty set."""
    if len(y) == 0:
        return float("nan")
    return float((predict(model, x) == y).mean())


@torch.no_grad()
def class_feature_stats(model: nn.Module, x: np.ndarray, y: np.ndarray, num_classes: int,
                        batch_size: int = 512) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class feature sums, squared sums and counts: (C, p), (C, p), (C,)."""
    model.eval()
    sums: np.ndarray | None = None
    sq: np.ndarray | None = None
    counts = np.bincount(y, minlength=num_classes).astype(np.int64)
    for i in range(0, len(y), batch_size):
        f = model.features(torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size]))).double().numpy()  # type: ignore[operator]
        if sums is None:
            sums = np.zeros((num_classes, f.shape[1]))
            sq = np.zeros((num_classes, f.shape[1]))
        yb = y[i : i + batch_size]
        np.add.at(sums, yb, f)
        np.add.at(sq, yb, f * f)  # type: ignore[arg-type]
    assert sums is not None and sq is not None
    return sums, sq, counts


def train_mac_rate(arch: str, batch_size: int, *, embed_dim: int = 64, threads: int = 1, seconds: float = 1.5,
                   cpu_time: bool = True) -> float:
    """Training multiply-accumulates per second of SGD steps of ``arch`` at ``batch_size`` on ``threads`` threads.

    Counts ``3 × forward MACs × batch`` per step (forward, input and weight gradients), as the speed
    model does (:mod:`fedge.profiles.speed`). ``cpu_time``: per CPU second of this process (a CPU quota's
    unit; on a busy host the wall clock counts other processes' time), else per wall second (what a
    device with all its cores to itself reaches).
    """
    import time

    from fedge.common.archs import arch_by_name
    from fedge.edge.models.zoo import build_model
    from fedge.profiles.speed import TRAIN_MACS_FACTOR

    spec = arch_by_name(arch, embed_dim=embed_dim if arch.startswith("tier-") else None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    clock = time.process_time if cpu_time else time.perf_counter
    try:
        model = build_model(spec, seed=0, num_classes=spec.num_classes)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, spec.in_channels, spec.image_size, spec.image_size, generator=gen)
        y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)

        def step() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()  # warm-up: first-call allocations and kernel selection
        steps, t0 = 0, clock()
        while (elapsed := clock() - t0) < seconds or steps < 3:
            step()
            steps += 1
    finally:
        torch.set_num_threads(before)
    return TRAIN_MACS_FACTOR * spec.macs() * batch_size * steps / elapsed
