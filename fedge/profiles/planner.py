"""The planner: a device profile in, a plan out — every choice with a one-line reason.

The rules are deliberately simple so that a reason can explain them
(``docs/profiles.md`` states them with their thresholds):

* **model tier**: among the tiers of :data:`fedge.common.archs.TIERS` whose
  training-memory estimate fits ``budgets.train_memory_mb`` at some batch size
  (the batch halves from 64 down to 8 before the tier drops), the one that
  reaches the most expected accuracy within the run's time budget
  (:mod:`fedge.profiles.tier_choice`: the speed model's time, the task's measured
  accuracy curves, the device's sample count; local epochs drop, down to 1, for
  a tier whose 5 epochs miss a synchronous round's share). The plan's ``trade``
  says what that cost against the largest tier memory holds.
* **inference quantization**: from measured latencies when the profile has
  them; otherwise from int8 dot-product support and accelerators (fp16 only for
  an accelerator whose ONNX Runtime provider runs it natively).
* **upload precision**: from uplink bandwidth thresholds.
* **generator tier**: the largest generator whose training-memory estimate fits.

Every input of the generator choice is monotone (more memory never shrinks a
feasible set), so a device that dominates another never gets a smaller
generator: a test checks it.

No torch here: sizes come from :mod:`fedge.common.archs`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fedge.common.archs import DEFAULT_EMBED_DIM, TIERS, tier_arch
from fedge.common.families import ModelSpec
from fedge.common.lrschedule import COSINE, COSINE_FLOOR
from fedge.errors import ProfileError
from fedge.profiles.accuracy import load_curves
from fedge.profiles.schema import INFERENCE_QUANTS, Profile
from fedge.profiles.speed import TRAIN_MACS_FACTOR as TRAIN_MACS_FACTOR  # re-exported: the training cost
from fedge.profiles.speed import SpeedModel, speed_model
from fedge.profiles.tier_choice import (
    ACCURACY_TOLERANCE,
    MAX_EPOCHS,
    RunBudget,
    Trade,
    choose_tier,
    describe,
    tier_options,
)

MIB = 2**20

# -- training memory -----------------------------------------------------------
BYTES_PER_VALUE = 4  # fp32 training
# weights + gradients + one optimizer buffer (SGD momentum). GeFL's target nets use
# plain SGD (no buffer); counting one keeps the estimate valid with momentum.
WEIGHT_COPIES = 3
# Activations saved in the forward pass, plus their gradients during backward.
ACTIVATION_COPIES = 2
# Fixed cost of the first backward pass beyond the tensors above (autograd
# engine, conv workspaces, allocator slack): the process RSS grows by ~20-25 MiB
# even at batch 8 for every tier (torch 2.14, x86_64; see docs/profiles.md).
WORKSPACE_MB = 24.0

DEFAULT_BATCH = 64  # GeFL trains its target nets at batch 64
MIN_BATCH = 8  # below this BatchNorm statistics get too noisy to be worth the bigger model
PROTOCOL_LR = 0.1  # GeFL's SGD learning rate (600 images a device, batch 64): the published configs set it
DEFAULT_LR = 0.1  # a device's first-round rate (issue 45), annealed by DEFAULT_LR_SCHEDULE
DEFAULT_LR_SCHEDULE = COSINE  # issue 45: constant PROTOCOL_LR oscillates on small, label-skewed shares to the end

# -- round time ----------------------------------------------------------------
# The device's training speed is fedge.profiles.speed's model (per-microarchitecture efficiency x
# a size curve measured per SIMD width, or the profile's [measured] training rates).
DEFAULT_SAMPLES = 600  # GeFL: 10 % of (F)MNIST over 10 clients

# -- inference and upload ------------------------------------------------------
MAX_ACCURACY_DROP = 1.0  # percentage points a quantization level may lose against fp32
UPLINK_FP32_KBPS = 10_000  # >= 10 Mbit/s: the full-precision update is cheap
UPLINK_FP16_KBPS = 1_000  # 1-10 Mbit/s: halve it; below 1 Mbit/s: quarter it (int8)
UPLOAD_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}
# fp16 pays only where an ONNX Runtime execution provider runs it natively: accelerator ->
# the providers that do (fedge.runtime.providers uses them first when available). ONNX
# Runtime has no OpenCL provider, and its CPU provider runs fp16 graphs through casts,
# no faster than fp32 (measured: jetson-nano's fp16 plan on the CPU provider, 0.212 vs 0.210 ms).
FP16_PROVIDERS = {"cuda-fp16": ("TensorrtExecutionProvider", "CUDAExecutionProvider")}


# -- generators ----------------------------------------------------------------
@dataclass(frozen=True)
class GeneratorAllowance:
    """What the largest generator of a tier needs (:mod:`fedge.common.generators` describes them)."""

    params: int
    activation_elems: int
    """Activation elements kept for backward per sample (parameters excluded)."""
    what: str


# The largest generator of each tier over every kind (CVAE, DCGAN, DDPM-F, VTC) and level
# (1x32x32 images, 3x16x16 features), rounded up: parameters from the CVAE on images,
# saved activations from the DCGAN on images (generator and discriminator). A test
# recomputes both from the real generators, so the allowance cannot fall behind.
GENERATOR_ALLOWANCES: dict[str, GeneratorAllowance] = {
    "tiny": GeneratorAllowance(360_000, 32_000, "1/8-width generators"),
    "small": GeneratorAllowance(1_420_000, 64_000, "1/4-width generators"),
    "paper": GeneratorAllowance(22_400_000, 250_000, "the published GeFL sizes (CVAE ~22 M params)"),
}
GENERATOR_COPIES = 4  # Adam: weights, gradients, first and second moments
GENERATOR_BATCH = 64


def train_memory_mb(spec: ModelSpec, batch_size: int) -> float:
    """Estimated peak memory of training ``spec`` at ``batch_size``, MiB.

    ``params × 4 B × 3`` (weights, gradients, optimizer buffer)
    ``+ activation_elems × batch × 4 B × 2`` (saved activations and their gradients)
    ``+`` :data:`WORKSPACE_MB`.
    """
    tensors = (spec.num_params() * BYTES_PER_VALUE * WEIGHT_COPIES
               + spec.activation_elems() * batch_size * BYTES_PER_VALUE * ACTIVATION_COPIES)
    return tensors / MIB + WORKSPACE_MB


def generator_memory_mb(tier: str) -> float:
    """Estimated peak memory of training generator tier ``tier`` (Adam, batch 64), MiB."""
    g = GENERATOR_ALLOWANCES[tier]
    tensors = (g.params * BYTES_PER_VALUE * GENERATOR_COPIES
               + g.activation_elems * GENERATOR_BATCH * BYTES_PER_VALUE * ACTIVATION_COPIES)
    return tensors / MIB + WORKSPACE_MB


def round_time_s(spec: ModelSpec, speed: SpeedModel, *, samples: int, epochs: int, batch: int = DEFAULT_BATCH) -> float:
    """Estimated seconds of a round's local training: ``3 × MACs × samples × epochs ÷`` the device's training MAC/s
    for ``spec`` at ``batch`` (:meth:`fedge.profiles.speed.SpeedModel.mac_rate`), plus the round's fixed costs
    (:meth:`fedge.profiles.speed.SpeedModel.round_fixed_s`)."""
    return speed.train_seconds(spec, batch, samples=samples, epochs=epochs)


def fit_batch(spec: ModelSpec, budget_mb: float) -> int | None:
    """Largest batch in 64, 32, 16, 8 whose memory estimate fits ``budget_mb`` (None: none fits)."""
    batch = DEFAULT_BATCH
    while batch >= MIN_BATCH:
        if train_memory_mb(spec, batch) <= budget_mb:
            return batch
        batch //= 2
    return None


@dataclass(frozen=True)
class Plan:
    """What a device runs, and why (``reasons`` has one line per choice)."""

    profile: str
    model_tier: str
    arch: str
    embed_dim: int
    inference_quant: str
    upload_precision: str
    generator_tier: str
    """A generator tier (:data:`GENERATOR_ALLOWANCES`), or ``"none"`` when no generator fits."""
    batch_size: int
    local_epochs: int
    lr: float
    """SGD learning rate of local training, the first round's (``[train] lr`` overrides it)."""
    lr_schedule: str
    """How the learning rate changes round by round (:mod:`fedge.common.lrschedule`; ``[train] lr_schedule``
    overrides it)."""
    min_tail: int
    """An epoch's last batch smaller than this joins the one before it (``[train] min_tail`` overrides it)."""
    samples: int
    params: int
    macs: int
    train_memory_mb: float
    """Estimated peak training memory of the chosen model at the chosen batch, MiB."""
    round_time_s: float
    """Estimated local-training time of one round, s."""
    reasons: Mapping[str, str]
    trade: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """The model-tier trade (:class:`fedge.profiles.tier_choice.Trade`): the largest tier memory holds and the
    tier chosen, with the expected time and accuracy of both, and the words of ``reasons["model_tier"]``."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["reasons"] = dict(self.reasons)
        d["trade"] = dict(self.trade)
        return d


def _mb(x: float) -> str:
    return f"{x:.1f} MiB"


def _choose_tier(profile: Profile, specs: Mapping[str, ModelSpec], samples: int, run: RunBudget,
                 pin: str | None) -> tuple[str, int, int, dict[str, str], Trade]:
    """Model tier, batch size, local epochs, their reasons and the trade (:mod:`fedge.profiles.tier_choice`)."""
    budget_mb = profile.budgets.train_memory_mb
    speed = speed_model(profile)
    by_size = sorted(specs, key=lambda t: specs[t].num_params())  # the family's tiers
    nm = {t: s.name for t, s in specs.items()}  # tier-m, or mobilenet-m-96
    # Batch that fits the memory budget, for the tiers where one does.
    fit = {t: b for t in by_size if (b := fit_batch(specs[t], budget_mb)) is not None}
    batch = {t: fit.get(t, MIN_BATCH) for t in by_size}
    fits_memory = [t for t in by_size if t in fit]
    if not fits_memory:
        need = train_memory_mb(specs[by_size[0]], MIN_BATCH)
        raise ProfileError(
            f"profile {profile.name!r}: no model tier fits budgets.train_memory_mb = {budget_mb:g} "
            f"({nm[by_size[0]]} at batch {MIN_BATCH} needs {_mb(need)})",
            hint=f"raise budgets.train_memory_mb to at least {math.ceil(need)}",
        )
    if pin is not None and pin not in specs:
        raise ProfileError(f"profile {profile.name!r}: pinned tier {pin!r} is not a model tier",
                           hint=f"pin one of {', '.join(nm[t] for t in by_size)}, or leave the tier to the planner")
    # an epoch's seconds; each round (update) adds the speed model's fixed costs once
    per_epoch = {t: speed.epoch_seconds(specs[t], batch[t], samples=samples) for t in by_size}
    fixed = {t: speed.round_fixed_s(specs[t], batch[t]) for t in by_size}
    if run.time_budget_s is not None:
        budget_s, budget_from = run.time_budget_s, "[run] time_budget_s"
    else:
        budget_s = run.rounds * profile.budgets.round_time_s
        budget_from = f"{run.rounds} rounds x budgets.round_time_s = {profile.budgets.round_time_s:.3g} s"
    # The curves were measured on the GeFL CNN tiers: another family's tiers fall back to the rule without them.
    gefl = all(nm[t] == f"tier-{t}" for t in by_size)
    curves = load_curves(run.task) if run.task and gefl else None
    options = tier_options(per_epoch, batch, fits_memory, samples, budget_s, run, curves, names=nm, fixed_s=fixed)
    share = budget_s if run.asynchronous else budget_s / run.rounds
    where = f"profile {profile.name!r}"
    planner_choice = choose_tier(options, fits_memory, pin=None, curves=curves, where=where, share_s=share) \
        if pin is None or any(options[t].epochs_per_round for t in fits_memory) else None
    chosen = options[pin] if pin is not None else planner_choice
    assert chosen is not None
    trade = describe(options[fits_memory[-1]], chosen, budget_s=budget_s, budget_from=budget_from, run=run,
                     samples=samples, pinned=pin is not None, planner_choice=planner_choice)
    tier, b = chosen.tier, batch[chosen.tier]
    epochs = max(1, chosen.epochs_per_round)
    how = (f"accuracy curves of {run.task} ({curves.source.rsplit('/', 1)[-1]}; the fastest tier within "
           f"{ACCURACY_TOLERANCE:g} point of the best expected)" if curves is not None
           else f"no accuracy curves for task {run.task!r}{'' if gefl else ' and this family'}: the largest tier "
                "whose full schedule fits")
    above = by_size[by_size.index(fits_memory[-1]) + 1:]
    mem_note = (f"; {nm[above[0]]} would need {_mb(train_memory_mb(specs[above[0]], MIN_BATCH))} even at batch "
                f"{MIN_BATCH}" if above else "")
    tier_reason = f"{trade.words}{mem_note}; chosen by {how}; speed: {speed.describe()}"
    if epochs == MAX_EPOCHS:
        per = "update" if run.asynchronous else "round"
        epochs_reason = f"GeFL's {MAX_EPOCHS} local epochs on real data (T_r) fit the {per}"
    else:
        epochs_reason = (f"reduced from {MAX_EPOCHS} so {nm[tier]} fits its share of the time budget ({share:.1f} s; "
                         f"est. {per_epoch[tier] * epochs:.1f} s for {samples} samples x {epochs} epochs)")
    if b == DEFAULT_BATCH:
        batch_reason = (f"the default (GeFL's {DEFAULT_BATCH}): {nm[tier]} needs "
                        f"{_mb(train_memory_mb(specs[tier], b))} of {budget_mb:g} MiB")
    else:
        batch_reason = (f"halved from {DEFAULT_BATCH} until {nm[tier]} fit {budget_mb:g} MiB "
                        f"(batch {b * 2} would need {_mb(train_memory_mb(specs[tier], b * 2))}); "
                        f"the batch shrinks (to {MIN_BATCH} at least) before the tier drops")
    reasons = {"model_tier": tier_reason, "batch_size": batch_reason, "local_epochs": epochs_reason}
    return tier, b, epochs, reasons, trade


def _heuristic_quant(profile: Profile, note: str) -> tuple[str, str]:
    hw = profile.hardware
    if hw.int8_dot:
        return "int8-static", (f"{hw.cpu} has int8 dot-product instructions (ARMv8.2 dotprod / x86 VNNI), "
                               f"so static int8 convolutions are expected to beat fp32{note}")
    if hw.has_int8_accelerator():
        return "int8-static", f"the int8 accelerator ({', '.join(hw.accelerators)}) runs static int8 models{note}"
    fp16 = [a for a in hw.accelerators if a in FP16_PROVIDERS]
    if fp16:
        return "fp16", (f"the {fp16[0]} accelerator runs fp16 natively through ONNX Runtime's "
                        f"{' / '.join(FP16_PROVIDERS[fp16[0]])} execution provider; no int8 dot product "
                        f"on the CPU{note}")
    if hw.has_fp16_accelerator():
        acc = ", ".join(a for a in hw.accelerators if a.endswith("-fp16"))
        return "fp32", (f"{acc} has no ONNX Runtime execution provider that runs fp16 (the CPU provider computes "
                        f"fp16 through casts, no faster than fp32), and no int8 dot product (dotprod/VNNI): "
                        f"int8 is not assumed faster without dotprod/VNNI{note}")
    return "fp32", (f"no int8 dot product (dotprod/VNNI) and no fp16 accelerator: int8 is not assumed faster "
                    f"without dotprod/VNNI{note}")


def _choose_quant(profile: Profile, tier: str) -> tuple[str, str]:
    """Inference quantization and its reason."""
    m = profile.measured
    if m is None:
        return _heuristic_quant(profile, "; add a [measured] table to decide from latencies")
    lat = {q: ms for q in INFERENCE_QUANTS if (ms := m.latency(tier, q)) is not None}
    if not lat:
        return _heuristic_quant(profile, f"; [measured] has no tier-{tier} latencies")
    fp32 = lat.get("fp32")
    ok: list[tuple[float, int, str]] = []
    rejected: list[str] = []
    for q, ms in lat.items():
        drop = 0.0 if q == "fp32" else m.accuracy_drop.get(q)
        if q.startswith("int8"):
            # int8 only where it is measured, both in speed and in accuracy.
            if fp32 is None or ms >= fp32:
                rejected.append(f"{q} not measured faster than fp32")
                continue
            if drop is None:
                rejected.append(f"{q} has no measured accuracy drop")
                continue
        elif drop is None:
            drop = 0.0  # fp16 keeps 10 mantissa bits: far below a point for these CNNs
        if drop > MAX_ACCURACY_DROP:
            rejected.append(f"{q} loses {drop:g} points")
            continue
        ok.append((ms, INFERENCE_QUANTS.index(q), q))
    if not ok:
        return "fp32", f"no measured level of tier-{tier} qualifies ({'; '.join(rejected)}): fp32 is safe"
    ms, _, quant = min(ok)
    budget = profile.budgets.inference_latency_ms
    reason = (f"fastest measured level of tier-{tier} within {MAX_ACCURACY_DROP:g} accuracy point: {ms:g} ms"
              + (f" vs {fp32:g} ms at fp32" if fp32 is not None and quant != "fp32" else "")
              + (f" ({'; '.join(rejected)})" if rejected else "")
              + (f"; meets the {budget:g} ms budget" if ms <= budget else f"; MISSES the {budget:g} ms budget"))
    return quant, reason


def inference_quant_for(profile: Profile, tier: str) -> tuple[str, str]:
    """The inference quantization :func:`plan` would choose for ``tier-<tier>`` on ``profile``, and why.

    An exporter calls it for a model of another tier than the plan's (a fleet's
    ``archs`` may assign one), so the level is never inherited from the plan's tier.
    """
    return _choose_quant(profile, tier)


def _choose_upload(profile: Profile, params: int, name: str) -> tuple[str, str]:
    up = profile.network.uplink_kbps
    if up >= UPLINK_FP32_KBPS:
        prec, rule = "fp32", f"uplink {up:,.0f} kbit/s >= {UPLINK_FP32_KBPS:,} kbit/s"
    elif up >= UPLINK_FP16_KBPS:
        prec, rule = "fp16", f"uplink {up:,.0f} kbit/s is between {UPLINK_FP16_KBPS:,} and {UPLINK_FP32_KBPS:,} kbit/s"
    else:
        prec, rule = "int8", f"uplink {up:,.0f} kbit/s < {UPLINK_FP16_KBPS:,} kbit/s"
    nbytes = params * UPLOAD_BYTES[prec]
    secs = nbytes * 8 / (up * 1000)
    return prec, f"{rule}: a full {name} update is {nbytes / 1000:,.0f} kB, {secs:.2f} s at {prec}"


def _choose_generator(profile: Profile) -> tuple[str, str]:
    budget = profile.budgets.train_memory_mb
    need = {t: generator_memory_mb(t) for t in GENERATOR_ALLOWANCES}
    fits = [t for t in GENERATOR_ALLOWANCES if need[t] <= budget]
    if not fits:
        first = next(iter(GENERATOR_ALLOWANCES))
        return "none", (f"no generator fits {budget:g} MiB (tier {first!r} needs up to {_mb(need[first])}); "
                        f"this device suits statistics-based methods (FedProto)")
    tier = fits[-1]
    names = list(GENERATOR_ALLOWANCES)
    bigger = names[names.index(tier) + 1:]
    why_not = f"; {bigger[0]!r} would need up to {_mb(need[bigger[0]])}" if bigger else ""
    g = GENERATOR_ALLOWANCES[tier]
    return tier, (f"largest generator tier that fits {budget:g} MiB: {g.what}, up to {g.params / 1e6:.2f} M params "
                  f"and est. {_mb(need[tier])} to train (Adam, batch {GENERATOR_BATCH}){why_not}; "
                  f"devices average generators within a tier")


def _choose_lr(samples: int, batch: int) -> tuple[float, str]:
    """The first round's learning rate, and why (see :data:`DEFAULT_LR`)."""
    return DEFAULT_LR, (f"{DEFAULT_LR:g} in the first round (GeFL's {PROTOCOL_LR:g}), annealed by the schedule: "
                        f"large steps while the model is far from any fit, small ones at the end")


