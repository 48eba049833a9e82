"""Results of a run: ``results.json``, ``accuracy.png``, ``traffic.png`` and the final table.

Accuracy index convention: ``acc_global[r]`` is the accuracy *after* round r
(r = 0 is the initial model), measured by the device at the start of round r+1
(or in the final round) and carried in its update, so the numbers are the same
in-process and over MQTT.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedge.common.rounds import DeviceInfo
from fedge.common.units import format_bytes
from fedge.coordinator.engine import RoundReport
from fedge.coordinator.report import rolled_back
from fedge.fleet.config import device_ids
from fedge.sim.simulate import SimResult
from fedge.sim.tier_trades import tier_trades, trade_lines
from fedge.sim.virtual_time import (
    TARGET_SHARE,
    asynchronous,
    device_virtual,
    fleet_curve,
    plot_time_to_accuracy,
    round_energy,
    staleness,
    time_to,
    time_to_accuracy,
    virtual,
    with_energy,
)


def _nan_to_none(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def _privacy(res: SimResult) -> dict[str, Any] | None:
    """[privacy]: the mechanism and the ε the coordinator accounted (None: the run had no [privacy])."""
    mech = res.cfg.privacy_mechanism
    if mech is None:
        return None
    spent = [r.privacy for r in res.reports if r.privacy]
    last = spent[-1] if spent else {"epsilon": 0.0, "budget_spent": False}
    eps = last["epsilon"]
    # ε = ∞ (noise_multiplier 0: clipping only) is written as null: JSON has no infinity.
    return {**mech.to_dict(), "epsilon_per_round": _finite(mech.epsilon(1)), "epsilon": _finite(eps),
            "training_rounds_released": len(spent), "budget_spent": last["budget_spent"]}


def build_results(res: SimResult) -> dict[str, Any]:
    """The JSON document of a run."""
    reports: list[RoundReport] = res.reports
    rounds = res.cfg.run.rounds
    clock_doc, spans = virtual(res)
    joules = round_energy(res)
    # the model each device ships (issue 45): its best round by its validation fold (fedge.edge.best)
    shipped = {d.info.device_id: d.method.best.to_dict() for d in res.devices}
    devices = [_device_doc(res, entry, shipped.get(entry[0].device_id), joules) for entry in _device_entries(res)]
    doc: dict[str, Any] = {
        "name": res.cfg.run.name,
        "method": res.cfg.run.method,
        "dataset": res.cfg.run.dataset,
        "rounds": rounds,
        "seed": res.cfg.run.seed,
        "config": res.cfg.source,
        "data_dir": res.cfg.run.data_dir,
        "seconds": res.seconds,
        "seconds_per_round": sum(r.seconds for r in reports[:rounds]) / max(rounds, 1),
        "summary": _summary(devices, rounds),
        "tier_trades": tier_trades(devices),  # the planner's model-tier trade per device (issue 48)
        "rounds_log": [
            {"round": r.round, "phase": r.phase, "seconds": r.seconds, "accepted": len(r.accepted),
             "rejected": r.rejected, **({"epsilon": _finite(r.privacy["epsilon"])} if r.privacy else {}),
             **({"sampled": r.sampled} if r.sampled else {}), "missing": r.missing, **staleness(r),
             **({"rolled_back": undone} if (undone := rolled_back(r)) else {}),
             **({"virtual_start_s": spans[r.round][0], "virtual_end_s": spans[r.round][1],
                 "joules": sum(joules[r.round].values())} if r.round in spans else {}),
             **({"selection": r.selection} if r.selection else {}), **({"hot": r.hot} if r.hot else {})}
            for r in reports
        ],
        "privacy": _privacy(res),
        "clock": clock_doc,
        # where the devices trained (backend, workers, each worker's peak RSS, lost devices; issue 30)
        "simulation": res.extra.get("simulation"),
        "devices": devices,
    }
    if res.cfg.asynchronous is not None:
        doc["asynchronous"] = asynchronous(res, [d["id"] for d in devices])
    if clock_doc is not None:
        assert res.clock is not None
        curve = fleet_curve(res.clock) if res.clock.evaluations else time_to_accuracy(doc)
        doc["time_to_accuracy"] = with_energy(curve, res.clock)
        if curve:
            level = TARGET_SHARE * curve[-1]["mean_acc_global"]
            clock_doc["energy"]["fleet_j_to_target"] = time_to(doc["time_to_accuracy"], level, "fleet_j")
    return doc


# (registry record, plan, local test samples, how it was lost)
DeviceEntry = tuple[DeviceInfo, dict[str, Any], int, str | None]


def _device_entries(res: SimResult) -> list[DeviceEntry]:
    """Every device of the fleet in fleet order, those lost with a worker of a parallel run included (with what
    they reported before)."""
    entries: list[DeviceEntry] = [(d.info, d.plan, len(d.method.ctx.local_test), None) for d in res.devices]
    entries += [(x.info, x.plan, x.num_local_test, x.reason) for x in res.lost]
    order = {dev_id: i for i, (dev_id, _) in enumerate(device_ids(res.cfg))}
    entries.sort(key=lambda e: order.get(e[0].device_id, len(order)))
    return entries


def _device_doc(res: SimResult, entry: DeviceEntry, shipped: dict[str, Any] | None,
                joules: dict[int, dict[str, float]]) -> dict[str, Any]:
    """One device's entry of results.json: its accuracies and bytes per round, what it ships, its virtual time."""
    info, plan, num_local_test, lost = entry
    dev_id, reports = info.device_id, res.reports
    metrics = [rep.metrics.get(dev_id, {}) for rep in reports]
    acc_g = [_nan_to_none(m.get("acc_global")) for m in metrics]
    acc_l = [_nan_to_none(m.get("acc_local")) for m in metrics]
    seen = [a for a in acc_g if a is not None]
    return {**personal_and_guard(reports, dev_id), **divergence(reports, dev_id),
        "id": dev_id,
        "profile": info.profile,
        "arch": info.arch,
        "params": info.extra.get("params"),
        "num_train": info.num_samples,
        "num_local_test": num_local_test,
        "upload_precision": info.upload_precision,
        "plan": plan,
        **({"lost": lost} if lost else {}),
        "acc_global": acc_g,
        "acc_local": acc_l,
        "final_acc_global": acc_g[-1] if acc_g else None,
        "final_acc_local": acc_l[-1] if acc_l else None,
        "best_acc_global": max(seen) if seen else None,
        "acc_val": [_nan_to_none(m.get("acc_val")) for m in metrics],
        "shipped": shipped,
        "shipped_acc_global": (shipped or {}).get("acc_global"),
        # Training rounds only (the final evaluation round uploads metrics only, but is counted).
        "bytes_up": [rep.bytes_up.get(dev_id, 0) for rep in reports],
        "bytes_down": [rep.bytes_down.get(dev_id, 0) for rep in reports],
        # seconds of each round's work as the device measured it (here: on the simulating host)
        "train_s": [rep.train_s.get(dev_id) for rep in reports],
        **device_virtual(res, dev_id, reports, joules),
    }


