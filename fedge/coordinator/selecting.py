"""The coordinator's side of ``selection = "oort"`` / ``"energy"``: the facts each candidate is chosen by.

What the devices reported (each accepted update's training ``loss``, and that it trained), their training samples
(their hello), their expected task time and joules, and a battery's charge. The time and energy come from the
transport when it knows the devices' clock (``selection_facts(rnd)``: the simulator's virtual clock, which charges
every task in joules, :mod:`fedge.fleet.energy`); otherwise the task time is what the device's last update took
or its hello's ``est_round_s``, and the joules are unknown (``energy`` then ranks by utility over the median
joules, and, with no battery charge in the heartbeat yet, cannot enforce a floor over MQTT).

The thermal guard (``[coordinator] thermal_guard``) judges each candidate's heat here, with one memory of who is hot
(:class:`fedge.common.heat.HeatGuard`): from the clock's thermal model in simulation (``SystemFacts.heat``), from the
devices' heartbeats over MQTT (``heat``: their temperature and the Pi firmware's throttling flags).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from fedge.common.health import HealthRecord
from fedge.common.heat import HEAT_MAX_AGE_S, HeatGuard, HeatLimits, HeatReading
from fedge.common.rounds import FINAL_PHASE, DeviceInfo
from fedge.common.sampling import Sampling
from fedge.common.selection import DeviceFacts, SystemFacts, select
from fedge.coordinator.report import RoundReport

log = logging.getLogger(__name__)


def heartbeat_heat(records: Mapping[str, tuple[HealthRecord, float]], limits: Callable[[str], HeatLimits | None],
                   *, now: float, max_age_s: float = HEAT_MAX_AGE_S) -> dict[str, HeatReading]:
    """What the devices' last heartbeats (each with the coordinator's time it arrived) say of their heat (their
    ``cpu_temp_c`` and the Pi firmware's ``throttled`` flags), with each device's limits (``limits(device)``; None:
    :class:`HeatLimits`' defaults). A record that tells neither says nothing; one older than ``max_age_s`` at
    ``now`` is marked stale (``HeatReading.stale``: the guard treats its heat as unknown, :data:`HEAT_MAX_AGE_S`)."""
    out = {}
    for d, (rec, at) in records.items():
        if rec.cpu_temp_c is None and rec.throttled is None:
            continue
        age = now - at
        stale = (f"heat unknown: its last heartbeat is {age:.1f} s old (more than {max_age_s:g} s), so the thermal "
                 "guard does not hold it" if max_age_s > 0 and age > max_age_s else "")
        out[d] = HeatReading(rec.cpu_temp_c, limits(d) or HeatLimits(), flags=rec.throttled, stale=stale)
    return out


_NO_FACTS = SystemFacts(None, None)


def stale_notes(heat: Mapping[str, HeatReading]) -> dict[str, str]:
    """The devices whose reading is too old to judge (``HeatReading.stale``), and why: what the round report adds
    to their reason, so it says why a device that had been hot is tasked again."""
    return {d: r.stale for d, r in heat.items() if r.stale}


class Selector:
    """The memory of what devices reported, and the choice of a round's devices from it."""

    def __init__(self) -> None:
        self.loss: dict[str, float] = {}
        self.trained: set[str] = set()
        self.seen = 0  # the last round whose report was read
        self.why: dict[str, str] = {}
        """Why each registered device was or was not tasked in the last round chosen."""
        self.guard = HeatGuard()
        self.held: list[str] = []
        """The devices the thermal guard held back in the last round chosen (too hot), sorted."""

    def observe(self, reports: Sequence[RoundReport]) -> None:
        """Read the reports of rounds not read yet: who trained, and the loss each reported."""
        for r in reports:
            if r.round <= self.seen or r.phase == FINAL_PHASE:
                continue
            for d in r.accepted:
                self.trained.add(d)
                loss = r.info.get(d, {}).get("loss")
                if isinstance(loss, int | float) and not isinstance(loss, bool):
                    self.loss[d] = float(loss)
            self.seen = r.round

    def choose(self, sampling: Sampling, rnd: int, devices: Mapping[str, DeviceInfo], online: set[str],
               reports: Sequence[RoundReport], system: Mapping[str, SystemFacts] | None,
               estimate: Callable[[str], float | None], heat: Mapping[str, HeatReading] | None = None) -> list[str]:
        """The devices ``sampling`` (oort or energy) picks for round ``rnd`` from the online registered ones
        (``heat``: what the heartbeats say of each device's heat, where ``system`` has no thermal model)."""
        self.observe(reports)
        facts = {}
        for d in sorted(online & set(devices)):
            sf = (system or {}).get(d)
            reading = sf.heat if sf is not None and sf.heat is not None else (heat or {}).get(d)
            facts[d] = DeviceFacts(
                samples=devices[d].num_samples, loss=self.loss.get(d), trained=d in self.trained,
                task_s=sf.task_s if sf is not None else estimate(d), task_j=sf.task_j if sf is not None else None,
                battery_j=sf.battery_j if sf is not None else None, floor_j=sf.floor_j if sf is not None else 0.0,
                hot=self.guard.judge(d, reading))
        choice = select(sampling.selection, rnd, sampling.count, list(facts), facts, sampling.utility, sampling.seed)
        self.why = {d: "offline at the round's start" for d in devices if d not in facts} | choice.why
        if sampling.utility.thermal_guard:
            for d, note in stale_notes(heat or {}).items():
                if d in self.why and not (system or {}).get(d, _NO_FACTS).heat:
                    self.why[d] += f" ({note})"
        self.held = choice.held
        if choice.held:
            log.info("round %d: thermal guard holds %s", rnd, ", ".join(f"{d} ({facts[d].hot})" for d in choice.held))
        log.debug("round %d: %s chose %s", rnd, sampling.selection, ", ".join(choice.chosen))
        return choice.chosen
