"""Differential privacy on uploaded statistics: the ``[privacy]`` settings, the mechanism, the accountant.

Both halves read this module: a device clips and noises its statistics before they
leave it (:func:`privatize`), the coordinator accounts for what was released
(:class:`PrivacyLedger`). Numpy only; the accountant is Google's ``dp-accounting``
(its RDP accountant), imported when ε is computed (the ``privacy`` extra).

The mechanism, per device and round: every uploaded statistic vector — each class
prototype c_k^y (one row of ``protos``) and FedVTC's σ_k — is clipped to L2 norm
``clip`` (σ: ``sigma_clip``), then Gaussian noise N(0, (z · 2 · clip)² I) is added,
z the ``noise_multiplier``. Two uploads are *neighbours* when one clipped vector is
replaced by any other (a device's whole contribution to that statistic changes:
its L2 sensitivity is 2 · clip), so each vector is a Gaussian mechanism of noise
multiplier z, and a round that releases K vectors is K of them, composed.
What is *not* noised: the class counts (the coordinator weighs prototypes by
them), the model's metrics, and whatever the method uploads besides the listed
statistics (see docs/privacy.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from fedge.errors import ConfigError

log = logging.getLogger(__name__)

# Upload arrays that carry statistics, and how they are clipped: "rows" clips every row to ``clip``,
# "vector" clips the whole array (flattened) to ``sigma_clip``; non-negative ones are clamped at 0
# after the noise (post-processing, free under DP).
STAT_ARRAYS: dict[str, tuple[Literal["rows", "vector"], bool]] = {
    "protos": ("rows", False),
    "sigma": ("vector", True),
}


@dataclass(frozen=True)
class PrivacySettings:
    """The fleet config's ``[privacy]`` table (absent: no clipping, no noise).

    Set either ``noise_multiplier`` (z; ε follows from it) or ``epsilon`` (the
    total ε of the run at ``delta``; z is calibrated so the run's rounds spend it).
    """

    noise_multiplier: float | None = None
    epsilon: float | None = None
    delta: float = 1e-5
    # Defaults from FedVTC/FedProto on digits (64 features): prototype norms 3-8, ‖σ‖ about 0.6-1.4.
    clip: float = 5.0
    sigma_clip: float = 1.0
    budget: float | None = None
    on_budget: Literal["stop", "warn"] = "stop"
    # Secure aggregation (fedge.secagg, docs/security.md#secure-aggregation): the coordinator learns only each
    # group's sum. 0 for threshold, neighbours and field_bits: chosen from each group's size.
    secure_aggregation: bool = False
    threshold: int = 0  # shares that recover a device's secrets (0: a majority of its neighbours + itself)
    neighbours: int = 0  # per device (0: 8 ⌈log2 n⌉, capped at n − 1)
    clipping_range: float = 8.0  # every summed value is clipped to [-clipping_range, clipping_range] on the device
    field_bits: int = 0  # the sum is taken mod 2^field_bits (0: 32 or 64, from the group size)

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None and self.epsilon is not None:
            raise ConfigError("[privacy] set noise_multiplier or epsilon, not both",
                              hint="epsilon = total ε of the run (z is calibrated); noise_multiplier = z (ε follows)")
        if self.noise_multiplier is not None and not (math.isfinite(self.noise_multiplier)
                                                      and self.noise_multiplier >= 0):
            raise ConfigError(f"[privacy] noise_multiplier must be a finite number >= 0, got {self.noise_multiplier}",
                              hint="noise std = noise_multiplier × 2 × clip; 0 clips without noise (ε = ∞)")
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ConfigError(f"[privacy] epsilon must be a finite number > 0, got {self.epsilon}",
                              hint="for no privacy leave [privacy] out; typical values are 1 to 16")
        if not (0 < self.delta < 1):
            raise ConfigError(f"[privacy] delta must be in (0, 1), got {self.delta}",
                              hint="use a δ well below 1 / (samples per device), e.g. 1e-5")
        for key in ("clip", "sigma_clip"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"[privacy] {key} must be a finite number > 0, got {v}",
                                  hint="the L2 bound of each uploaded vector (see docs/privacy.md for typical norms)")
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget > 0):
            raise ConfigError(f"[privacy] budget must be a finite number > 0, got {self.budget}")
        for key in ("threshold", "neighbours"):
            if getattr(self, key) < 0:
                raise ConfigError(f"[privacy] {key} must be >= 0 (0: chosen from the group size), "
                                  f"got {getattr(self, key)}")
        if self.threshold == 1:
            raise ConfigError("[privacy] threshold = 1 would let any one share reveal a device's secrets",
                              hint="use 0 (a majority of each neighbourhood) or at least 2")
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ConfigError(f"[privacy] clipping_range must be a finite number > 0, got {self.clipping_range}",
                              hint="each summed value is clipped to ±clipping_range on the device; the default is 8")
        if self.field_bits != 0 and not 16 <= self.field_bits <= 64:
            raise ConfigError(f"[privacy] field_bits must be 0 (chosen from the group size) or in [16, 64], "
                              f"got {self.field_bits}")

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier is not None or self.epsilon is not None

    def mechanism(self, *, stats: tuple[str, ...], num_classes: int, rounds: int) -> Mechanism:
        """The mechanism a run uses: z given or calibrated for ``rounds`` rounds of ``stats`` uploads."""
        releases = sum(num_classes if STAT_ARRAYS[s][0] == "rows" else 1 for s in stats)
        if releases == 0:
            raise ConfigError("[privacy] this method uploads no statistics that fedge can noise",
                              hint="use it with fedproto or fedvtc, or leave [privacy] out")
        z = self.noise_multiplier
        if z is None:
            assert self.epsilon is not None
            z = calibrate_noise(self.epsilon, self.delta, releases * rounds)
        budget = self.budget if self.budget is not None else self.epsilon
        return Mechanism(noise_multiplier=z, delta=self.delta, clip=self.clip, sigma_clip=self.sigma_clip,
                         releases_per_round=releases, stats=stats, budget=budget, on_budget=self.on_budget)


@dataclass(frozen=True)
class Mechanism:
    """The resolved mechanism both halves apply and account for."""

    noise_multiplier: float
    delta: float
    clip: float
    sigma_clip: float
    releases_per_round: int  # statistic vectors one device releases per round (K)
    stats: tuple[str, ...]
    budget: float | None = None
    on_budget: str = "stop"

    def noise_std(self, name: str) -> float:
        """Standard deviation of the noise on each coordinate of upload ``name``: z · 2 · its clip."""
        bound = self.clip if STAT_ARRAYS[name][0] == "rows" else self.sigma_clip
        return self.noise_multiplier * 2.0 * bound

    def epsilon(self, rounds: int) -> float:
        """ε at ``delta`` after ``rounds`` rounds of releases (RDP accountant of dp-accounting)."""
        return epsilon_for(self.noise_multiplier, self.delta, self.releases_per_round * rounds)

    def to_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "delta": self.delta, "clip": self.clip,
                "sigma_clip": self.sigma_clip, "releases_per_round": self.releases_per_round,
                "stats": list(self.stats), "budget": self.budget, "on_budget": self.on_budget}


def clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    """Scale every row of ``x`` (2-D) whose L2 norm exceeds ``bound`` down to norm ``bound``."""
    x = np.where(np.isfinite(x), x, 0.0)  # a diverged model's inf/NaN must not turn into NaN after scaling
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, bound / np.maximum(norms, 1e-12))


def privatize(arrays: dict[str, np.ndarray], mech: Mechanism, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Clip and noise the statistics in an upload (other arrays pass unchanged); runs on the device."""
    out = dict(arrays)
    for name in mech.stats:
        if name not in arrays:
            continue
        x = np.asarray(arrays[name], dtype=np.float64)
        kind, nonneg = STAT_ARRAYS[name]
        if kind == "rows":
            clipped = clip_rows(x.reshape(len(x), -1), mech.clip).reshape(x.shape)
        else:
            clipped = clip_rows(x.reshape(1, -1), mech.sigma_clip).reshape(x.shape)
        noised = clipped + rng.normal(0.0, mech.noise_std(name), size=x.shape) if mech.noise_multiplier else clipped
        if nonneg:
            noised = np.maximum(noised, 0.0)
        out[name] = noised.astype(np.asarray(arrays[name]).dtype)
    return out


def project_global(artifacts: dict[str, dict[str, np.ndarray]], mech: Mechanism) -> dict[str, dict[str, np.ndarray]]:
    """Clip the *received* global statistics back into the bounds every upload had (runs on the device).

    Every true contribution lies within the clip, so their average does too; the noise does not. Projecting
    the noised average back onto the ball is post-processing (free under DP) and keeps a method's losses
    toward the global prototypes bounded: without it, a noise norm 100× the prototypes' makes FedProto's
    λ‖g(x) − c_y‖² diverge on the device.
    """
    out = {}
    for name, arrays in artifacts.items():
        arrays = dict(arrays)
        for key, (kind, _) in STAT_ARRAYS.items():
            if key in arrays and key in mech.stats:
                x = np.asarray(arrays[key], dtype=np.float64)
                bound = mech.clip if kind == "rows" else mech.sigma_clip
                flat = x.reshape(len(x), -1) if kind == "rows" else x.reshape(1, -1)
                arrays[key] = clip_rows(flat, bound).reshape(x.shape).astype(np.asarray(arrays[key]).dtype)
        out[name] = arrays
    return out


@lru_cache(maxsize=256)
def epsilon_for(noise_multiplier: float, delta: float, count: int) -> float:
    """ε of ``count`` composed Gaussian mechanisms of noise multiplier z, at δ (dp-accounting's RDP accountant)."""
    if count <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier), count)
    return float(acc.get_epsilon(delta))


