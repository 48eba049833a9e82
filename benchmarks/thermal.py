"""The thermal guard (issue 44): a fleet whose hottest profile throttles, with and without the guard, against the same
fleet that never throttles.

One fleet of ``--per-profile`` devices each of three profiles: ``rpi4-4gb`` (the slowest: 0.144 s of compute a
task), ``rpi5-8gb`` and ``x86-gateway``, always online; FedAvg on tier-xs (one averaging group) on scikit-learn's
digits with Dirichlet label skew, ``--rounds`` rounds of ``--sample`` devices chosen by ``selection = "oort"`` with
:data:`PREFERRED_S` (no straggler penalty: Oort chooses by statistical utility, so the devices with the most loss
are tasked round after round, and the slowest ones compute through most of each round). Three runs per seed, the
same but for heat:

* ``cool``: no ``[thermal]`` table anywhere: nothing throttles;
* ``throttled``: the Pi 4s in a hot enclosure (a copy of ``rpi4-4gb`` with :data:`HOT_BOX` as its ``[thermal]``):
  a Pi 4 that works back to back heats past its limit and computes at 0.6x its speed until it has cooled below its
  ``resume_c``; the guard off;
* ``guarded``: the same with ``thermal_guard = true``: a hot Pi 4 is not tasked until it has cooled.

The thermal time constant is scaled to the workload: a digits task on tier-xs computes for ~0.1-0.3 virtual seconds
on a Pi 4, where a real board's constant is minutes, so the box's ``tau_s`` is 0.2 s, and its resistance puts the
busy steady state 15 °C over the limit and the idle one 10 °C under the resume point: a Pi 4 tasked in consecutive
rounds throttles, one left idle for a round or two cools. What is measured is the schedule's cost, not a
board's physics.

The target accuracy is a share (``--target``) of the cool run's final fleet mean, the same for all; per run:
virtual seconds to it, the whole run's virtual seconds, the Pi 4s' tasks and how many of them ran throttled, and
the rounds a hot device was held. Issue 44's target: the guarded run's time to target within 1.2x the cool run's.

    python -m benchmarks.thermal [--seeds 0 1] [--rounds 30] [--sample 8] [--per-profile 6] [--wide]

``--wide``: issue 44's fleet for its targets instead, the six built-ins of ``benchmarks.energy`` (the Pi 4s in the
hot box) with its on/off churn.

Writes benchmarks/results/thermal-nN-rR-kK-sSEEDS.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, text_table
from benchmarks.energy import PROFILES as ENERGY_PROFILES
from benchmarks.energy import fedavg_digits

RUNS = ("cool", "throttled", "guarded")
PROFILES = ("rpi4-4gb", "rpi5-8gb", "x86-gateway")
WIDE = ENERGY_PROFILES
"""``--wide``: the six built-ins of the energy benchmark (Pi Zero 2 W and Pi 3 B on slow links, the Jetson Nano)
with on/off churn: issue 44's fleet of >= 50 devices of >= 6 profiles."""
CHURN = '\n[clock]\navailability = "onoff"\nonline_mean_s = 120\noffline_mean_s = 40\n'
"""``--wide``'s availability: as the energy benchmark's."""
HOT = "rpi4-hot-box"
HOT_BOX = {"c_per_w": 10.0, "tau_s": 0.2, "ambient_c": 25.0, "limit_c": 74.0, "resume_c": 62.0,
           "throttle_share": 0.6}
"""The hot Pi 4's ``[thermal]``: idle (2.7 W) it settles at 52 °C, busy (6.4 W) it would reach 89 °C."""
PREFERRED_S = 1.0
"""``preferred_round_s``: above every device's task, so Oort's straggler penalty never applies and it chooses by
statistical utility alone (a fleet that sets its preferred round to its deadline)."""


HELD_KINDS = {"throttling": "firmware throttles", "at limit": "at or above its limit",
              "not yet cooled": "not yet cooled"}


def fleet_config(run: str, *, seed: int, rounds: int, sample: int, per_profile: int, work: Path,
                 wide: bool = False) -> Path:
    """The fleet config of one run (and the hot Pi 4's profile beside it); returns its path. ``wide``: the six
    profiles of :data:`WIDE` with churn."""
    from fedge.profiles import builtin_dir

    pi4 = (builtin_dir() / "rpi4-4gb.toml").read_text().replace('name = "rpi4-4gb"', f'name = "{HOT}"')
    pi4 += "\n[thermal]\n" + "".join(f"{k} = {v!r}\n" for k, v in HOT_BOX.items())
    (work / f"{HOT}.toml").write_text(pi4)
    profiles = [f"{HOT}.toml" if p == "rpi4-4gb" and run != "cool" else p for p in (WIDE if wide else PROFILES)]
    groups = "".join(f'\n[[devices]]\nprofile = "{p}"\ncount = {per_profile}\narch = "tier-xs"\nid_prefix = '
                     f'"{p.removesuffix(".toml").replace(HOT, "rpi4-4gb")}"\n' for p in profiles)
    text = fedavg_digits(f"thermal-{run}-s{seed}", seed=seed, rounds=rounds) + (CHURN if wide else "") + f"""
[coordinator]
sample = {sample}
selection = "oort"
preferred_round_s = {PREFERRED_S}
thermal_guard = {"true" if run == "guarded" else "false"}
{groups}"""
    path = work / f"{run}-s{seed}.toml"
    path.write_text(text)
    return path


