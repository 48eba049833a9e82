"""``fedge profile list | show | plan``: the built-in device profiles and what each one gets."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from fedge.common.archs import DEFAULT_EMBED_DIM
from fedge.common.catalog import DATASETS
from fedge.profiles.accuracy import available_tasks
from fedge.profiles.loader import list_profiles, load_profile
from fedge.profiles.planner import DEFAULT_SAMPLES, plan
from fedge.profiles.schema import Profile
from fedge.profiles.tier_choice import DEFAULT_ROUNDS, RunBudget


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse._SubParsersAction:
    """Register ``fedge profile`` and its actions; returns the actions, to which :mod:`fedge.cli` adds
    ``probe`` (it measures with the exporter, which this package must not import)."""
    p = sub.add_parser("profile", help="device profiles and their plans",
                       description="List the built-in device profiles, show one, or plan what a device runs.")
    p.set_defaults(func=lambda _args: _usage(p))
    psub = p.add_subparsers(dest="profile_command", metavar="ACTION")

    ls = psub.add_parser("list", help="the built-in profiles, one line each")
    ls.set_defaults(func=_list)

    show = psub.add_parser("show", help="every field of a profile")
    show.add_argument("profile", metavar="NAME|PATH", help="a built-in profile name or a profile .toml file")
    show.set_defaults(func=_show)

    pl = psub.add_parser("plan", help="what the planner chooses for a profile, and why")
    pl.add_argument("profile", metavar="NAME|PATH", help="a built-in profile name or a profile .toml file")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                    help=f"local training samples per round (default {DEFAULT_SAMPLES}, the GeFL protocol)")
    pl.add_argument("--embed-dim", type=int, default=DEFAULT_EMBED_DIM,
                    help=f"fleet-wide embedding size p (default {DEFAULT_EMBED_DIM})")
    pl.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"rounds of the run (default {DEFAULT_ROUNDS})")
    pl.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="the run's time budget, as [run] time_budget_s (default: rounds x budgets.round_time_s)")
    pl.add_argument("--async", dest="asynchronous", action="store_true",
                    help='asynchronous mode ([coordinator] mode = "async"): the device spends the whole budget as '
                         "it likes, a slow device delays nobody")
    pl.add_argument("--task", choices=DATASETS,
                    help=f"weigh the tiers by this data set's measured accuracy curves, as a fleet's [run] dataset "
                         f"does (measured: {', '.join(available_tasks()) or 'none'}; default: none, the largest tier "
                         "whose full schedule fits)")
    pl.add_argument("--tier", metavar="TIER", help="pin the model tier (e.g. tier-m), as [[devices]] arch does")
    pl.set_defaults(func=_plan)
    return psub


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _table(rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> str:
    """Align columns; the last column stays ragged so that long reasons do not pad every line."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    widths[-1] = len(rows[0][-1])
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ghz(x: float) -> str:
    return f"{x:.1f}" if round(x, 1) == x else f"{x:g}"


def _rate(kbps: float) -> str:
    return f"{kbps:,.0f} kbit/s" if kbps < 1000 else f"{kbps / 1000:,.4g} Mbit/s"


def _list(_args: argparse.Namespace) -> int:
    rows = [["name", "cpu", "cores×GHz", "RAM", "uplink", "description"]]
    for name in list_profiles():
        p = load_profile(name)
        hw = p.hardware
        rows.append([p.name, hw.cpu, f"{hw.cores}×{_ghz(hw.clock_ghz)}", f"{hw.ram_mb:,} MB",
                     _rate(p.network.uplink_kbps), p.description])
    print(_table(rows, right=(3, 4)))
    return 0


def _uarch(profile: Profile) -> str:
    """The speed model's core and its figure, e.g. ``cortex-a72, 1.635 MAC/cycle (from hardware.cpu ...)``."""
    from fedge.profiles.speed import speed_model

    s = speed_model(profile)
    return (f"{s.uarch.name}, {s.uarch.mac_per_cycle:g} MAC/cycle/core (from {s.found}); "
            f"peak {s.peak_mac_rate / 1e9:.1f} GMAC/s")


