"""Running the generative benchmark's cells: one simulation per (row, seed, precision), saved as JSON
under ``benchmarks/results/generative/`` as soon as it finishes, so an interrupted run resumes. A cell
checkpoints after every round (:mod:`benchmarks.generative.checkpoint`), so an interrupted cell resumes
at the round where it stopped."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, cached_cell, load_cell
from benchmarks.generative.checkpoint import Fork, checkpoint_dir, discard, kept_path, run_resumable
from benchmarks.generative.quality import synthetic_accuracy
from benchmarks.generative.rows import Method, fork_round
from fedge.fleet.config import FleetConfig
from fedge.sim.report import GUARD_KINDS, build_results
from fedge.sim.simulate import simulate

OUT = RESULTS / "generative"
Make = Callable[[Method, int], tuple[FleetConfig, str | None]]  # a row and a seed -> its config and precision


def with_precision(cfg: FleetConfig, precision: str | None) -> FleetConfig:
    """``cfg`` with every device uploading at ``precision`` (None: what the planner derives from the uplink)."""
    if precision is None:
        return cfg
    return dataclasses.replace(cfg, devices=tuple(dataclasses.replace(g, upload_precision=precision)
                                                  for g in cfg.devices))


# Set on a cell measured before issue 25 (every device from its own seed), shown only by --report-only.
BEFORE_SHARED_START = "before_shared_start"
# What the tables append to such a row's label, and the legend docs_body adds.
BEFORE_MARK = " ‡"
BEFORE_LEGEND = ("‡ Measured before issue 25, when every device started from its own seed: the row averages "
                 "weights, so its figure is not current until the table's command re-runs it.")


def init_of(cfg: FleetConfig) -> str:
    """Where the cell's models started (issue 25): ``per-device``, ``group`` or ``group+extractor``."""
    return cfg.method_config.shared_start().describe()