def _choose_lr_schedule(lr: float) -> tuple[str, str]:
    """How the learning rate changes round by round, and why (see :data:`DEFAULT_LR_SCHEDULE`)."""
    return DEFAULT_LR_SCHEDULE, (f"{DEFAULT_LR_SCHEDULE}: {lr:g} down to {COSINE_FLOOR * lr:g} by the run's last "
                                 f"round; at a constant {PROTOCOL_LR:g} a device on a small, skewed share oscillates "
                                 f"to the end (issue 45: one at 68 % ended at 20 %), and a constant "
                                 f"{PROTOCOL_LR / 2:g} learns slower and still drops (docs/results.md); the "
                                 f"published protocols set lr = {PROTOCOL_LR:g}, constant")


def _choose_min_tail(samples: int, batch: int) -> tuple[int, str]:
    """The smallest last batch an epoch keeps on its own, and why."""
    tail = samples % batch
    what = (f"{samples} samples at batch {batch} leave a last batch of {tail}"
            + (f", which joins the one before ({batch + tail} samples)" if 0 < tail < MIN_BATCH else ", kept"))
    return MIN_BATCH, (f"a last batch of fewer than {MIN_BATCH} samples (the batch floor: BatchNorm statistics "
                       f"below it are noise) joins the one before; {what}")