def run(name: str, *, seed: int, rounds: int, sample: int, per_profile: int, wide: bool = False) -> dict[str, Any]:
    """One simulation: its time-to-accuracy curve, the Pi 4s' tasks (throttled or not), the rounds with a hot device
    held and the round lengths."""
    from fedge.fleet.config import load_fleet
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    with tempfile.TemporaryDirectory() as tmp:
        path = fleet_config(name, seed=seed, rounds=rounds, sample=sample, per_profile=per_profile, work=Path(tmp),
                            wide=wide)
        t0 = time.perf_counter()
        res = simulate(load_fleet(path), out_dir=None)
        doc = build_results(res)
    assert res.clock is not None
    pi4 = [d for d in doc["devices"] if d["id"].startswith("rpi4-4gb")]
    tasks = [v for d in pi4 for v in d["virtual"] if v is not None]
    held = [r.get("hot", []) for r in doc["rounds_log"]]
    why: dict[str, int] = {}  # why the guard held them: the kinds of fedge.common.heat.HeatGuard's reasons
    for r in doc["rounds_log"]:
        for d in r.get("hot", []):
            text = r["selection"][d]
            kind = next((k for k, words in HELD_KINDS.items() if words in text), "other")
            why[kind] = why.get(kind, 0) + 1
    return {"run": name, "seed": seed, "rounds": rounds, "sample": sample, "devices": len(doc["devices"]),
            "curve": doc["time_to_accuracy"], "final_acc": doc["time_to_accuracy"][-1]["mean_acc_global"],
            "virtual_s": res.clock.now, "pi4_tasks": len(tasks), "pi4_throttled": sum(bool(v["throttled"])
                                                                                       for v in tasks),
            "pi4_max_temp_c": max((v["temp_c"] for v in tasks if v["temp_c"] is not None), default=None),
            "rounds_with_held": sum(bool(h) for h in held), "held": sum(len(h) for h in held), "held_why": why,
            "round_s": [r["virtual_end_s"] - r["virtual_start_s"] for r in doc["rounds_log"]
                        if "virtual_end_s" in r],
            "wall_s": time.perf_counter() - t0}


def reach(r: dict[str, Any], level: float) -> float | None:
    """Virtual seconds at the first point of ``r``'s curve at ``level`` (None: never)."""
    return next((p["virtual_s"] for p in r["curve"] if p["mean_acc_global"] >= level), None)


def summarise(runs: dict[str, dict[str, Any]], target: float) -> dict[str, Any]:
    """One seed: the target level, each run's time to it, and the ratios to the cool run."""
    level = target * runs["cool"]["final_acc"]
    at = {k: reach(r, level) for k, r in runs.items()}

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    out = {"level": level, "at": at, "throttled_ratio": ratio(at["throttled"], at["cool"]),
           "guarded_ratio": ratio(at["guarded"], at["cool"]),
           "run_s_ratio": {k: ratio(r["virtual_s"], runs["cool"]["virtual_s"]) for k, r in runs.items()}}
    g = out["guarded_ratio"]
    out["met"] = g is not None and g <= 1.2
    return out


def print_table(res: dict[str, Any]) -> None:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    rows = []
    for seed, s in res["seeds"].items():
        for name in RUNS:
            r = res["runs"][seed][name]
            rows.append([seed, name, f(100 * r["final_acc"], ".1f"), f(s["at"][name], ".2f"),
                         f(r["virtual_s"], ".2f"), f(s["run_s_ratio"][name], ".2f"),
                         f"{r['pi4_throttled']}/{r['pi4_tasks']}", f(r["pi4_max_temp_c"], ".1f"),
                         f"{r['held']} in {r['rounds_with_held']}"])
    print(text_table(["seed", "run", "final acc %", "s to target", "run s", "run s / cool", "Pi 4 tasks throttled",
                      "Pi 4 max start °C", "held (device-rounds)"], rows))
    for seed, runs in res["runs"].items():
        print(f"seed {seed}: the guard held, by reason: {runs['guarded']['held_why']}")
    for seed, s in res["seeds"].items():
        print(f"seed {seed}: target {100 * s['level']:.1f} %; to it, throttled {f(s['throttled_ratio'], '.2f')}x, "
              f"guarded {f(s['guarded_ratio'], '.2f')}x the cool fleet's time "
              f"({'met' if s['met'] else 'NOT met'}: guarded <= 1.2x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.thermal", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--sample", type=int, default=8)
    ap.add_argument("--per-profile", type=int, default=6, help="devices of each profile")
    ap.add_argument("--wide", action="store_true", help="six profiles (the energy benchmark's) with on/off churn")
    ap.add_argument("--target", type=float, default=0.95, help="share of the cool run's final accuracy to reach")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"args": vars(args), "hot_box": HOT_BOX, "runs": {}, "seeds": {}}
    for seed in args.seeds:
        runs = {k: run(k, seed=seed, rounds=args.rounds, sample=args.sample, per_profile=args.per_profile,
                       wide=args.wide) for k in RUNS}
        res["runs"][str(seed)] = runs
        res["seeds"][str(seed)] = summarise(runs, args.target)
    n = args.per_profile * len(WIDE if args.wide else PROFILES)
    out = Path(args.out) if args.out else RESULTS / (f"thermal-n{n}{'-wide' if args.wide else ''}-r{args.rounds}-"
                                                     f"k{args.sample}-s{''.join(map(str, args.seeds))}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print_table(res)
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