def run_cell(cfg: FleetConfig, precision: str | None = None, *, checkpoint: Path | None = None,
             expect: dict[str, Any] | None = None, keep: Collection[int] = (), fork: Fork | None = None,
             after_round: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Simulate one cell and keep what the tables report (accuracies, bytes, the accuracy curve, wall time).

    With ``checkpoint`` (a directory) the cell checkpoints there after every round and resumes from it
    (``expect``: the settings the checkpoint must have been written under; ``after_round``: called after each
    round's checkpoint; ``keep``, ``fork``: :func:`~benchmarks.generative.checkpoint.run_resumable`'s); the
    checkpoint is removed once the cell's figures are made. ``wall_seconds`` is then
    the sum over the sessions, and ``sessions`` says which rounds each one ran.
    """
    t0 = time.perf_counter()
    sessions: dict[str, Any] = {}
    if checkpoint is None:
        res = simulate(with_precision(cfg, precision))
        wall = time.perf_counter() - t0
    else:
        res, sessions = run_resumable(with_precision(cfg, precision), checkpoint, expect or {}, keep=keep,
                                      fork=fork, after_round=after_round)
        wall = res.seconds
    out = build_results(res)
    rounds = cfg.run.rounds
    quality = synthetic_accuracy(res.devices, seed=cfg.run.seed)
    if checkpoint is not None:
        discard(checkpoint)
    return {
        "method": cfg.run.method, "config": cfg.method, "seed": cfg.run.seed, "rounds": rounds,
        "init": init_of(cfg),
        "precision": precision or "plan",
        "mean_best_acc": out["summary"]["mean_best_acc_global"],
        "mean_final_acc": out["summary"]["mean_final_acc_global"],
        "mean_final_acc_local": out["summary"]["mean_final_acc_local"],
        "per_model_best": {d["id"]: d["best_acc_global"] for d in out["devices"]},
        "bytes_up_per_device_round": out["summary"]["mean_bytes_up_per_round"],
        "bytes_down_per_device_round": out["summary"]["mean_bytes_down_per_round"],
        "acc_curve": [sum(x for x in col if x is not None) / max(1, sum(x is not None for x in col))
                      if any(x is not None for x in col) else None
                      for col in zip(*(d["acc_global"] for d in out["devices"]), strict=True)],
        "wall_seconds": wall,
        "seconds_per_round": out["seconds_per_round"],
        **sessions,
        # the generator's samples: a fresh CNN-1 trained on them, scored on real test data (quality.py)
        **({"synthetic_accuracy": quality} if quality is not None else {}),
        # Per device (issue 17): both accuracies, and with a personal head or the guard their decisions.
        "per_device": {d["id"]: {k: d.get(k) for k in (
            "final_acc_local", "final_acc_global", "final_acc_local_generic", "final_acc_global_personal",
            "final_personal", "num_train") if k in d}
            | {f"{key}_{part}": n for key in GUARD_KINDS if d.get(key)
               for part, n in (("used", sum(g["used"] for g in d[key])), ("decisions", len(d[key])))}
            for d in out["devices"]},
        **{k: v for k, v in out["summary"].items() if k.startswith(("mean_final_acc_", "guard_", "personal_"))},
    }


def collect(table: str, methods: dict[str, Method], keys: list[str], seeds: list[int],
            make: Make, *, tag: str = "", force: bool = False,
            report_only: bool = False) -> dict[str, list[dict]]:
    """Every (method, seed) cell of a table: loaded if saved with the same settings, else computed
    (``report_only``: skipped). ``make`` gives a row's fleet config and upload precision for a seed.

    A row with ``fork`` starts from its base row's checkpoint of the last round they share, when the base
    cell has kept one (it keeps the rounds any row of ``methods`` forks at), else from round 1."""
    cells: dict[str, list[dict]] = {}
    before: dict[str, list[dict]] = {}  # report only: cells of averaging rows measured before issue 25

    def cell(key: str, seed: int) -> tuple[Path, FleetConfig, str | None, dict[str, Any]]:
        m = methods[key]
        cfg, prec = make(m, seed)
        expect = {"config": dict(cfg.method), "rounds": cfg.run.rounds, "precision": prec or "plan"}
        if cfg.method_config.shared_start().shared:
            expect["init"] = init_of(cfg)  # cells of averaging rows measured before issue 25 are stale
        return OUT / table / f"{key}{tag}-s{seed}-r{m.rounds}.json", cfg, prec, expect

    for key in keys:
        keep = [fork_round(f, methods[key]) for f in methods.values() if f.fork == key]
        for seed in seeds:
            path, cfg, prec, expect = cell(key, seed)
            if report_only:
                if (done := load_cell(path, expect)) is not None:
                    cells.setdefault(key, []).append(done)
                elif "init" in expect and (old := load_cell(path, _without(expect, "init"))) is not None:
                    before.setdefault(key, []).append({**old, BEFORE_SHARED_START: True})
                continue
            fork = None
            if (base := methods[key].fork) is not None:
                base_path, _, _, base_expect = cell(base, seed)
                fork = Fork(kept_path(checkpoint_dir(base_path), fork_round(methods[key], methods[base])),
                            base_expect)

            ckpt = checkpoint_dir(path)

            def compute(c: FleetConfig = cfg, p: str | None = prec, label: str = f"{table} {key}{tag} seed {seed}",
                        ckpt: Path = ckpt, e: dict[str, Any] = expect, k: list[int] = keep,
                        f: Fork | None = fork) -> dict[str, Any]:
                print(f"[{time.strftime('%H:%M:%S')}] {label} ...", flush=True)  # only cells actually run
                return run_cell(c, p, checkpoint=ckpt, expect=e, keep=k, fork=f)

            cells.setdefault(key, []).append(cached_cell(path, compute, force=force, expect=expect))
    # A row not yet re-measured since issue 25 is shown from its old cells, marked; a row with any new
    # cell shows only new ones (never a mean over both starts).
    return {k: cells.get(k) or before[k] for k in keys if k in cells or k in before}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}