def _summary(devices: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """results.json's ``summary``: means over the devices (accuracies, bytes per training round, guard uses)."""
    def mean(key: str) -> float | None:
        vals = [d[key] for d in devices if d.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def per_round(key: str) -> float:
        """Mean bytes per device per training round."""
        return sum(sum(d[key][:rounds]) for d in devices) / max(1, len(devices) * rounds)

    return {
        "mean_final_acc_global": mean("final_acc_global"),
        "mean_best_acc_global": mean("best_acc_global"),
        "mean_shipped_acc_global": mean("shipped_acc_global"),
        "mean_final_acc_local": mean("final_acc_local"),
        **({"mean_final_acc_local_generic": mean("final_acc_local_generic"),
            "mean_final_acc_global_personal": mean("final_acc_global_personal"),
            "personal_devices": sum(bool(d["final_personal"]) for d in devices)}
           if any("final_personal" in d for d in devices) else {}),
        **{f"{key}_{part}": n for key in GUARD_KINDS if any(d.get(key) for d in devices)
           for part, n in (("used", sum(g["used"] for d in devices for g in d.get(key, []))),
                           ("decisions", sum(len(d.get(key, [])) for d in devices)))},
        **({"rollbacks": sum(len(d["rolled_back"]) for d in devices if "rolled_back" in d),
            "divergence_checks": sum(d.get("divergence_checks", 0) for d in devices)}
           if any("rolled_back" in d for d in devices) else {}),
        "mean_bytes_up_per_round": per_round("bytes_up"),
        "mean_bytes_down_per_round": per_round("bytes_down"),
    }


# The guard's verdicts a device reports (issue 17): on the synthetic samples, and (GeFL) on the fleet's
# extractor; each is ``devices[].<kind>`` in results.json and ``<kind>_used`` / ``<kind>_decisions`` in the summary.
GUARD_KINDS = ("guard", "guard_stem")


def personal_and_guard(reports: list[RoundReport], dev_id: str) -> dict[str, Any]:
    """A device's personal-head metrics and guard decisions (issue 17), when its method reports them.

    Personal predictor: ``acc_local`` is then the chosen predictor's and ``acc_global`` the federated model's;
    ``acc_local_generic`` / ``acc_global_personal`` are the other pairings. Guard: one entry per
    round in which it decided, with the held-out effect of the synthetic samples in points
    (``guard``) and of the fleet's extractor against the group's (``guard_stem``, GeFL).
    """
    out: dict[str, Any] = {}
    if any("personal" in r.metrics.get(dev_id, {}) for r in reports):
        for key in ("acc_local_generic", "acc_global_personal", "personal"):
            vals = [_nan_to_none(r.metrics.get(dev_id, {}).get(key)) for r in reports]
            out[key] = vals
            out["final_" + key] = vals[-1] if vals else None
    for key in GUARD_KINDS:
        entries = [{"round": r.round, "used": bool(i[f"{key}_used"]), "effect": i.get(f"{key}_effect"),
                    "loss_effect": i.get(f"{key}_loss_effect"),
                    **({"weight": i[f"{key}_weight"]} if f"{key}_weight" in i else {})}
                   for r in reports if f"{key}_used" in (i := r.info.get(dev_id, {}))]
        if entries:
            out[key] = entries
    return out


def divergence(reports: list[RoundReport], dev_id: str) -> dict[str, Any]:
    """A device's divergence-guard record (issue 45, :mod:`fedge.edge.divergence`), when its guard is on: the rounds
    at whose start it undid the last round (``rolled_back``) and how many evaluations the guard judged."""
    judged = [r for r in reports if "rolled_back" in r.metrics.get(dev_id, {})]
    if not judged:
        return {}
    return {"rolled_back": [r.round for r in judged if r.metrics[dev_id]["rolled_back"]],
            "divergence_checks": len(judged)}


def write_results(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write results.json, accuracy.png, traffic.png and (with a virtual clock) time_to_accuracy.png in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "accuracy.png", out / "traffic.png"]
    paths[0].write_text(json.dumps(results, indent=1))

    fig, ax = plt.subplots(figsize=(7, 4))
    for d in results["devices"]:
        pts = [(r, a) for r, a in enumerate(d["acc_global"]) if a is not None]
        if pts:
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=".", label=f"{d['id']} ({d['arch']})")
    ax.set_xlabel("round")
    ax.set_ylabel("global test accuracy (%)")
    ax.set_title(f"{results['method']} on {results['dataset']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ids = [d["id"] for d in results["devices"]]
    ups = [sum(d["bytes_up"]) / 1024 for d in results["devices"]]
    downs = [sum(d["bytes_down"]) / 1024 for d in results["devices"]]
    xs = range(len(ids))
    ax.bar([x - 0.2 for x in xs], ups, width=0.4, label="up")
    ax.bar([x + 0.2 for x in xs], downs, width=0.4, label="down")
    ax.set_xticks(list(xs), ids, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("KiB over the run (encoded)")
    ax.set_title("traffic per device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    if results.get("time_to_accuracy"):
        paths.append(out / "time_to_accuracy.png")
        plot_time_to_accuracy(results, paths[-1])
    return paths


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def format_table(results: dict[str, Any]) -> str:
    """The per-device summary table the CLI prints (with the personal head's and the guard's columns
    when the method reports them), then the run's summary in lines."""
    return "\n".join([*_device_table(results["devices"]), "", *_summary_lines(results),
                      *_virtual_time_lines(results), *_backend_and_privacy_lines(results)])


def _device_table(devs: list[dict[str, Any]]) -> list[str]:
    """One row per device, under a header and a rule; optional columns only where a device reports them."""
    personal = any("final_personal" in d for d in devs)
    guard = any("guard" in d for d in devs)
    stem = any("guard_stem" in d for d in devs)
    header = ["device", "profile", "model", "params", "acc global %", "best %", "acc local %"]
    header += ["local, federated %", "predictor"] if personal else []
    header += ["synthetic kept"] if guard else []
    header += ["fleet stem kept"] if stem else []
    header += ["up", "down", "prec"]
    clocked = any("busy_share" in d for d in devs)
    offline = any(d.get("offline_share", 0) > 0 for d in devs)
    header += (["busy %", "idle %"] + (["offline %"] if offline else [])) if clocked else []
    rows = [header]
    for d in devs:
        row = [d["id"], d["profile"], d["arch"], f"{d['params']:,}" if d["params"] else "-",
               _pct(d["final_acc_global"]), _pct(d["best_acc_global"]), _pct(d["final_acc_local"])]
        if personal:
            chosen = d.get("final_personal")
            row += [_pct(d.get("final_acc_local_generic")),
                    "-" if chosen is None else ("personal" if chosen else "federated")]
        for key, shown in (("guard", guard), ("guard_stem", stem)):
            if shown:
                g = d.get(key, [])
                row.append(f"{sum(x['used'] for x in g)}/{len(g)}")
        row += [format_bytes(sum(d["bytes_up"])), format_bytes(sum(d["bytes_down"])), d["upload_precision"]]
        if clocked:
            row += [_pct(d.get("busy_share")), _pct(d.get("idle_share"))]
            row += [_pct(d.get("offline_share"))] if offline else []
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _summary_lines(results: dict[str, Any]) -> list[str]:
    """The run's accuracy, the personal predictor's, the guards' decisions and the planner's trades."""
    devs = results["devices"]
    personal = any("final_personal" in d for d in devs)
    guard = any("guard" in d for d in devs)
    stem = any("guard_stem" in d for d in devs)
    s = results["summary"]
    lines = [f"{results['method']} on {results['dataset']}, {results['rounds']} rounds, "
             f"{results['seconds']:.1f} s: mean global accuracy {_pct(s['mean_final_acc_global'])} % "
             f"(best {_pct(s['mean_best_acc_global'])} %), local {_pct(s['mean_final_acc_local'])} %"]
    if personal:
        lines.append(f"personal predictor chosen on {s['personal_devices']} of {len(devs)} devices; local accuracy "
                     f"with the federated model {_pct(s['mean_final_acc_local_generic'])} %, global accuracy "
                     f"with the chosen predictor {_pct(s['mean_final_acc_global_personal'])} %")
    if guard:
        lines.append(f"guard: synthetic samples kept in {s['guard_used']} of {s['guard_decisions']} device-rounds")
    if stem:
        lines.append(f"guard: the fleet's extractor kept in {s['guard_stem_used']} of {s['guard_stem_decisions']} "
                     "device-rounds (else the group's own)")
    if "rollbacks" in s:
        undone = [f"{d['id']} (round {', '.join(map(str, d['rolled_back']))})" for d in devs if d.get("rolled_back")]
        lines.append(f"divergence guard: {s['rollbacks']} of {s['divergence_checks']} device-rounds undone"
                     + (f": {'; '.join(undone)}" if undone else ""))
    lines += trade_lines(results.get("tier_trades", []))
    return lines


def _virtual_time_lines(results: dict[str, Any]) -> list[str]:
    """The virtual clock, time to accuracy and the fleet's energy (a run with a clock)."""
    lines: list[str] = []
    ck = results.get("clock")
    if ck:
        lost = sum(len(v) for v in ck["lost"].values())
        lines.append(f"virtual time: {ck['virtual_s']:.1f} s ({ck['mean_round_s']:.1f} s per round; availability "
                     f"{ck['availability']}, jitter {ck['jitter']:g}"
                     + (f", deadline {ck['deadline_s']:g} s" if ck["deadline_s"] else "")
                     + (f"; {lost} update(s) lost to the clock" if lost else "") + ")")
    curve = results.get("time_to_accuracy")
    if curve:
        last, level = curve[-1], TARGET_SHARE * curve[-1]["mean_acc_global"]
        reached = time_to(curve, level)
        kind = "every device at fixed moments" if ck and ck.get("mode") == "async" else "the devices of each round"
        lines.append(f"time to accuracy ({kind}; {len(curve)} points over up to "
                     f"{max(p['devices'] for p in curve)} devices): {_pct(last['mean_acc_global'])} % at "
                     f"{last['virtual_s']:.1f} virtual s; {100 * TARGET_SHARE:g} % of it ({_pct(level)} %) first at "
                     f"{'-' if reached is None else f'{reached:.1f}'} s")
        e = ck["energy"] if ck else {}
        if e and e["devices_without_power"] < len(results["devices"]):
            to = e.get("fleet_j_to_target")
            lines.append(f"energy: {e['fleet_j']:.0f} J for the fleet ({e['task_j']:.0f} J of it tasks), "
                         f"{'-' if to is None else f'{to:.0f}'} J to {_pct(level)} %"
                         + (f"; {e['devices_without_power']} device(s) without a [power] model left out"
                            if e["devices_without_power"] else ""))
    return lines


def _backend_and_privacy_lines(results: dict[str, Any]) -> list[str]:
    """A parallel backend's workers and losses; the privacy ledger's ε."""
    lines: list[str] = []
    sim = results.get("simulation") or {}
    if sim.get("backend", "sequential") != "sequential":
        workers = sim.get("workers", [])
        peaks = ", ".join(format_bytes(w["peak_rss_bytes"]) for w in workers if "peak_rss_bytes" in w)
        overhead_ms = 1000 * (sim.get("mean_round_overhead_s") or 0)
        lines.append(f"{sim['backend']} backend: {len(workers)} workers (peak RSS {peaks or '-'}), start-up "
                     f"{sim.get('start_s', 0):.1f} s, driver overhead {overhead_ms:.0f} ms per round")
        for dev, why in sorted(sim.get("lost", {}).items()):
            lines.append(f"lost {dev}: {why}")
    p = results.get("privacy")
    if p:
        eps = "∞" if p["epsilon"] is None else f"{p['epsilon']:.3g}"
        lines.append(f"privacy: ε = {eps} at δ = {p['delta']:g} after {p['training_rounds_released']} rounds "
                     f"(noise multiplier {p['noise_multiplier']:.3g}, clip {p['clip']:g}, σ clip {p['sigma_clip']:g})"
                     + (", budget spent" if p["budget_spent"] else ""))
    return lines
