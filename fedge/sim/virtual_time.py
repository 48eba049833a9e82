"""The parts of results.json in virtual time: the clock, each device's timeline and busy / idle / offline
shares, time to accuracy (the devices of each synchronous round; asynchronous, the whole fleet at fixed moments:
:mod:`fedge.sim.clocked_async`) and the staleness of an asynchronous run's updates."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from fedge.common.rounds import FINAL_PHASE
from fedge.coordinator.engine import RoundReport
from fedge.fleet.clock import FleetClock
from fedge.fleet.energy import EnergyLedger
from fedge.sim.simulate import SimResult


def virtual(res: SimResult) -> tuple[dict[str, Any] | None, dict[int, tuple[float, float]]]:
    """The ``clock`` part of results.json, and each timed round's (start, end) in virtual seconds."""
    clock = res.clock
    if clock is None:
        return None, {}
    ck = res.cfg.clock
    spans = {r.round: (r.start_s, r.end_s) for r in clock.rounds}
    doc = {"mode": "sync" if res.cfg.asynchronous is None else "async", "virtual_s": clock.now,
           "jitter": ck.jitter, "availability": ck.availability, "deadline_s": ck.deadline_s,
           "mean_round_s": clock.now / max(1, len(clock.rounds)),
           "lost": {str(r.round): {d: t.lost for d, t in r.devices.items() if not t.delivered}
                    for r in clock.rounds if any(not t.delivered for t in r.devices.values())},
           # joules (fedge.fleet.energy): the whole fleet's, idling included, and its tasks' alone
           "energy": {"fleet_j": (ledger := EnergyLedger(clock)).fleet_j(), "task_j": ledger.task_j(),
                      "devices_without_power": ledger.without_power()}}
    return doc, spans


def round_energy(res: SimResult) -> dict[int, dict[str, float]]:
    """Each timed round's joules by device: its task and every device's idling over its span (docs/simulation.md)."""
    clock = res.clock
    if clock is None:
        return {}
    ledger = EnergyLedger(clock)
    return {r.round: ledger.round_j(r) for r in clock.rounds}


def device_virtual(res: SimResult, dev_id: str, reports: list[RoundReport],
                   joules: dict[int, dict[str, float]]) -> dict[str, Any]:
    """One device in virtual time: per round its timeline (None: no work), its busy / idle / offline share, and its
    joules (``joules``: :func:`round_energy`)."""
    clock = res.clock
    if clock is None or dev_id not in clock.devices:
        return {}
    by_round = {r.round: r.devices.get(dev_id) for r in clock.rounds}
    timeline = [(t.to_dict() if (t := by_round.get(rep.round)) is not None else None) for rep in reports]
    shares = clock.shares(dev_id)
    ledger = EnergyLedger(clock)
    c = clock.devices[dev_id]
    battery = {} if c.power is None or c.power.battery_j is None else {
        "battery_left_j": ledger.battery_left_j(dev_id), "battery_floor_j": c.power.floor_j,
        "battery_min_j": min(ledger.battery_left_j(dev_id, r.end_s) or 0.0 for r in clock.rounds)
        if clock.rounds else c.power.battery_j}
    return {"virtual": timeline, "busy_share": shares["busy"], "idle_share": shares["idle"],
            "offline_share": shares["offline"], "joules": ledger.device_j(dev_id),
            "joules_per_round": [joules[rep.round].get(dev_id) if rep.round in joules else None for rep in reports],
            **battery}


def staleness(r: RoundReport) -> dict[str, Any]:
    """A version's line in ``rounds_log``: the staleness of the updates it accepted (asynchronous mode)."""
    if not r.staleness:
        return {}
    vals = list(r.staleness.values())
    return {"staleness_mean": sum(vals) / len(vals), "staleness_max": max(vals)}


def asynchronous(res: SimResult, ids: list[str]) -> dict[str, Any]:
    """results.json's ``asynchronous``: the staleness of every accepted update over the run (a histogram: versions
    behind -> updates), and each device's accepted and refused updates."""
    training = [r for r in res.reports if r.phase != FINAL_PHASE]
    stale = [s for r in training for s in r.staleness.values()]
    hist = Counter(stale)
    a = res.cfg.asynchronous
    assert a is not None
    return {"buffer_size": a.buffer_size, "max_staleness": a.max_staleness, "staleness_weight": a.staleness_weight,
            "staleness_mean": sum(stale) / len(stale) if stale else None, "staleness_max": max(stale, default=None),
            "staleness_histogram": {str(k): hist[k] for k in sorted(hist)},
            "accepted_per_device": {d: sum(d in r.accepted for r in training) for d in ids},
            "refused_per_device": {d: sum(sum(r.rejected_by_device.get(d, {}).values()) for r in training)
                                   for d in ids}}


