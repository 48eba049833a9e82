"""``fedge compare RUN_A RUN_B``: two simulated runs side by side in virtual time (issue 39).

How asynchronous mode is judged: does it reach an accuracy sooner than synchronous rounds on the same fleet? Each
run's ``time_to_accuracy`` (results.json; asynchronous runs: the fleet curve, :mod:`fedge.sim.clocked_async`) is
read at one level — ``--target`` percent, by default 95 % of the better of the two final accuracies — and the ratio
of the two times says how many times sooner one got there. Beside it: final accuracies, virtual seconds, bytes moved
and busy / idle / offline shares per profile; and one plot with both curves against virtual time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.common.units import format_bytes
from fedge.errors import ConfigError
from fedge.sim.virtual_time import TARGET_SHARE, time_to


@dataclass(frozen=True)
class RunSide:
    """One run's figures in a comparison."""

    label: str
    results: dict[str, Any]
    final_acc: float
    time_to_target: float | None

    @property
    def curve(self) -> list[dict[str, Any]]:
        return list(self.results["time_to_accuracy"])

    @property
    def mode(self) -> str:
        return str(self.results["clock"].get("mode", "sync"))

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """(bytes up, bytes down) over the run, every device."""
        devs = self.results["devices"]
        return sum(sum(d["bytes_up"]) for d in devs), sum(sum(d["bytes_down"]) for d in devs)

    def shares(self) -> dict[str, dict[str, float]]:
        """Profile -> mean busy / idle / offline share of its devices."""
        by: dict[str, list[dict[str, Any]]] = {}
        for d in self.results["devices"]:
            if "busy_share" in d:
                by.setdefault(d["profile"], []).append(d)
        return {p: {k: sum(d[f"{k}_share"] for d in ds) / len(ds) for k in ("busy", "idle", "offline")}
                for p, ds in by.items()}


@dataclass(frozen=True)
class Comparison:
    """Two runs read at one accuracy level."""

    a: RunSide
    b: RunSide
    level: float
    """The accuracy (a fraction) both runs' times are read at."""
    chosen: bool = False
    """Whether ``level`` was asked for (``--target``), not 95 % of the better final accuracy."""

    @property
    def ratio(self) -> float | None:
        """Time to ``level`` of A over B's: how many times sooner B got there (None: one never did)."""
        ta, tb = self.a.time_to_target, self.b.time_to_target
        if ta is None or tb is None:
            return None
        return math.inf if tb == 0 else ta / tb


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """A finished ``fedge simulate`` run's results.json, checked for what a comparison reads."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no results.json: it is not the output of a finished `fedge simulate`",
                          hint="pass the --out directory of a finished run (where results.json was written)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}",
                          hint="re-run the simulation; the file was cut short or edited") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        raise ConfigError(f"{path} is not a run's results (no devices list)",
                          hint="pass a `fedge simulate` --out directory")
    if not doc.get("time_to_accuracy"):
        raise ConfigError(f"{path} has no time_to_accuracy: the run had no virtual time (over MQTT) or evaluated "
                          "nothing",
                          hint="simulate both runs in-process (--transport inprocess), where the virtual clock runs")
    return doc


def compare_runs(a: dict[str, Any], b: dict[str, Any], *, target: float | None = None,
                 labels: tuple[str, str] = ("A", "B")) -> Comparison:
    """Read runs ``a`` and ``b`` (results.json documents) at ``target`` (a fraction; None: 95 % of the better
    final accuracy). Refuses runs of different data sets: their accuracies are not on one scale."""
    if a.get("dataset") != b.get("dataset"):
        raise ConfigError(f"run {labels[0]} is on {a.get('dataset')!r} and run {labels[1]} on {b.get('dataset')!r}: "
                          "accuracies on different test sets cannot be compared",
                          hint="compare two runs of the same dataset (e.g. one fleet config run with and without "
                               '[coordinator] mode = "async")')
    if target is not None and not 0 < target <= 1:
        raise ConfigError(f"--target {100 * target:g}: an accuracy in percent, above 0 and at most 100",
                          hint="e.g. --target 80")
    finals = [doc["time_to_accuracy"][-1]["mean_acc_global"] for doc in (a, b)]
    level = TARGET_SHARE * max(finals) if target is None else target
    sides = [RunSide(label, doc, final, time_to(doc["time_to_accuracy"], level))
             for label, doc, final in zip(labels, (a, b), finals, strict=True)]
    return Comparison(sides[0], sides[1], level, chosen=target is not None)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _t(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f}"


def format_comparison(c: Comparison) -> str:
    """The table ``fedge compare`` prints."""
    rows = [["", f"A: {c.a.label}", f"B: {c.b.label}"]]
    for name, get in (
        ("method / mode", lambda s: f"{s.results['method']} / {s.mode}"),
        ("final accuracy %", lambda s: _pct(s.final_acc)),
        (f"time to {_pct(c.level)} % (virtual s)", lambda s: _t(s.time_to_target)),
        ("virtual s", lambda s: f"{s.results['clock']['virtual_s']:.2f}"),
        ("curve points (devices each)", lambda s: f"{len(s.curve)} ({min(p.get('devices', 0) for p in s.curve)}"
                                                  f"-{max(p.get('devices', 0) for p in s.curve)})"),
        ("bytes up / down", lambda s: " / ".join(format_bytes(n) for n in s.bytes_moved)),
    ):
        rows.append([name, get(c.a), get(c.b)])
    sa, sb = c.a.shares(), c.b.shares()
    for profile in [*sa, *(p for p in sb if p not in sa)]:
        row = [f"busy / idle / offline % {profile}"]
        for s in (sa, sb):
            x = s.get(profile)
            row.append("-" if x is None else " / ".join(f"{100 * x[k]:.0f}" for k in ("busy", "idle", "offline")))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                   strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    how = "--target" if c.chosen else f"{100 * TARGET_SHARE:g} % of the better final accuracy"
    lines.append("")
    r = c.ratio
    if r is None:
        who = " and ".join(s.label for s in (c.a, c.b) if s.time_to_target is None)
        lines.append(f"ratio A/B: - ({who} never reached {_pct(c.level)} %, {how})")
    else:
        faster, factor = (c.b, r) if r >= 1 else (c.a, 1 / r)
        lines.append(f"ratio A/B: {r:.2f}x — {faster.label} reached {_pct(c.level)} % ({how}) {factor:.2f}x sooner "
                     "in virtual time")
    return "\n".join(lines)


def plot_comparison(c: Comparison, path: str | Path) -> Path:
    """Both runs' fleet mean accuracy against virtual time, the level marked: one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for side, style in ((c.a, "C0.-"), (c.b, "C1.-")):
        curve = side.curve
        ax.plot([p["virtual_s"] for p in curve], [100 * p["mean_acc_global"] for p in curve], style,
                label=f"{side.label} ({side.results['method']}, {side.mode})")
        if side.time_to_target is not None:
            ax.axvline(side.time_to_target, color=style[:2], ls=":", lw=1)
    ax.axhline(100 * c.level, color="grey", ls="--", lw=1, label=f"{_pct(c.level)} %")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("global test accuracy (%), fleet mean")
    ax.set_title(f"{c.a.results['dataset']}: time to accuracy"
                 + (f" (A/B = {c.ratio:.2f}x)" if c.ratio is not None else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