def plan(profile: Profile, *, embed_dim: int = DEFAULT_EMBED_DIM, samples: int = DEFAULT_SAMPLES,
         specs: Mapping[str, ModelSpec] | None = None, run: RunBudget | None = None, pin: str | None = None) -> Plan:
    """Turn a profile into a :class:`Plan`.

    ``samples`` is the number of local training samples (GeFL: 600); it scales the
    round-time estimate. ``specs``: tier -> network of the fleet's model family, measured
    (:func:`fedge.common.families.family_arch`); by default the GeFL CNN family's ``tier-*``.
    ``run``: the run's rounds, time budget, mode and task (default: :class:`~fedge.profiles.tier_choice.RunBudget`'s,
    10 synchronous rounds within 10 × the profile's round budget and no task, so no accuracy curves); ``pin``: a
    tier the fleet config fixes (``"m"``, or ``"tier-m"``). Raises :class:`ProfileError` when no model fits the
    memory budget, or when one epoch of the smallest model misses its share of the time budget.
    """
    if samples < 1:
        raise ProfileError(f"samples = {samples}: must be at least 1", hint="pass the device's local sample count")
    if specs is None:
        specs = {t: tier_arch(t, embed_dim=embed_dim) for t in TIERS}
    if pin is not None and pin not in specs:  # a network's name (tier-m, mobilenet-m-96) for its tier
        pin = next((t for t, sp in specs.items() if sp.name == pin), pin.removeprefix("tier-"))
    tier, batch, epochs, reasons, trade = _choose_tier(profile, specs, samples, run or RunBudget(), pin)
    spec = specs[tier]
    if spec.name == f"tier-{tier}":
        quant, reasons["inference_quant"] = _choose_quant(profile, tier)
    else:  # [measured] latencies are of the GeFL CNN tiers: another family's quantization is the heuristic's
        quant, reasons["inference_quant"] = _heuristic_quant(profile, f" ({spec.name}: [measured] latencies are of "
                                                                      "the GeFL CNN tiers)")
    upload, reasons["upload_precision"] = _choose_upload(profile, spec.num_params(), spec.name)
    generator, reasons["generator_tier"] = _choose_generator(profile)
    lr, reasons["lr"] = _choose_lr(samples, batch)
    lr_schedule, reasons["lr_schedule"] = _choose_lr_schedule(lr)
    min_tail, reasons["min_tail"] = _choose_min_tail(samples, batch)
    return Plan(
        profile=profile.name,
        model_tier=tier,
        arch=spec.name,
        embed_dim=embed_dim,
        inference_quant=quant,
        upload_precision=upload,
        generator_tier=generator,
        batch_size=batch,
        local_epochs=epochs,
        lr=lr,
        lr_schedule=lr_schedule,
        min_tail=min_tail,
        samples=samples,
        params=spec.num_params(),
        macs=spec.macs(),
        train_memory_mb=train_memory_mb(spec, batch),
        round_time_s=round_time_s(spec, speed_model(profile), samples=samples, epochs=epochs, batch=batch),
        reasons=MappingProxyType(reasons),
        trade=MappingProxyType(trade.to_dict()),
    )
