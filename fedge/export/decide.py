"""Which quantization an export ships: decided for the exported model itself, never inherited.

A profile's plan chooses the inference quantization for the tier it gives a
standalone device. A fleet's ``archs`` may put the device on another model, and
whether int8 pays depends on the model (on small CNNs quantize/dequantize
overhead outweighs the cheaper arithmetic), so the level is decided per
exported model, in this order:

1. ``--quant`` (an explicit choice): shipped as asked, with a warning if the
   export measures it slower than fp32;
2. the profile's ``[measured]`` table, when it has latencies for the model's
   tier: the planner's rule (:func:`fedge.profiles.planner.inference_quant_for`)
   applied to *that* tier. These figures were taken on the device, so the
   export host's own timing does not overrule them;
3. otherwise the plan's level, as a *candidate*: an int8 level is shipped only
   if the export measures it faster than fp32 on this model (batch 1, the same
   threads, interleaved runs); measured slower, the export ships fp32 and the
   manifest's ``quantization`` entry says why. The export host is not the
   device, which is why a measured profile (2) takes precedence; but a model
   whose int8 graph is slower than fp32 on a VNNI-capable x86 host is slower
   still on CPUs without int8 dot products. fp16 is planned only for a device
   provider where it pays (a GPU), which the export host cannot time: it is
   shipped as planned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedge.errors import ExportError, FedgeError
from fedge.runtime.manifest import QUANTS
from fedge.runtime.providers import FP16_PROVIDERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantRequest:
    """The level an export starts from, where it came from, and whether a measurement may overrule it."""

    quant: str
    source: str
    speed_check: bool = False
    """True: an int8 level measured slower than fp32 on the exported model is replaced by fp32."""

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise ExportError(f"unknown quantization {self.quant!r}", hint=f"use one of {', '.join(QUANTS)}")

    @classmethod
    def explicit(cls, quant: str, source: str = "requested explicitly") -> QuantRequest:
        """A level chosen by the caller: shipped as asked."""
        return cls(quant, source, speed_check=False)


def _load_profile(ref: str | None) -> tuple[Any, str]:
    """The profile object, or None and why it is not available."""
    if not ref:
        return None, "no profile recorded"
    try:
        from fedge.profiles import load_profile

        return load_profile(ref), ""
    except FedgeError as exc:
        return None, f"profile {ref!r} cannot be loaded here ({exc.message})"


def request_quant(arch: str, *, override: str | None = None, profile: str | None = None,
                  plan: Mapping[str, Any] | None = None) -> QuantRequest:
    """The quantization request for a model of architecture ``arch`` (see the module docstring)."""
    if override:
        return QuantRequest.explicit(override, "--quant")
    prof, why_no_profile = _load_profile(profile)
    tier = arch.removeprefix("tier-") if arch.startswith("tier-") else None
    measured = getattr(prof, "measured", None)
    if tier is not None and measured is not None and any(
            measured.latency(tier, q) is not None for q in QUANTS):
        from fedge.profiles.planner import inference_quant_for

        quant, reason = inference_quant_for(prof, tier)
        return QuantRequest(quant, f"profile {prof.name!r}'s measured table for {arch}: {reason}")
    planned = plan.get("inference_quant") if plan else None
    if planned is None:
        return QuantRequest("fp32", "no plan records an inference quantization"
                            + (f"; {why_no_profile}" if why_no_profile else ""))
    plan_arch = plan.get("arch") if plan else None
    name = (plan.get("profile") if plan else None) or profile or "?"
    if plan_arch and plan_arch != arch:
        source = (f"plan of profile {name!r}, made for {plan_arch} (this model is {arch}), "
                  "which has no measured latencies" + (" for it" if measured is not None else ""))
    else:
        source = f"plan of profile {name!r}"
    if why_no_profile and profile:
        source += f"; {why_no_profile}"
    return QuantRequest(str(planned), source, speed_check=str(planned).startswith("int8"))


def settle(request: QuantRequest, latency_ms: Mapping[str, float], *, how: str,
           provider: str = "CPUExecutionProvider") -> tuple[str, str]:
    """The level to ship after measuring ``latency_ms`` (fp32 and the requested level) and the reason.

    ``how`` describes the measurement (batch, threads, runs, machine) for the reason.
    """
    q = request.quant
    if q == "fp32" or q not in latency_ms or "fp32" not in latency_ms:
        return q, f"{q} from {request.source}"
    ms, fp32 = latency_ms[q], latency_ms["fp32"]
    figures = f"{ms:.3f} ms vs {fp32:.3f} ms at fp32 ({how})"
    slower = ms >= fp32
    if request.speed_check and q.startswith("int8"):
        if slower:
            log.warning("%s is measured slower than fp32 on this model (%s): shipping fp32", q, figures)
            return "fp32", (f"{q} (from {request.source}) was measured slower than fp32 on this model: "
                            f"{figures}; shipping fp32")
        return q, f"{q} (from {request.source}) was measured faster than fp32 on this model: {figures}"
    if slower and q.startswith("int8"):
        log.warning("%s ships as requested although this host measures it slower than fp32 (%s)", q, figures)
        return q, f"{q} from {request.source}, shipped as requested although this host measured {figures}"
    note = ""
    if q == "fp16" and provider not in FP16_PROVIDERS:
        note = (f"; {provider} runs fp16 through casts, so this host's figure says nothing about a device "
                "whose provider runs fp16 natively")
    return q, f"{q} from {request.source}; this host measured {figures}{note}"
