"""The audio front end, inside the model: raw 16 kHz audio -> MFCCs, in ops that export to ONNX.

Keyword spotting networks read MFCCs, not samples (MLPerf Tiny's DS-CNN reads 49 frames x 10
coefficients). Computing them in the data loader would leave the device to compute them again, with
another library, before every inference; a difference between the two is a silent accuracy loss. So
the front end is a module of the network (the first part of its ``extractor``) and is exported with
it: ``fedge infer clip.wav`` feeds samples to ONNX Runtime and the graph does the rest, exactly as
training did. It is built from ops every ONNX runtime has (opset 17's ``STFT`` and ``MelWeightMatrix``
are newer and its ``MelWeightMatrix`` snaps filter edges to whole DFT bins):

1. framing, window and DFT in one strided ``Conv1d``: kernel ``k`` of output channel ``f`` is
   ``w[t] cos(2 pi f t / n)`` (real part) or ``-w[t] sin(2 pi f t / n)`` (imaginary part), ``w`` a
   periodic Hann window of ``window`` samples, stride ``hop``: (N, 1, T) -> (N, 2F, frames);
2. the power spectrum ``re^2 + im^2``: (N, F, frames);
3. the mel filterbank as a ``MatMul``: (N, frames, F) @ (F, mels);
4. ``log(mel + floor)``;
5. the DCT-II (orthonormal) as a ``MatMul``: (N, frames, mels) @ (mels, coefficients).

The output is (N, 1, frames, coefficients): the (C, H, W) input of the DS-CNN's first convolution.
Only DFT bins up to the filterbank's upper edge are computed (bins above it have zero mel weight), which
halves the front end's cost at MLPerf Tiny's 4 kHz. The constant matrices are non-persistent buffers:
not parameters (never trained, averaged or uploaded), not in checkpoints (rebuilt from the settings),
but in the exported graph as initializers.

The filterbank is the HTK one that TensorFlow's ``linear_to_mel_weight_matrix`` (the MLPerf Tiny
reference front end) builds: mel(f) = 1127 ln(1 + f/700), ``mels`` triangles whose edges are equally
spaced in mel between ``f_min`` and ``f_max``, each DFT bin weighted by where its frequency falls on the
triangle (peak 1 at the centre), the DC bin weighted 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class MfccSettings:
    """The front end's settings; the defaults are MLPerf Tiny's keyword spotting (49 x 10 MFCCs from 1 s)."""

    sample_rate: int = 16_000
    window: int = 640  # 40 ms
    hop: int = 320  # 20 ms
    mels: int = 40
    coefficients: int = 10
    f_min: float = 20.0
    f_max: float = 4000.0
    floor: float = 1e-6  # added to the mel energies before the log: silence gives log(floor), not -inf

    def frames(self, samples: int) -> int:
        """Frames of a clip of ``samples`` samples (no padding: the last partial frame is dropped)."""
        return 1 + (samples - self.window) // self.hop

    @property
    def bins(self) -> int:
        """DFT bins computed: 0 .. the last bin at or below ``f_max`` (the rest have zero mel weight)."""
        return min(self.window // 2, math.floor(self.f_max * self.window / self.sample_rate)) + 1


DEFAULT_MFCC = MfccSettings()


def hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    """HTK mel scale: 1127 ln(1 + f / 700)."""
    return 1127.0 * np.log1p(np.asarray(f, dtype=np.float64) / 700.0)


def mel_filterbank(s: MfccSettings = DEFAULT_MFCC) -> np.ndarray:
    """(bins, mels) triangular weights: column m rises from edge m to 1 at edge m+1 and falls to 0 at edge m+2,
    the ``mels + 2`` edges equally spaced in mel over [f_min, f_max]; bin k sits at k * rate / window Hz."""
    edges = np.linspace(hz_to_mel(s.f_min), hz_to_mel(s.f_max), s.mels + 2)
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]  # (mels,) each
    bin_mel = hz_to_mel(np.arange(s.bins) * s.sample_rate / s.window)[:, None]  # (bins, 1)
    rising = (bin_mel - lower) / (centre - lower)
    falling = (upper - bin_mel) / (upper - centre)
    w = np.maximum(0.0, np.minimum(rising, falling))
    w[0] = 0.0  # DC carries no speech (TensorFlow drops it too)
    return w


def dct_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_in, n_out) orthonormal DCT-II: ``x @ D`` equals ``scipy.fft.dct(x, type=2, norm="ortho")[:n_out]``."""
    n = np.arange(n_in)[:, None]
    k = np.arange(n_out)[None, :]
    d = np.cos(math.pi * (2 * n + 1) * k / (2 * n_in)) * math.sqrt(2.0 / n_in)
    d[:, 0] /= math.sqrt(2.0)
    return d


