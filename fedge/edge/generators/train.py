"""Local generator training and sampling (device side).

Optimizers follow the GeFL code: CVAE Adam(lr 1e-3, weight decay 1e-3) on
``sum-MSE + KL``; DCGAN Adam(lr 2e-4, betas (0.5, 0.999)) for both networks with
the non-saturating BCE loss and uniformly drawn fake labels; DDPM Adam(lr 1e-3) on the
ε-prediction error, gradients clipped at norm 1. As in GeFL each
client keeps its optimizer state from round to round (the trainer object lives
on the device), while the weights are replaced by the global average.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from fedge.edge.generators.modules import CVAE, ConditionalDCGAN, ConditionalDDPM, ConditionalGenerator
from fedge.edge.training import batches

log = logging.getLogger(__name__)


class GeneratorTrainer:
    """Trains one CVAE, DCGAN or DDPM on local data; ``fit`` runs whole epochs."""

    def __init__(self, model: ConditionalGenerator, *, lr: float | None = None,
                 weight_decay: float | None = None, kl_weight: float = 1.0) -> None:
        self.model = model
        # β of a β-VAE (CVAE only): GeFL's loss is sum-MSE + KL, i.e. β = 1.
        self.kl_weight = kl_weight
        if isinstance(model, CVAE):
            self.opts = [torch.optim.Adam(model.parameters(), lr=1e-3 if lr is None else lr,
                                          weight_decay=1e-3 if weight_decay is None else weight_decay)]
        elif isinstance(model, ConditionalDCGAN):
            betas = (0.5, 0.999)
            self.opts = [
                torch.optim.Adam(model.disc.parameters(), lr=2e-4 if lr is None else lr, betas=betas,
                                 weight_decay=weight_decay or 0.0),
                torch.optim.Adam(model.gen.parameters(), lr=2e-4 if lr is None else lr, betas=betas,
                                 weight_decay=weight_decay or 0.0),
            ]
        elif isinstance(model, ConditionalDDPM):
            # GeFL publishes no DDPM optimizer for FMNIST; Adam 1e-3 suits these small denoisers.
            self.opts = [torch.optim.Adam(model.parameters(), lr=1e-3 if lr is None else lr,
                                          weight_decay=weight_decay or 0.0)]
        else:
            raise TypeError(f"no trainer for {type(model).__name__}")

    def fit(self, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int,
            rng: np.random.Generator, gen: torch.Generator) -> float:
        """Train on ``x`` (N, C, S, S) in generator space, ``y`` (N,); returns the mean loss per sample."""
        self.model.train()
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        yt = torch.from_numpy(np.ascontiguousarray(y)).long()
        total, count = 0.0, 0
        for _ in range(epochs):
            for idx in batches(len(yt), batch_size, rng):
                if len(idx) < 2:
                    continue  # BatchNorm cannot train on a batch of one
                xb, yb = xt[idx], yt[idx]
                if isinstance(self.model, CVAE):
                    loss = self._cvae_step(xb, yb, gen)
                elif isinstance(self.model, ConditionalDDPM):
                    loss = self._ddpm_step(xb, yb, gen)
                else:
                    loss = self._dcgan_step(xb, yb, gen)
                total += loss * len(idx)
                count += len(idx)
        return total / max(count, 1)

    def _cvae_step(self, xb: torch.Tensor, yb: torch.Tensor, gen: torch.Generator) -> float:
        assert isinstance(self.model, CVAE)
        recon, mu, logvar = self.model(xb, yb, gen)
        # GeFL: reduction="sum" MSE + the analytic KL to N(0, I), both summed over the batch.
        rec = nn.functional.mse_loss(recon, xb, reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        loss = rec + self.kl_weight * kld
        opt = self.opts[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach()) / len(xb)

    def _ddpm_step(self, xb: torch.Tensor, yb: torch.Tensor, gen: torch.Generator) -> float:
        assert isinstance(self.model, ConditionalDDPM)
        loss = self.model.loss(xb, yb, gen)
        opt = self.opts[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # Rare large-t batches give spikes; clipping keeps the averaged model from jumping.
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    def _dcgan_step(self, xb: torch.Tensor, yb: torch.Tensor, gen: torch.Generator) -> float:
        m = self.model
        assert isinstance(m, ConditionalDCGAN)
        k = m.spec.num_classes
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(xb)), torch.zeros(len(xb))
        opt_d, opt_g = self.opts
        # Discriminator: real (x, y) vs. G(z, y') with y' uniform, as in GeFL's LocalUpdate_DCGAN.
        z = torch.randn((len(xb), m.spec.latent), generator=gen)
        yf = torch.randint(0, k, (len(xb),), generator=gen)
        with torch.no_grad():
            fake = m.generate(z, yf)
        d_loss = bce(m.discriminate(xb, yb), ones) + bce(m.discriminate(fake, yf), zeros)
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()
        # Generator: fresh noise and labels, non-saturating loss.
        z = torch.randn((len(xb), m.spec.latent), generator=gen)
        yf = torch.randint(0, k, (len(xb),), generator=gen)
        g_loss = bce(m.discriminate(m.generate(z, yf), yf), ones)
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        return float(d_loss.detach() + g_loss.detach())


def uniform_labels(n: int, classes: np.ndarray | list[int], gen: torch.Generator) -> torch.Tensor:
    """``n`` labels drawn uniformly from ``classes`` (GeFL: labels uniform over the classes)."""
    cls = torch.as_tensor(np.asarray(classes, dtype=np.int64))
    if len(cls) == 0:
        return torch.zeros(0, dtype=torch.long)
    return cls[torch.randint(0, len(cls), (n,), generator=gen)]


@torch.no_grad()
def sample_dataset(model: ConditionalGenerator, n: int, classes: np.ndarray | list[int], gen: torch.Generator,
                   *, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """``n`` fresh samples with uniform labels: x (n, C, S, S) in generator space, y (n,)."""
    model.eval()
    labels = uniform_labels(n, classes, gen)
    xs = [model.sample(labels[i : i + batch_size], gen) for i in range(0, len(labels), batch_size)]
    x = torch.cat(xs).numpy() if xs else np.zeros((0, *model.out_shape), dtype=np.float32)
    return x.astype(np.float32, copy=False), labels.numpy()
