"""FedVTC (variational transposed convolution; arXiv 2508.01669), device half.

No official code exists; this follows the method as described (see
``docs/methods.md`` for every choice fedge had to make). Per round:

* ``apply_global``: with the global prototypes c^y, global σ and class counts
  of the previous round, decode synthetic images x' = ψ_k(v), v = c^y + σ ⊙ ε
  (labels uniform over the classes some device holds — ``synthetic_labels =
  "local"``: over this device's own classes — as many as the device's real
  samples, fresh every round) and fine-tune the *whole* model f_k on them
  with cross-entropy (``finetune = "head"``: only the classifier head h_k, the
  ablation). It runs here, before the agent evaluates, so the reported accuracy
  is that of the fine-tuned model — the paper's order (train, upload,
  aggregate, generate, fine-tune).
* ``train_round``: ``local_epochs`` alternations of one model epoch (cross-entropy
  + the KL term pulling class-y features toward N(c^y, σ²); ``kl = false``
  removes it), each of the last ``decoder_epochs`` (default: all) followed by one
  decoder epoch: reconstruction ‖ψ_k(g_k(x) + s σ_k ⊙ ε) − x‖² (s = ``recon_noise``,
  default 1 as published) + distribution
  matching on latents drawn from the global distribution (``dm = false`` removes
  it). Model and decoder never train in the same step.
* Upload: per-class feature means (C, p), the within-class σ_k (p,) and class
  counts (C,) — nothing else.

Distribution matching (not published; fedge's choice, as methods.md suggests):
decode v ~ N(c^y, σ²), pass the images back through the frozen g_k and penalise
(1) the per-class mean of (g_k(x') − c^y)/σ, (2) the deviation of its per-dim
second moment from 1, and (3) the cross-entropy of h_k on them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from fedge.common.generators import GeneratorSpec
from fedge.common.method_settings import FedVTCSettings
from fedge.common.rounds import VTC_STATS_ARTIFACT, RoundInfo
from fedge.edge.generators.modules import VTCDecoder, build_generator
from fedge.edge.generators.train import uniform_labels
from fedge.edge.methods.base import Arrays, DeviceContext, DeviceMethod
from fedge.edge.methods.gefl import device_tier
from fedge.edge.methods.personal import GuardDecision, PersonalMixin, guard_settings, guarded_step, holdout
from fedge.edge.training import batches, class_feature_stats, train_epochs
from fedge.errors import ConfigError

log = logging.getLogger(__name__)

SIGMA_FLOOR = 1e-3  # absolute floor of the σ used for sampling
# The KL and DM terms divide by σ; a near-dead feature (σ ≈ 0) would make them explode, so the
# σ they normalise by is floored at this fraction of the mean σ.
SIGMA_REL_FLOOR = 0.1
DECODER_CLIP = 5.0  # gradient-norm clip of the decoder step (DM gradients pass through the whole model)


def local_statistics(model: nn.Module, x: np.ndarray, y: np.ndarray,
                     num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class feature means (C, p), the pooled within-class std (p,) and counts (C,).

    σ_k² is the variance of the features around their own class mean, pooled over
    the device's classes, so that n_y (σ_k² + μ_y²) summed over classes is exactly
    the device's feature second moment — what the coordinator's pooled variance needs.
    """
    sums, sq, counts = class_feature_stats(model, x, y, num_classes)
    n = np.maximum(counts, 1)[:, None].astype(np.float64)
    protos = sums / n
    total = max(int(counts.sum()), 1)
    within = (sq.sum(0) - (counts[:, None] * protos**2).sum(0)) / total
    sigma = np.sqrt(np.maximum(within, 0.0))
    return protos.astype(np.float32), sigma.astype(np.float32), counts.astype(np.int64)