def dft_kernels(s: MfccSettings = DEFAULT_MFCC) -> np.ndarray:
    """(2 * bins, 1, window) conv kernels: the periodic-Hann-windowed real, then imaginary, DFT rows."""
    t = np.arange(s.window)
    hann = 0.5 - 0.5 * np.cos(2 * math.pi * t / s.window)
    angle = 2 * math.pi * np.arange(s.bins)[:, None] * t[None, :] / s.window  # (bins, window)
    return np.concatenate([hann * np.cos(angle), -hann * np.sin(angle)])[:, None, :]


class Mfcc(nn.Module):
    """Raw audio (N, 1, samples) in [-1, 1] -> MFCCs (N, 1, frames, coefficients), exportable to ONNX."""

    dft: torch.Tensor  # (2 * bins, 1, window)
    mel: torch.Tensor  # (bins, mels)
    dct: torch.Tensor  # (mels, coefficients)

    def __init__(self, samples: int, settings: MfccSettings = DEFAULT_MFCC) -> None:
        super().__init__()
        if samples < settings.window:
            raise ValueError(f"a clip of {samples} samples is shorter than one {settings.window}-sample frame")
        self.settings = settings
        self.samples = samples
        self.register_buffer("dft", torch.from_numpy(dft_kernels(settings)).float(), persistent=False)
        self.register_buffer("mel", torch.from_numpy(mel_filterbank(settings)).float(), persistent=False)
        self.register_buffer("dct", torch.from_numpy(dct_matrix(settings.mels, settings.coefficients)).float(),
                             persistent=False)
        s = settings
        frames, bins = s.frames(samples), s.bins
        # what fedge.edge.models.measure counts for this module (it has no Conv/Linear children)
        self.macs_per_sample = frames * (2 * bins * s.window + 2 * bins + bins * s.mels + s.mels * s.coefficients)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """(1, frames, coefficients) of one clip."""
        return (1, self.settings.frames(self.samples), self.settings.coefficients)

    def log_mel(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, samples) -> log mel energies (N, frames, mels)."""
        spec = nn.functional.conv1d(x, self.dft, stride=self.settings.hop)  # (N, 2 * bins, frames)
        re, im = spec.chunk(2, dim=1)
        power = (re * re + im * im).transpose(1, 2)  # (N, frames, bins)
        return torch.log(power @ self.mel + self.settings.floor)  # (N, frames, mels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.log_mel(x) @ self.dct).unsqueeze(1)  # (N, 1, frames, coefficients)


class CoefficientNorm(nn.Module):
    """BatchNorm over the coefficient axis of (N, 1, frames, coefficients) MFCCs: one mean and scale per coefficient.

    MFCCs differ in scale by an order of magnitude (c0, the log energy, spans tens; the higher coefficients
    units), and the stem's first convolution mixes them in one input channel, so without this the loudness
    term dominates its first steps. Learned like any BatchNorm (trained, averaged with the stem, folded into
    a Mul and an Add in the exported graph)."""

    def __init__(self, coefficients: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(coefficients)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 3)).transpose(1, 3)  # (N, C, F, 1) normalized per coefficient, and back
