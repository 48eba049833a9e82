"""One group's secure sum in one round, as the coordinator plans it and a device reads it from the descriptor.

Both carriers of the protocol use this: the in-process simulation (:mod:`fedge.sim.secure`) and the round over
MQTT (:mod:`fedge.coordinator.secure`, answered by :mod:`fedge.edge.secure`). :func:`plan_task` sizes the group's
neighbour graph, threshold and field; a :class:`SecureTask` is what a round descriptor carries for each group
(``info["secagg"][group]``): the :class:`~fedge.secagg.messages.RoundSetup`, the method whose terms are summed,
the bound of a device's counts and the clipping range — everything a device needs to compute its terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedge.common.privacy import PrivacySettings
from fedge.errors import ConfigError
from fedge.secagg import DEFAULT_STAGE_S, graph, terms
from fedge.secagg.fixedpoint import plan_field
from fedge.secagg.messages import Refusal, RoundSetup


def group_parameters(settings: PrivacySettings, group: str, size: int) -> tuple[int, int]:
    """(neighbours, threshold) of a group of ``size`` devices; :class:`ConfigError` naming a group too small."""
    degree = min(settings.neighbours or graph.default_degree(size), max(size - 1, 0))
    threshold = settings.threshold or graph.default_threshold(degree)
    if size < max(threshold, 2):
        raise ConfigError(f"[privacy] secure_aggregation: group {group!r} has {size} device(s), fewer than the "
                          f"threshold {max(threshold, 2)}: its sum would be one device's values or could never "
                          "be unmasked", hint="give the group more devices, lower [privacy] threshold, or leave "
                                              "secure_aggregation out")
    return degree, threshold


@dataclass(frozen=True)
class SecureTask:
    """What a device needs for its part of one group's secure sum (see the module docstring)."""

    setup: RoundSetup
    method: str
    cap: float  # a device's (class) counts are clipped to this (the group's largest sample count)
    clip: float  # every summed value is clipped to ±clip
    stage_s: float = DEFAULT_STAGE_S  # how long a device waits for each of the coordinator's stage messages

    def to_dict(self) -> dict[str, Any]:
        return {"setup": self.setup.to_dict(), "method": self.method, "cap": self.cap, "clip": self.clip,
                "stage_s": self.stage_s}

    @classmethod
    def from_dict(cls, d: object) -> SecureTask:
        """The task of a descriptor's entry; :class:`Refusal` (``malformed``, ``version``) when it is none."""
        if not isinstance(d, dict) or not isinstance(d.get("setup"), dict):
            raise Refusal("malformed", "a secure-aggregation task must be an object with a 'setup'")
        setup = RoundSetup.from_dict(d["setup"])
        try:
            method, cap, clip = str(d["method"]), float(d["cap"]), float(d["clip"])
            stage_s = float(d.get("stage_s", DEFAULT_STAGE_S))
        except (KeyError, TypeError, ValueError) as exc:
            raise Refusal("malformed", f"secure-aggregation task: {exc}") from exc
        if method not in terms.SECURE_METHODS or not (cap >= 1 and 0 < clip < float("inf") and 0 < stage_s <= 3600):
            raise Refusal("malformed", f"secure-aggregation task of method {method[:20]!r}, cap {cap}, clip {clip}, "
                                       f"stage_s {stage_s}")
        return cls(setup, method, cap, clip, stage_s)


def plan_task(settings: PrivacySettings, method: str, rnd: int, group: str, members: Sequence[str],
              spec: terms.Spec, cap: float, seed: bytes, stage_s: float = DEFAULT_STAGE_S) -> SecureTask:
    """Group ``group``'s secure sum in round ``rnd`` over ``members`` (their uploads of ``spec``; counts at most
    ``cap``); ``seed`` draws the neighbour graph. :class:`ConfigError` when the group is below the threshold."""
    members = tuple(sorted(members))
    degree, threshold = group_parameters(settings, group, len(members))
    clip = settings.clipping_range
    plan = plan_field(len(members), terms.segments(method, spec, clip=clip, cap=cap), settings.field_bits,
                      group=group)
    return SecureTask(RoundSetup(rnd, group, members, degree, threshold, plan, seed), method, cap, clip, stage_s)
