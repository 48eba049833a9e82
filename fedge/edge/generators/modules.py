"""Torch modules of the generators, built from :class:`~fedge.edge.generators.spec.GeneratorSpec`.

Outputs live in the generator's own space: images in [0, 1] (sigmoid; the
device converts to and from the data set's normalization), extractor features
as non-negative maps (ReLU, like the stem's own ReLU + max-pool output).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from torch import nn

from fedge.edge.generators.spec import GeneratorSpec
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
    """Conditional VAE (GeFL's CVAE; see :mod:`fedge.edge.generators.spec` for the layout)."""

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


_KINDS: dict[str, type[ConditionalGenerator]] = {"cvae": CVAE, "dcgan": ConditionalDCGAN, "vtc": VTCDecoder}


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


def register_builders() -> None:
    """Let :func:`fedge.edge.models.checkpoint.load_checkpoint` rebuild every generator class."""
    from fedge.edge.models.checkpoint import register_builder

    for cls in _KINDS.values():
        register_builder(cls.__name__, _builder(cls))


def load_generator(path: str | os.PathLike[str], *, expect: GeneratorSpec | None = None) -> ConditionalGenerator:
    """Load a generator checkpoint; with ``expect``, refuse one of another kind, shape, tier or class count.

    The checkpoint loader already refuses weights that do not fit the stored
    architecture; this also catches a valid checkpoint of the *wrong* generator
    (say a 3×16×16 GeFL-F generator offered to an image-level GeFL device).
    """
    from fedge.edge.models.checkpoint import load_checkpoint

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