@lru_cache(maxsize=64)
def calibrate_noise(epsilon: float, delta: float, count: int) -> float:
    """The smallest z whose ``count`` composed Gaussian mechanisms spend at most ``epsilon`` at ``delta``."""
    lo, hi = 1e-3, 1.0
    while epsilon_for(hi, delta, count) > epsilon:
        hi *= 2
        if hi > 1e6:
            raise ConfigError(f"[privacy] epsilon = {epsilon} cannot be reached in {count} releases")
    for _ in range(60):  # bisection on a monotone function: ~1e-6 relative precision
        mid = (lo + hi) / 2
        if epsilon_for(mid, delta, count) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


class PrivacyLedger:
    """The coordinator's account of what the fleet released: ε per round and cumulative, the budget.

    Conservative: every training round counts for every device (a device that
    missed a round spent less), so the figure is restart-safe without extra state.
    """

    def __init__(self, mech: Mechanism) -> None:
        self.mech = mech

    def entry(self, training_rounds: int) -> dict[str, Any]:
        """The report entry after ``training_rounds`` rounds of releases."""
        eps = self.mech.epsilon(training_rounds)
        return {"epsilon": eps, "epsilon_round": self.mech.epsilon(1), "delta": self.mech.delta,
                "noise_multiplier": self.mech.noise_multiplier,
                "budget_spent": self.mech.budget is not None and eps > self.mech.budget + 1e-9}

    def allows(self, training_rounds: int) -> bool:
        """Whether ``training_rounds`` rounds stay within the budget (no budget: always)."""
        b = self.mech.budget
        return b is None or self.mech.epsilon(training_rounds) <= b + 1e-9
