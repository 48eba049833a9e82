"""Torch modules of the generators, built from :class:`~fedge.common.generators.GeneratorSpec`.

Outputs live in the generator's own space: images in [0, 1] (sigmoid; the
device converts to and from the data set's normalization), extractor features
as non-negative maps (ReLU, like the stem's own ReLU + max-pool output).
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import torch
from torch import nn

from fedge.common.generators import DDPM_TRAIN_STEPS, GeneratorSpec, gn_groups
from fedge.edge.models.checkpoint import load_checkpoint, register_builder
from fedge.errors import CheckpointError


def one_hot(y: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) int labels -> (B, k) float one-hot."""
    return nn.functional.one_hot(y.long(), k).float()


def label_planes(y: torch.Tensor, k: int, side: int) -> torch.Tensor:
    """(B,) labels -> (B, k, side, side) constant one-hot planes (the conditioning of conv inputs)."""
    return one_hot(y, k)[:, :, None, None].expand(-1, -1, side, side)


class ConditionalGenerator(nn.Module):
    """A class-conditional generator: ``sample(labels)`` draws one output per label."""

    spec: GeneratorSpec

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__()
        self.spec = spec

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return self.spec.out_shape

    def _activate(self, t: torch.Tensor) -> torch.Tensor:
        # Images in [0, 1]; features non-negative (the stem ends in ReLU + max-pool).
        return torch.sigmoid(t) if self.spec.out_shape[0] == 1 else torch.relu(t)

    def sample(self, labels: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """(B,) labels -> (B, C, H, W) samples; all randomness drawn from ``gen``."""
        raise NotImplementedError

    def build_args(self) -> dict[str, Any]:
        """Arguments that rebuild this module (stored in checkpoints)."""
        return {"spec": self.spec.to_dict()}


class CVAE(ConditionalGenerator):
    """Conditional VAE (GeFL's CVAE; see :mod:`fedge.common.generators` for the layout)."""

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__(spec)
        chans = spec.cvae_channels()
        c_out, k = spec.out_shape[0], spec.num_classes
        enc: list[nn.Module] = []
        cin = c_out + k
        for ch in chans:
            enc += [nn.Conv2d(cin, ch, 4, 2, 1), nn.BatchNorm2d(ch), nn.ReLU(inplace=True)]
            cin = ch
        self.enc = nn.Sequential(*enc)  # (B, C+k, S, S) -> (B, top, 1, 1)
        self.mu = nn.Linear(chans[-1], spec.latent)
        self.logvar = nn.Linear(chans[-1], spec.latent)
        self.dec_in = nn.Linear(spec.latent + k, chans[-1])
        rev = chans[::-1]
        dec: list[nn.Module] = []
        for a, b in itertools.pairwise(rev):
            dec += [nn.ConvTranspose2d(a, b, 4, 2, 1), nn.BatchNorm2d(b), nn.ReLU(inplace=True)]
        dec.append(nn.ConvTranspose2d(rev[-1], c_out, 4, 2, 1))
        self.dec = nn.Sequential(*dec)  # (B, top, 1, 1) -> (B, C, S, S)

    def encode(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, S, S), (B,) -> mean and log-variance, each (B, latent)."""
        t = self.enc(torch.cat([x, label_planes(y, self.spec.num_classes, x.shape[-1])], dim=1)).flatten(1)
        return self.mu(t), self.logvar(t)

    def decode(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B, latent), (B,) -> (B, C, S, S)."""
        t = torch.relu(self.dec_in(torch.cat([z, one_hot(y, self.spec.num_classes)], dim=1)))
        return self._activate(self.dec(t[:, :, None, None]))

    def forward(self, x: torch.Tensor, y: torch.Tensor,
                gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstruction (B, C, S, S), mean and log-variance (B, latent)."""
        mu, logvar = self.encode(x, y)
        eps = torch.randn(mu.shape, generator=gen)
        return self.decode(mu + eps * torch.exp(0.5 * logvar), y), mu, logvar

    def sample(self, labels: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        z = torch.randn((len(labels), self.spec.latent), generator=gen)
        return self.decode(z, labels)


class _DCGANGenerator(nn.Module):
    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__()
        up = spec.up_channels()
        half = up[0] // 2
        self.z_in = nn.Sequential(nn.ConvTranspose2d(spec.latent, half, 4, 1, 0), nn.BatchNorm2d(half),
                                  nn.ReLU(inplace=True))  # (B, nz, 1, 1) -> (B, half, 4, 4)
        self.y_in = nn.Sequential(nn.ConvTranspose2d(spec.num_classes, half, 4, 1, 0), nn.BatchNorm2d(half),
                                  nn.ReLU(inplace=True))  # (B, k, 1, 1) -> (B, half, 4, 4)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(up):
            layers += [nn.ConvTranspose2d(a, b, 4, 2, 1), nn.BatchNorm2d(b), nn.ReLU(inplace=True)]
        layers.append(nn.ConvTranspose2d(up[-1], spec.out_shape[0], 4, 2, 1))
        self.up = nn.Sequential(*layers)  # (B, up0, 4, 4) -> (B, C, S, S)


class _DCGANDiscriminator(nn.Module):
    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__()
        down = spec.disc_channels()
        half = down[0] // 2
        self.x_in = nn.Sequential(nn.Conv2d(spec.out_shape[0], half, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True))
        self.y_in = nn.Sequential(nn.Conv2d(spec.num_classes, half, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True))
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(down):
            layers += [nn.Conv2d(a, b, 4, 2, 1), nn.BatchNorm2d(b), nn.LeakyReLU(0.2, inplace=True)]
        layers.append(nn.Conv2d(down[-1], 1, 4, 1, 0))  # (B, top, 4, 4) -> (B, 1, 1, 1): a logit
        self.down = nn.Sequential(*layers)


class ConditionalDCGAN(ConditionalGenerator):
    """Conditional DCGAN: ``gen`` and ``disc`` in one module, because GeFL averages both."""

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__(spec)
        self.gen = _DCGANGenerator(spec)
        self.disc = _DCGANDiscriminator(spec)
        # DCGAN initialisation (Radford et al. 2016; GeFL's weight_init(0, 0.02)).
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def generate(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B, nz), (B,) -> (B, C, S, S)."""
        h = torch.cat([self.gen.z_in(z[:, :, None, None]),
                       self.gen.y_in(one_hot(y, self.spec.num_classes)[:, :, None, None])], dim=1)
        return self._activate(self.gen.up(h))

    def discriminate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S), (B,) -> (B,) real/fake logits."""
        planes = label_planes(y, self.spec.num_classes, x.shape[-1])
        h = torch.cat([self.disc.x_in(x), self.disc.y_in(planes)], dim=1)
        return self.disc.down(h).flatten()

    def sample(self, labels: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        z = torch.randn((len(labels), self.spec.latent), generator=gen)
        return self.generate(z, labels)


def cosine_alpha_bar(steps: int) -> torch.Tensor:
    """ᾱ_t of the cosine noise schedule (Nichol & Dhariwal 2021), betas clipped at 0.999, (steps,)."""
    t = torch.linspace(0, steps, steps + 1, dtype=torch.float64) / steps
    f = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    ab = f[1:] / f[0]
    betas = (1 - ab / torch.cat([torch.ones(1, dtype=ab.dtype), ab[:-1]])).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).float()


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B,) integer steps -> (B, dim) sinusoidal embedding (Transformer / DDPM style)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / max(half, 1))
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=1)
    return nn.functional.pad(emb, (0, dim - 2 * half))


class _ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the time + class embedding added in between."""

    def __init__(self, cin: int, cout: int, emb: int) -> None:
        super().__init__()
        self.n1 = nn.GroupNorm(gn_groups(cin), cin)
        self.c1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.emb = nn.Linear(emb, cout)
        self.n2 = nn.GroupNorm(gn_groups(cout), cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip: nn.Module = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h = self.c1(nn.functional.silu(self.n1(x))) + self.emb(e)[:, :, None, None]
        return self.skip(x) + self.c2(nn.functional.silu(self.n2(h)))


class _RunningNorm(nn.Module):
    """Per-channel running mean and variance of the training data (like BN's, momentum 0.1).

    Buffers, not weights: they are uploaded and averaged with the generator exactly as BN
    statistics are, so every device maps samples back to the same scale.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(self, channels: int, momentum: float = 0.1) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        self.running_mean.lerp_(x.mean(dim=(0, 2, 3)), self.momentum)
        self.running_var.lerp_(x.var(dim=(0, 2, 3), unbiased=False), self.momentum)

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.running_mean[:, None, None], torch.sqrt(self.running_var + 1e-5)[:, None, None]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats()
        return (x - mean) / std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats()
        return x * std + mean


class ConditionalDDPM(ConditionalGenerator):
    """Class-conditional DDPM with classifier-free guidance (GeFL's DDPM, used as DDPM-F).

    Trained with the ε-prediction loss on the cosine schedule, the label replaced by the
    "no label" token with probability ``p_uncond`` (classifier-free guidance, Ho & Salimans
    2022). Sampled with deterministic DDIM over ``sample_steps`` evenly spaced steps and
    guidance weight ``guidance`` (GeFL's w: ε = (1 + w) ε(x, y) − w ε(x, ∅); 0 is purely
    conditional and needs one denoiser pass per step, any other value two). Both are
    sampling settings, not architecture: the device sets them from ``[method] ddpm_steps``
    and ``ddpm_guidance``.
    """

    alpha_bar: torch.Tensor

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__(spec)
        w, c, k = spec.base_width, spec.out_shape[0], spec.num_classes
        emb = 4 * w
        self.data_norm = _RunningNorm(c)
        self.t_mlp = nn.Sequential(nn.Linear(w, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.y_emb = nn.Embedding(k + 1, emb)
        # A learned map per class, fed in as extra input channels: convolutions are translation
        # equivariant, so a channel-wise embedding alone cannot say *where* a class's features are.
        self.y_map = nn.Embedding(k + 1, c * spec.side * spec.side)
        self.inc = nn.Conv2d(2 * c, w, 3, 1, 1)
        self.down = nn.Conv2d(w, 2 * w, 4, 2, 1)
        self.mid1 = _ResBlock(2 * w, 2 * w, emb)
        self.mid2 = _ResBlock(2 * w, 2 * w, emb)
        self.up = nn.ConvTranspose2d(2 * w, w, 4, 2, 1)
        self.out_block = _ResBlock(2 * w, w, emb)
        self.out_norm = nn.GroupNorm(gn_groups(w), w)
        self.out = nn.Conv2d(w, c, 3, 1, 1)
        self.register_buffer("alpha_bar", cosine_alpha_bar(DDPM_TRAIN_STEPS), persistent=False)
        self.p_uncond = 0.1
        self.sample_steps = 20
        self.guidance = 0.0

    def eps(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Predicted noise of ``x_t`` (B, C, S, S) at steps ``t`` (B,) for labels ``y`` (B,; k = none)."""
        e = self.t_mlp(timestep_embedding(t, self.spec.base_width)) + self.y_emb(y)
        h0 = self.inc(torch.cat([x_t, self.y_map(y).view_as(x_t)], dim=1))
        h = self.mid2(self.mid1(self.down(nn.functional.silu(h0)), e), e)
        h = self.out_block(torch.cat([self.up(h), h0], dim=1), e)
        return self.out(nn.functional.silu(self.out_norm(h)))

    def loss(self, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """The mean squared ε-prediction error on a batch (updates the running data statistics)."""
        self.data_norm.update(x)
        x0 = self.data_norm.normalize(x)
        t = torch.randint(0, len(self.alpha_bar), (len(x),), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        ab = self.alpha_bar[t][:, None, None, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        drop = torch.rand(len(x), generator=gen) < self.p_uncond
        y_in = torch.where(drop, torch.full_like(y, self.spec.num_classes), y.long())
        return nn.functional.mse_loss(self.eps(x_t, t, y_in), noise)

    @torch.no_grad()
    def sample(self, labels: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        n, steps = len(labels), max(1, self.sample_steps)
        ts = torch.linspace(len(self.alpha_bar) - 1, 0, steps).round().long()
        x = torch.randn((n, *self.spec.out_shape), generator=gen)
        x0 = x
        y, null = labels.long(), torch.full((n,), self.spec.num_classes, dtype=torch.long)
        for i, t in enumerate(ts):
            tt = t.expand(n)
            eps = self.eps(x, tt, y)
            if self.guidance:
                eps = (1 + self.guidance) * eps - self.guidance * self.eps(x, tt, null)
            ab = self.alpha_bar[t]
            ab_prev = self.alpha_bar[ts[i + 1]] if i + 1 < steps else torch.tensor(1.0)
            # Clipping x̂_0 keeps the few-step DDIM path from overshooting (the usual practice).
            x0 = ((x - (1 - ab).sqrt() * eps) / ab.sqrt()).clamp(-5.0, 5.0)
            x = ab_prev.sqrt() * x0 + (1 - ab_prev).sqrt() * eps
        out = self.data_norm.denormalize(x0)
        return out.clamp(0.0, 1.0) if self.spec.out_shape[0] == 1 else torch.relu(out)


class VTCDecoder(ConditionalGenerator):
    """FedVTC's decoder ψ: a latent v ∈ R^p (a feature-space point) -> an image.

    Not class-conditional by input: the class lives in where v is drawn from
    (v = c^y + σ ⊙ ε around the class prototype).
    """

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__(spec)
        up = spec.up_channels()
        self.top = up[0]
        self.dec_in = nn.Linear(spec.latent, up[0] * 16)  # (B, p) -> (B, top*4*4)
        self.dec_in_bn = nn.BatchNorm2d(up[0])
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(up):
            layers += [nn.ConvTranspose2d(a, b, 4, 2, 1), nn.BatchNorm2d(b), nn.ReLU(inplace=True)]
        layers.append(nn.ConvTranspose2d(up[-1], spec.out_shape[0], 4, 2, 1))
        self.dec = nn.Sequential(*layers)  # (B, top, 4, 4) -> (B, C, S, S)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """(B, p) -> (B, C, S, S) in [0, 1]."""
        t = torch.relu(self.dec_in_bn(self.dec_in(v).view(-1, self.top, 4, 4)))
        return self._activate(self.dec(t))

    def sample(self, labels: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        raise TypeError("a VTC decoder samples from latents: call it on v = c^y + σ ⊙ ε")


_KINDS: dict[str, type[ConditionalGenerator]] = {
    "cvae": CVAE, "dcgan": ConditionalDCGAN, "ddpm": ConditionalDDPM, "vtc": VTCDecoder}

GENERATOR_BUILDERS: frozenset[str] = frozenset(cls.__name__ for cls in _KINDS.values())
"""The checkpoint builder names of generators (a checkpoint's ``fedge.builder``), e.g. ``CVAE``."""


def build_generator(spec: GeneratorSpec | dict[str, Any], *, seed: int | None = None) -> ConditionalGenerator:
    """Build a generator from its spec; ``seed`` makes the initial weights reproducible."""
    s = spec if isinstance(spec, GeneratorSpec) else GeneratorSpec.from_dict(spec)
    if seed is None:
        return _KINDS[s.kind](s)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _KINDS[s.kind](s)


def _builder(cls: type[ConditionalGenerator]) -> Any:
    def build(spec: dict[str, Any]) -> ConditionalGenerator:
        s = GeneratorSpec.from_dict(spec)
        if _KINDS[s.kind] is not cls:
            raise ValueError(f"spec kind {s.kind!r} does not build a {cls.__name__}")
        return cls(s)

    return build


# Importing this module lets :func:`~fedge.edge.models.checkpoint.load_checkpoint` rebuild every
# generator class: generators sit above the checkpoint format, which knows nothing of them.
for _cls in _KINDS.values():
    register_builder(_cls.__name__, _builder(_cls))


def load_generator(path: str | os.PathLike[str], *, expect: GeneratorSpec | None = None) -> ConditionalGenerator:
    """Load a generator checkpoint; with ``expect``, refuse one of another kind, shape, tier or class count.

    The checkpoint loader already refuses weights that do not fit the stored
    architecture; this also catches a valid checkpoint of the *wrong* generator
    (say a 3×16×16 GeFL-F generator offered to an image-level GeFL device).
    """
    gen = load_checkpoint(path, expect=ConditionalGenerator)
    if expect is not None and gen.spec != expect:
        have, want = gen.spec, expect
        raise CheckpointError(
            f"{path} holds a {have.kind} generator for {have.out_shape} (tier {have.tier}, {have.num_classes} classes, "
            f"latent {have.latent}), but this device needs a {want.kind} generator for {want.out_shape} "
            f"(tier {want.tier}, {want.num_classes} classes, latent {want.latent})",
            hint="use a checkpoint saved by the same method, generator kind and generator_tier",
        )
    return gen