class FedVTCDevice(PersonalMixin, DeviceMethod):
    """FedVTC: statistics up, a local decoder ψ_k, whole-model fine-tuning on decoded images."""

    settings_type = FedVTCSettings
    settings: FedVTCSettings

    def __init__(self, ctx: DeviceContext) -> None:
        super().__init__(ctx)
        cfg = self.settings
        self.dm = cfg.dm
        self.kl = cfg.kl
        self.finetune = cfg.finetune
        self.finetune_epochs = cfg.finetune_epochs
        self.finetune_real = cfg.finetune_real
        self.synthetic_ratio = cfg.synthetic_ratio
        self.kl_weight = cfg.kl_weight
        self.dm_weight = cfg.dm_weight
        # v = z + s·σ_k ⊙ ε during reconstruction; the paper's s = 1. With noise as wide as the class
        # itself, ψ learns to ignore where in the class v lies and decodes one template per class;
        # a smaller s keeps the within-class detail, so samples around c^y differ (docs/methods.md).
        self.recon_noise = cfg.recon_noise
        # Which labels the decoder is asked for (fine-tuning and DM): "global" — every class some device
        # holds (the paper) — or "local" — the classes this device holds. A class the device has never
        # seen decodes into a look-alike of its own classes, i.e. a mislabelled local image; under strong
        # label skew that noise can undo a small device's training (docs/methods.md).
        self.synthetic_labels = cfg.synthetic_labels
        self.alternations = ctx.train_cfg.local_epochs
        # The decoder persists across rounds, so it need not train after every model epoch:
        # it trains after the last ``decoder_epochs`` of them (it dominates a round's cost).
        self.decoder_epochs = cfg.decoder_epochs_or(self.alternations)
        if self.decoder_epochs > self.alternations:
            raise ConfigError(f"[method] decoder_epochs ({self.decoder_epochs}) exceeds the alternations per "
                              f"round ([train] local_epochs = {self.alternations})",
                              hint="set decoder_epochs <= local_epochs")
        spec = ctx.model.spec
        self.tier = device_tier(ctx, cfg.generator_tier)
        self.dec_spec = GeneratorSpec("vtc", (spec.in_channels, spec.image_size, spec.image_size), tier=self.tier,
                                      num_classes=ctx.num_classes, latent_dim=spec.feature_dim)
        self.decoder: VTCDecoder = build_generator(self.dec_spec, seed=ctx.seed)  # type: ignore[assignment]
        self.dec_opt = torch.optim.Adam(self.decoder.parameters(), lr=cfg.decoder_lr)
        self.decoder_trained = False
        norm = ctx.train.norm
        self.mean, self.std = float(norm.mean), float(norm.std)
        self._derive_from_data()
        self.local_sigma: torch.Tensor | None = None  # (p,)
        self.g_protos: torch.Tensor | None = None  # (C, p)
        self.g_sigma: torch.Tensor | None = None  # (p,)
        self.g_scale = torch.ones(1)  # (p,) the floored σ the KL and DM terms normalise by
        self.g_classes: np.ndarray = np.zeros(0, dtype=np.int64)  # classes with a global count > 0
        self.g_mask: torch.Tensor | None = None  # (C,) bool
        # the guard's verdict on this round's fine-tuning, and the synthetic weight it judged
        self.guard_decision: tuple[GuardDecision, float] | None = None
        self.synthetic_weight = 1.0  # scales the decoded sample count; only the guard changes it
        log.info("%s: VTC decoder tier %s, %d parameters", ctx.device_id, self.tier, self.dec_spec.num_params())

    # -- global statistics ------------------------------------------------------------------
    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [VTC_STATS_ARTIFACT]

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:
        stats = artifacts.get(VTC_STATS_ARTIFACT)
        if not stats:
            return
        counts = np.asarray(stats["counts"]).astype(np.int64)
        self.g_protos = torch.from_numpy(np.asarray(stats["protos"], dtype=np.float32))
        self.g_sigma = torch.from_numpy(np.maximum(np.asarray(stats["sigma"], dtype=np.float32), SIGMA_FLOOR))
        self.g_scale = torch.clamp(self.g_sigma, min=SIGMA_REL_FLOOR * float(self.g_sigma.mean()))  # (p,)
        self.g_classes = np.flatnonzero(counts > 0)
        self.g_mask = torch.from_numpy(counts > 0)
        if len(self.g_classes) < self.ctx.num_classes:
            log.info("%s: classes %s are on no device; they get no synthetic samples", self.ctx.device_id,
                     sorted(set(range(self.ctx.num_classes)) - set(self.g_classes.tolist())))
        if self.decoder_trained and len(self.s_classes) and self.finetune_epochs > 0:
            self._finetune(info.round)

    @property
    def s_classes(self) -> np.ndarray:
        """The classes decoded for fine-tuning and DM (``synthetic_labels``)."""
        if self.synthetic_labels == "global":
            return self.g_classes
        return np.intersect1d(self.g_classes, self.local_classes)

    def _global_latents(self, labels: torch.Tensor) -> torch.Tensor:
        """v = c^y + σ ⊙ ε (B, p), ε from the device's torch generator."""
        assert self.g_protos is not None and self.g_sigma is not None
        eps = torch.randn((len(labels), self.g_protos.shape[1]), generator=self.ctx.torch_gen)
        return self.g_protos[labels] + self.g_sigma * eps

    def _derive_from_data(self) -> None:
        """The device's classes and its images in [0, 1] (the decoder's targets), from ``ctx.train``."""
        ctx = self.ctx
        self.local_classes = np.flatnonzero(np.bincount(ctx.train.y, minlength=ctx.num_classes) > 0)
        self.x01 = torch.from_numpy(np.clip(ctx.train.x * self.std + self.mean, 0, 1).astype(np.float32))

    def data_changed(self) -> None:
        super().data_changed()
        self._derive_from_data()

    def _normalize(self, x01: torch.Tensor) -> torch.Tensor:
        return (x01 - self.mean) / self.std

    @torch.no_grad()
    def synthesize(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` decoded images (normalized, as the model sees data), labels uniform over the decoded classes."""
        labels = uniform_labels(n, self.s_classes, self.ctx.torch_gen)
        self.decoder.eval()
        xs = [self._normalize(self.decoder(self._global_latents(labels[i : i + 256])))
              for i in range(0, n, 256)]
        return torch.cat(xs).numpy(), labels.numpy()

    def _finetune(self, rnd: int = 0) -> float:
        ctx = self.ctx
        weight = self.synthetic_weight
        n = max(2, round(weight * self.synthetic_ratio * len(ctx.train)))
        xs, ys = self.synthesize(n)
        guard = guard_settings(self.settings)
        rest, val = (holdout(len(ctx.train), guard.val_fraction, ctx.seed, fold=rnd) if guard is not None
                     else (np.arange(len(ctx.train)), np.zeros(0, dtype=np.int64)))
        xr, yr = ctx.train.x[rest], ctx.train.y[rest]
        if self.finetune_real:
            # Decoded images are blurrier than real ones; ending every round on them alone costs
            # accuracy on real data, so by default the epoch mixes them with the real samples.
            xs, ys = np.concatenate([xs, xr]), np.concatenate([ys, yr])
        model = ctx.model
        params = list(model.head.parameters()) if self.finetune == "head" else list(model.parameters())
        forward = None
        if self.finetune == "head":
            # Head-only ablation: the extractor must not drift (BN statistics included).
            def forward(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                with torch.no_grad():
                    model.eval()
                    feats = model.features(xb)
                return model.head(feats), feats

        def tune(x: np.ndarray, y: np.ndarray) -> float:
            return train_epochs(model, x, y, ctx.train_cfg, ctx.rng, epochs=self.finetune_epochs, params=params,
                                forward=forward)

        if guard is None or len(val) == 0:
            return tune(xs, ys)
        # The guard: the same fine-tuning without the decoded images (on the real samples only, or
        # none at all when the method's fine-tuning has no real samples), judged on the held-out fold.
        losses: list[float] = []
        decision = guarded_step(model, lambda: losses.append(tune(xs, ys)),
                                lambda: losses.append(tune(xr, yr)) if self.finetune_real else None,
                                ctx.train.x[val], ctx.train.y[val], guard.guard_tolerance)
        self.guard_decision = (decision, weight)
        self.synthetic_weight = decision.next_weight(weight)
        return losses[-1]

    # -- local training ---------------------------------------------------------------------
    def _kl_loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, logits: torch.Tensor,
                 feats: torch.Tensor) -> torch.Tensor:
        """KL(N(g(x), σ_k²) ‖ N(c^y, σ²)) in g, per feature dimension, with bounded gradients.

        The Gaussian KL's term in g is ½‖(g(x) − c^y)/σ‖². The global statistics lag one
        round behind a model that is still moving, so early on ‖g − c‖/σ can be in the
        hundreds and its quadratic gradient diverges the model (seen on digits with SGD
        lr 0.05). fedge uses the Huber form of the same term (quadratic within one σ,
        linear beyond), which is the KL near the prototype and bounded far from it.
        """
        assert self.g_protos is not None and self.g_mask is not None
        keep = self.g_mask[yb]
        if not bool(keep.any()):
            return feats.sum() * 0.0
        d = (feats[keep] - self.g_protos[yb[keep]]) / self.g_scale  # (B', p)
        return self.kl_weight * nn.functional.huber_loss(d, torch.zeros_like(d), delta=1.0)

    def _dm_loss(self, batch: int) -> torch.Tensor:
        """Distribution matching of decoded global latents (see the module docstring)."""
        assert self.g_protos is not None and self.g_sigma is not None
        model = self.ctx.model
        labels = uniform_labels(batch, self.s_classes, self.ctx.torch_gen)
        feats = model.features(self._normalize(self.decoder(self._global_latents(labels))))  # (B, p)
        r = (feats - self.g_protos[labels]) / self.g_scale  # (B, p): ~N(0, 1) if matched
        r = r.clamp(-10.0, 10.0)  # a decoder far off the global distribution must not swamp L_rc
        c = self.g_protos.shape[0]
        sums = torch.zeros(c, r.shape[1]).index_add(0, labels, r)
        counts = torch.bincount(labels, minlength=c).clamp(min=1).unsqueeze(1)
        present = torch.bincount(labels, minlength=c) > 0
        mom1 = (sums / counts)[present].pow(2).mean()
        # log-ratio of the second moment to 1: symmetric in too-wide / too-narrow, and bounded gradients
        mom2 = torch.log(r.pow(2).mean(0) + 1e-6).pow(2).mean()
        ce = nn.functional.cross_entropy(model.head(feats), labels)
        return mom1 + mom2 + ce

    def _decoder_epoch(self) -> float:
        ctx = self.ctx
        model = ctx.model
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)  # the model is frozen while ψ trains (gradients still flow through it)
        self.decoder.train()
        xt = torch.from_numpy(ctx.train.x)
        use_dm = self.dm and self.g_protos is not None and len(self.s_classes) > 0
        sigma_k = self.local_sigma if self.local_sigma is not None else torch.zeros(model.spec.feature_dim)
        total, count = 0.0, 0
        try:
            for idx in batches(len(ctx.train), ctx.train_cfg.batch_size, ctx.rng):
                if len(idx) < 2:
                    continue
                with torch.no_grad():
                    z = model.features(xt[idx])  # (B, p)
                v = z + self.recon_noise * sigma_k * torch.randn(z.shape, generator=ctx.torch_gen)
                # L_rc: squared error summed over pixels, averaged over the batch (the VAE convention).
                loss = (self.decoder(v) - self.x01[idx]).pow(2).flatten(1).sum(1).mean()
                if use_dm:
                    loss = loss + self.dm_weight * self._dm_loss(len(idx))
                self.dec_opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.decoder.parameters(), DECODER_CLIP)
                self.dec_opt.step()
                total += float(loss.detach()) * len(idx)
                count += len(idx)
        finally:
            for p in model.parameters():
                p.requires_grad_(True)
        self.decoder_trained = True
        return total / max(count, 1)

    def _refresh_local_sigma(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ctx = self.ctx
        protos, sigma, counts = local_statistics(ctx.model, ctx.train.x, ctx.train.y, ctx.num_classes)
        self.local_sigma = torch.from_numpy(sigma)
        return protos, sigma, counts

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        ctx = self.ctx
        one_epoch = dataclasses.replace(ctx.train_cfg, local_epochs=1)
        extra = self._kl_loss if (self.kl and self.g_protos is not None) else None
        losses, dec_losses = [], []
        for i in range(self.alternations):
            losses.append(train_epochs(ctx.model, ctx.train.x, ctx.train.y, one_epoch, ctx.rng, extra_loss=extra))
            if i >= self.alternations - self.decoder_epochs:
                stats = self._refresh_local_sigma()
                dec_losses.append(self._decoder_epoch())
        # The last alternation always ends with a decoder epoch, which leaves the model (weights and
        # BN statistics, in eval mode) untouched: the statistics computed before it are the upload.
        protos, sigma, counts = stats
        info_out: dict[str, Any] = {"loss": float(np.mean(losses)), "dec_loss": float(np.mean(dec_losses))}
        if self.guard_decision is not None:  # decided when this round's global statistics arrived
            info_out.update(self.guard_decision[0].info(self.guard_decision[1]))
            self.guard_decision = None
        return {"protos": protos, "sigma": sigma, "counts": counts}, info_out

    def latent_distribution(self) -> dict[str, np.ndarray]:
        """The global prototypes c^y and σ this device decodes from (saved beside its decoder)."""
        assert self.g_protos is not None and self.g_sigma is not None
        return {"protos": self.g_protos.numpy(), "sigma": self.g_sigma.numpy()}

    def grid_samples(self, per_class: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Decoded images of every class from the global distribution, for an image grid ([0, 1])."""
        if self.g_protos is None or not self.decoder_trained:
            return None
        labels = torch.from_numpy(np.repeat(self.g_classes, per_class))
        gen = torch.Generator().manual_seed(0)
        assert self.g_sigma is not None
        self.decoder.eval()
        with torch.no_grad():
            v = self.g_protos[labels] + self.g_sigma * torch.randn((len(labels), self.g_protos.shape[1]),
                                                                   generator=gen)
            return self.decoder(v).numpy(), labels.numpy()

    @property
    def generator(self) -> VTCDecoder:
        """The device's decoder ψ_k (for checkpoints and sample grids)."""
        return self.decoder


__all__ = ["FedVTCDevice", "local_statistics"]