def time_to_accuracy(results: dict[str, Any]) -> list[dict[str, Any]]:
    """(virtual seconds, mean global accuracy) after each synchronous round: the accuracy reached by each moment,
    over the devices that evaluated then (``devices``)."""
    times = [0.0] + [r["virtual_end_s"] for r in results["rounds_log"] if r.get("virtual_end_s") is not None]
    out = []
    for i, t in enumerate(times):
        accs = [d["acc_global"][i] for d in results["devices"] if i < len(d["acc_global"]) and
                d["acc_global"][i] is not None]
        if accs:
            out.append(_point(i, t, accs))
    return out


TARGET_SHARE = 0.95
"""The share of a final accuracy that "time to accuracy" is read at by default (the summary, ``fedge compare``)."""


def time_to(curve: list[dict[str, Any]], level: float, key: str = "virtual_s") -> float | None:
    """The first virtual second a ``time_to_accuracy`` curve's fleet mean reaches ``level`` (None: never); with
    ``key = "fleet_j"``, the fleet's joules by then."""
    return next((p.get(key) for p in curve if p["mean_acc_global"] >= level), None)


def with_energy(curve: list[dict[str, Any]], clock: FleetClock) -> list[dict[str, Any]]:
    """Each point of a time-to-accuracy curve with the fleet's joules up to its moment (``fleet_j``)."""
    ledger = EnergyLedger(clock)
    return [{**p, "fleet_j": ledger.fleet_j(p["virtual_s"])} for p in curve]


def fleet_curve(clock: FleetClock) -> list[dict[str, Any]]:
    """An asynchronous run's time to accuracy: the whole fleet evaluated at fixed moments
    (:attr:`FleetClock.evaluations`), each point over every device that has a global test accuracy."""
    out = []
    for e in clock.evaluations:
        accs = [a for m in e.metrics.values() if (a := m.get("acc_global")) is not None and not math.isnan(a)]
        if accs:
            out.append(_point(e.after, e.virtual_s, accs))
    return out


def _point(after: int, virtual_s: float, accs: list[float]) -> dict[str, Any]:
    return {"after_round": after, "virtual_s": virtual_s, "mean_acc_global": sum(accs) / len(accs),
            "min_acc_global": min(accs), "max_acc_global": max(accs), "devices": len(accs)}


def plot_time_to_accuracy(results: dict[str, Any], path: Path) -> None:
    """Global accuracy against virtual time: the fleet's mean (line) and, synchronous, each device's evaluations
    (dots) / asynchronous, the range over the fleet at each measurement (band)."""
    import matplotlib.pyplot as plt

    mean = results["time_to_accuracy"]
    joules = [m.get("fleet_j") for m in mean]
    energy_panel = bool(mean) and all(j is not None for j in joules) and any(joules)
    fig, axes = plt.subplots(1, 2 if energy_panel else 1, figsize=(12 if energy_panel else 7, 4), squeeze=False)
    ax = axes[0][0]
    xs = [m["virtual_s"] for m in mean]
    if results["clock"].get("mode") == "async":
        # a version's own reports hold a different few devices each: the fleet measurement is the curve
        ax.fill_between(xs, [100 * m["min_acc_global"] for m in mean], [100 * m["max_acc_global"] for m in mean],
                        alpha=0.2, label="fleet range")
    else:
        times = [0.0] + [r["virtual_end_s"] for r in results["rounds_log"] if r.get("virtual_end_s") is not None]
        for d in results["devices"]:
            pts = [(times[i], 100 * a) for i, a in enumerate(d["acc_global"][: len(times)]) if a is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), ls="none", marker=".", ms=3, alpha=0.4)  # rounds it evaluated in
    ax.plot(xs, [100 * m["mean_acc_global"] for m in mean], "k.-", lw=2,
            label=f"fleet mean ({max((m['devices'] for m in mean), default=0)} devices)")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("global test accuracy (%)")
    ck = results["clock"]
    ax.set_title(f"{results['method']} on {results['dataset']}: time to accuracy "
                 f"(availability {ck['availability']}, jitter {ck['jitter']:g})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if energy_panel:  # the same fleet mean against the fleet's joules by then (fedge.fleet.energy)
        ex = axes[0][1]
        ex.plot([j / 1000 for j in joules], [100 * m["mean_acc_global"] for m in mean], "k.-", lw=2)
        ex.set_xlabel("fleet energy (kJ, idling included)")
        ex.set_ylabel("global test accuracy (%)")
        ex.set_title("accuracy against fleet energy")
        ex.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
