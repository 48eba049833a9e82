"""The planner's model-tier trades in a run's results (issue 48): what each device gave up, or did not.

Each device's plan already holds its full ``trade`` (:class:`fedge.profiles.tier_choice.Trade`); results.json
also gets ``tier_trades``, one short record per device, and the CLI's report one line per device whose tier is
not the largest its memory holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def tier_trades(devices: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per device whose plan carries a trade: the largest tier memory holds against the tier
    chosen, with the expected time (s) and local accuracy (%) of both."""
    out = []
    for d in devices:
        t = (d.get("plan") or {}).get("trade")
        if not t:
            continue
        big, mine = t["largest"], t["chosen"]
        out.append({"id": d["id"], "mode": t["mode"], "budget_s": round(t["budget_s"], 1), "pinned": t["pinned"],
                    "largest_tier": big["tier"], "largest_time_s": big["full_time_s"], "largest_acc": big["full_acc"],
                    "chosen_tier": mine["tier"], "chosen_time_s": mine["time_s"], "chosen_acc": mine["acc"],
                    "budget_met": t["budget_met"]})
    return out


def trade_lines(trades: Sequence[Mapping[str, Any]]) -> list[str]:
    """Report lines: every device that trains a smaller tier than its memory holds, and any budget not met."""
    def acc(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} %"

    lines = []
    for t in trades:
        if t["chosen_tier"] == t["largest_tier"] and t["budget_met"]:
            continue
        how = "pinned" if t["pinned"] else "chose"
        lines.append(f"planner: {t['id']} {how} tier-{t['chosen_tier']} (expected {acc(t['chosen_acc'])} in "
                     f"{t['chosen_time_s']:.1f} s) over tier-{t['largest_tier']}, the largest its memory holds "
                     f"(expected {acc(t['largest_acc'])} in {t['largest_time_s']:.1f} s; {t['mode']} budget "
                     f"{t['budget_s']:g} s)" + ("" if t["budget_met"] else ": the time budget cannot be met"))
    return lines
