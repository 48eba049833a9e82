"""The device speed model: how many training multiply-accumulates per second a profile's CPU reaches.

One model, read by the planner (:func:`fedge.profiles.planner.round_time_s`), the emulation's CPU
quotas (:mod:`fedge.emulate.limits`) and the simulator's virtual clock (:mod:`fedge.fleet.clock`)::

    rate(model, batch) = cores × clock × mac_per_cycle(µarch) × fraction(model size, batch, SIMD width)

* ``mac_per_cycle`` — what one core of the microarchitecture sustains on a large fp32 matrix product,
  in multiply-accumulates per cycle. Taken from **published HPL (Linpack) results**: HPL's fp64 GFLOPS ÷
  (cores × GHz) is fp64 FLOP per cycle per core; fp32 vectors hold twice the lanes and a MAC is two
  FLOP, so the same figure is fp32 MACs per cycle. Each entry of :data:`UARCHES` names its source.
* ``fraction`` — how much of that GEMM rate training the zoo's small CNNs reaches: small layers leave
  SIMD lanes and caches idle, and larger batches amortize per-layer overheads. **Measured on this
  project's host** for each SIMD width, with torch's kernels limited to that width
  (``python -m benchmarks.clock curve``; table :data:`SIZE_CURVE`), interpolated over the model's
  forward MACs per sample and the batch.
* A profile's ``[measured] train_gmac_s`` (``fedge profile probe`` on the real device)
  overrides both: a measured (tier, batch) is used as is, and the nearest measured point rescales the
  model everywhere else.

No torch here (the planner stays torch-free): only :mod:`fedge.common.archs` sizes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from fedge.common.archs import TIERS, tier_arch
from fedge.common.families import ModelSpec
from fedge.profiles.schema import Profile
from fedge.profiles.uarch import Uarch, uarch_of

# Training costs ~3 forward passes (forward, input gradients, weight gradients).
TRAIN_MACS_FACTOR = 3

# The per-round work that does not grow with the samples — decoding and applying the global state, building the
# optimizer and the loader, encoding the update — in multiply-accumulate equivalents per model parameter, charged at
# the device's training rate for its model (so a device k times slower takes k times longer, as with its training).
# Measured on this project's host, each profile's device deployed alone without a quota and without evaluation
# (`python -m benchmarks.clock deployed --eval-every 100`, benchmarks/results/clock-deployed-f0.3-e100-ep2.json,
# 2026-12-03): CPU per round beyond the clock's training (the difference between a 12-round and a 2-round run) was
# 0.019 host CPU-s for the x86 gateway and 0.018 s for the Pi 4 (both tier-xl, 388,846 parameters, at 46.9 and
# 45.7 host GMAC/s) = 8.9e8 and 8.2e8 MAC equivalents, 2,200 per parameter; the Pi Zero 2 W's tier-s (17,294
# parameters) measured -0.004 s, where this predicts 0.003 s (the measurement's noise is ~0.01 s). Per parameter is
# an assumption: decoding, applying and encoding the state are per-parameter work, and so is the optimizer's state.
# A profile's `[measured] round_fixed_s` (seconds on the real device) replaces it.
ROUND_FIXED_MACS_PER_PARAM = 2200.0

# Fraction of the GEMM rate that training reaches: SIMD fp32 lanes -> tier -> {batch: fraction}.
# Median of 3 runs of `python -m benchmarks.clock curve` on this project's 2-core Intel Xeon host (one
# thread, CPU time, torch's kernels limited to the width; benchmarks/results/clock-curve.json, 2026-12-02). Each row
# is made non-decreasing in the batch (a larger batch never trains slower per MAC), which keeps the
# planner monotone: a device with more memory, and so a larger batch, never gets a slower estimate.
_MEASURED_CURVE: dict[int, dict[str, tuple[float, float, float, float]]] = {
    4: {"xs": (0.086, 0.105, 0.127, 0.144), "s": (0.169, 0.212, 0.259, 0.258), "m": (0.315, 0.319, 0.340, 0.347),
        "l": (0.409, 0.428, 0.494, 0.575), "xl": (0.600, 0.586, 0.572, 0.580)},
    8: {"xs": (0.030, 0.049, 0.062, 0.059), "s": (0.080, 0.107, 0.135, 0.134), "m": (0.190, 0.237, 0.310, 0.279),
        "l": (0.335, 0.429, 0.433, 0.438), "xl": (0.489, 0.433, 0.459, 0.510)},
}
CURVE_BATCHES: tuple[int, ...] = (8, 16, 32, 64)


def _monotone(row: tuple[float, ...]) -> tuple[float, ...]:
    out, best = [], 0.0
    for x in row:
        best = max(best, x)
        out.append(best)
    return tuple(out)


SIZE_CURVE: Mapping[int, Mapping[str, tuple[float, ...]]] = MappingProxyType(
    {lanes: MappingProxyType({t: _monotone(r) for t, r in rows.items()}) for lanes, rows in _MEASURED_CURVE.items()})


def interp_clamped(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear in ``x`` through (xs, ys), constant beyond the ends (xs ascending)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def size_fraction(macs: int, batch: int, lanes: int) -> float:
    """Fraction of the GEMM rate training reaches for a model of ``macs`` forward MACs per sample.

    Interpolated linearly in log2(batch) between the measured batches, then linearly in log(MACs)
    between the tiers; outside the measured range the nearest end holds.
    """
    rows = SIZE_CURVE[min(SIZE_CURVE, key=lambda w: (abs(math.log2(w / lanes)), w))]
    lb = [math.log2(b) for b in CURVE_BATCHES]
    by_tier = sorted((tier_arch(t).macs(), t) for t in TIERS)
    xs = [math.log(m) for m, _ in by_tier]
    ys = [interp_clamped(math.log2(max(batch, 1)), lb, list(rows[t])) for _, t in by_tier]
    return interp_clamped(math.log(max(macs, 1)), xs, ys)


def _measured_key(key: str) -> tuple[str, int]:
    tier, _, batch = key.partition("@")
    return tier, int(batch)


@dataclass(frozen=True)
class SpeedModel:
    """A profile's training speed: :meth:`mac_rate` for a model and batch, :meth:`train_seconds` for a round."""

    profile: str
    cores: int
    clock_ghz: float
    uarch: Uarch
    found: str
    """How the microarchitecture was found (for reasons and docs)."""
    measured: Mapping[str, float] = field(default_factory=dict)
    """``"tier-<t>@<batch>"`` -> training GMAC/s on all cores, from the real device."""
    fixed_s: float | None = None
    """``[measured] round_fixed_s``: the per-round fixed seconds measured on the device (None: the model's)."""

    @property
    def peak_mac_rate(self) -> float:
        """GEMM-level MAC/s of all cores: what the size curve is a fraction of."""
        return self.cores * self.clock_ghz * 1e9 * self.uarch.mac_per_cycle

    def model_rate(self, macs: int, batch: int) -> float:
        """The model's training MAC/s for a network of ``macs`` forward MACs per sample (no measurements)."""
        return self.peak_mac_rate * size_fraction(macs, batch, self.uarch.lanes)

    def mac_rate(self, spec: ModelSpec, batch: int) -> float:
        """Training MAC/s of ``spec`` at ``batch`` on all of the device's cores."""
        macs = spec.macs()
        model = self.model_rate(macs, batch)
        if not self.measured:
            return model
        exact = self.measured.get(f"{spec.name}@{batch}")
        if exact is not None:
            return exact * 1e9
        # The nearest measured point (by log MACs, then log batch) tells how far the model is off here.
        def distance(key: str) -> tuple[float, float]:
            tier, b = _measured_key(key)
            return abs(math.log(tier_arch(tier.removeprefix("tier-")).macs() / macs)), abs(math.log2(b / batch))

        key = min(sorted(self.measured), key=distance)
        tier, b = _measured_key(key)
        ref = self.model_rate(tier_arch(tier.removeprefix("tier-")).macs(), b)
        return model * self.measured[key] * 1e9 / ref

    def round_fixed_s(self, spec: ModelSpec, batch: int) -> float:
        """Seconds of a round's work that does not grow with the samples (applying the global state, the optimizer's
        set-up, encoding the update): :data:`ROUND_FIXED_MACS_PER_PARAM` × parameters ÷ :meth:`mac_rate`, or the
        profile's ``[measured] round_fixed_s``."""
        if self.fixed_s is not None:
            return self.fixed_s
        return ROUND_FIXED_MACS_PER_PARAM * spec.num_params() / self.mac_rate(spec, batch)

    def epoch_seconds(self, spec: ModelSpec, batch: int, *, samples: int) -> float:
        """Seconds of one epoch over ``samples``: ``3 × MACs × samples ÷`` :meth:`mac_rate`."""
        return TRAIN_MACS_FACTOR * spec.macs() * samples / self.mac_rate(spec, batch)

    def train_seconds(self, spec: ModelSpec, batch: int, *, samples: int, epochs: int) -> float:
        """Seconds of a round's local training: ``epochs ×`` :meth:`epoch_seconds` ``+`` :meth:`round_fixed_s`."""
        return epochs * self.epoch_seconds(spec, batch, samples=samples) + self.round_fixed_s(spec, batch)

    def describe(self) -> str:
        """One line: the figures the model multiplies."""
        m = " with [measured] training rates" if self.measured else ""
        return (f"{self.cores} x {self.clock_ghz:g} GHz {self.uarch.name} ({self.found}) at "
                f"{self.uarch.mac_per_cycle:g} MAC/cycle on large GEMMs, x the {self.uarch.lanes}-lane size curve{m}")


def speed_model(profile: Profile) -> SpeedModel:
    """The :class:`SpeedModel` of ``profile``."""
    hw = profile.hardware
    uarch, found = uarch_of(hw.arch, hw.cpu, hw.uarch)
    measured = dict(profile.measured.train_gmac_s) if profile.measured is not None else {}
    fixed = profile.measured.round_fixed_s if profile.measured is not None else None
    return SpeedModel(profile.name, hw.cores, hw.clock_ghz, uarch, found, MappingProxyType(measured), fixed)