def _show_lines(profile: Profile) -> list[str]:
    hw, net, b = profile.hardware, profile.network, profile.budgets
    fields = [
        ("hardware", [
            ("arch", hw.arch), ("cpu", hw.cpu), ("cores", str(hw.cores)), ("clock_ghz", f"{_ghz(hw.clock_ghz)} GHz"),
            ("ram_mb", f"{hw.ram_mb:,} MiB"), ("int8_dot", "yes" if hw.int8_dot else "no"),
            ("accelerators", ", ".join(hw.accelerators) or "none"),
            ("uarch", _uarch(profile)),
        ]),
        ("network", [
            ("uplink_kbps", f"{net.uplink_kbps:,g} kbit/s"), ("downlink_kbps", f"{net.downlink_kbps:,g} kbit/s"),
            ("latency_ms", f"{net.latency_ms:g} ms"),
        ]),
        ("budgets", [
            ("train_memory_mb", f"{b.train_memory_mb:g} MiB"), ("round_time_s", f"{b.round_time_s:g} s"),
            ("inference_latency_ms", f"{b.inference_latency_ms:g} ms"),
        ]),
    ]
    if profile.measured is not None:
        m = profile.measured
        fields.append(("measured", [(f"latency_ms {k}", f"{v:g} ms") for k, v in m.latency_ms.items()]
                       + [(f"accuracy_drop {k}", f"{v:g} points") for k, v in m.accuracy_drop.items()]
                       + [(f"train_gmac_s {k}", f"{v:g} GMAC/s") for k, v in m.train_gmac_s.items()]))
    if profile.power is not None:
        pw = profile.power
        fields.append(("power", [
            ("idle_w", f"{pw.idle_w:g} W"), ("busy_w", f"{pw.busy_w:g} W"),
            ("link", f"{pw.link}: {pw.up_j_per_byte * 1e6:g} / {pw.down_j_per_byte * 1e6:g} µJ per byte up / down"),
            ("battery_wh", f"{pw.battery_wh:g} Wh, floor {pw.floor_wh:g} Wh" if pw.battery_wh else "none (mains)"),
        ]))
    width = max(len(k) for _, kv in fields for k, _ in kv)
    lines = [f"{profile.name}: {profile.description}"]
    for section, kv in fields:
        lines += ["", f"[{section}]"] + [f"  {k.ljust(width)}  {v}" for k, v in kv]
    return lines


def _show(args: argparse.Namespace) -> int:
    print("\n".join(_show_lines(load_profile(args.profile))))
    return 0


def _trade_line(t: Mapping[str, Any]) -> str:
    """The model-tier trade in one line of figures (the reason holds its words)."""
    big, mine = t["largest"], t["chosen"]

    def acc(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} %"

    line = (f"trade ({t['mode']}, budget {t['budget_s']:.0f} s, {t['rounds']} rounds, task {t['task']}): "
            f"largest tier memory holds tier-{big['tier']}: {big['full_time_s']:.1f} s for its full schedule, "
            f"expected {acc(big['full_acc'])}; chosen tier-{mine['tier']}{' (pinned)' if t['pinned'] else ''}: "
            f"{mine['time_s']:.1f} s, expected {acc(mine['acc'])}")
    return line + ("" if t["budget_met"] else "; the time budget cannot be met (see the model tier's reason)")


def _plan(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    run = RunBudget(rounds=args.rounds, time_budget_s=args.time_budget, asynchronous=args.asynchronous,
                    task=args.task)
    p = plan(profile, embed_dim=args.embed_dim, samples=args.samples, run=run, pin=args.tier)
    if args.json:
        print(json.dumps(p.to_dict(), indent=2))
        return 0
    rows = [["choice", "value", "reason"]]
    for key, label, value in (
        ("model_tier", "model tier", p.arch),
        ("batch_size", "batch size", str(p.batch_size)),
        ("local_epochs", "local epochs", str(p.local_epochs)),
        ("lr", "learning rate", f"{p.lr:g}"),
        ("lr_schedule", "lr schedule", p.lr_schedule),
        ("min_tail", "min tail batch", str(p.min_tail)),
        ("inference_quant", "inference quant", p.inference_quant),
        ("upload_precision", "upload precision", p.upload_precision),
        ("generator_tier", "generator tier", p.generator_tier),
    ):
        rows.append([label, value, p.reasons[key]])
    print(f"plan for {profile.name}: {profile.description}")
    print(f"model {p.arch} (p = {p.embed_dim}): {p.params:,} params, {p.macs:,} MACs per image; "
          f"est. {p.train_memory_mb:.1f} MiB training memory, est. {p.round_time_s:.1f} s per round")
    print(_trade_line(p.trade))
    print()
    print(_table(rows))
    return 0
