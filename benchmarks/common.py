"""Shared helpers of the benchmarks: paths, resumable JSON cells, paired statistics, tables, docs sections."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # the repository: examples/, docs/, the source tree
RESULTS = REPO / "benchmarks" / "results"
DOCS_RESULTS = REPO / "docs" / "results.md"


def load_cell(path: Path, expect: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The JSON cell at ``path``, or None if it is missing or was computed with other settings.

    ``expect``: entries the saved cell must hold (e.g. its method config); a cell saved under
    other settings is stale, so it is recomputed rather than silently reported.
    """
    if not path.is_file():
        return None
    saved = dict(json.loads(path.read_text()))
    stale = {k: saved.get(k) for k, v in (expect or {}).items() if saved.get(k) != v}
    if stale:
        print(f"  {path.name} was computed with other settings {stale}", flush=True)
        return None
    return saved


def cached_cell(path: Path, compute: Callable[[], dict[str, Any]], *, force: bool = False,
                expect: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the saved cell at ``path`` (resume after interruption), else compute and save it."""
    saved = None if force else load_cell(path, expect)
    if saved is not None:
        return saved
    out = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    return out


def paired_by_seed(cells: Sequence[dict], ref: Sequence[dict], metric: str) -> dict[int, float]:
    """``metric`` of each cell minus the reference cell of the same seed, in points, by seed, on the seeds
    both have (cells without the metric are left out)."""
    by_seed = {c["seed"]: 100 * c[metric] for c in ref if c.get(metric) is not None}
    return {c["seed"]: 100 * c[metric] - by_seed[c["seed"]] for c in sorted(cells, key=lambda c: c["seed"])
            if c["seed"] in by_seed and c.get(metric) is not None}


def paired_models(cells: Sequence[dict], ref: Sequence[dict], metric: str = "per_model_best") -> list[float]:
    """Each model's ``metric`` minus the same device's in the reference cell of the same seed, in points:
    one difference per (seed, device) both cells hold. On table 1 every device trains its own
    architecture on its own shard, so these pairs share data, architecture and initialisation."""
    by_seed = {c["seed"]: c.get(metric) or {} for c in ref}
    return [100 * (v - by_seed[c["seed"]][dev]) for c in sorted(cells, key=lambda c: c["seed"])
            for dev, v in sorted((c.get(metric) or {}).items()) if dev in by_seed.get(c["seed"], {})]


def mean_ci(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean of ``diffs`` and its Student-t ``level`` confidence interval (low, high); NaN below two values."""
    if len(diffs) < 2:
        return float("nan"), float("nan"), float("nan")
    from scipy import stats  # scikit-learn's dependency; imported here so the other scripts need neither

    mean = statistics.fmean(diffs)
    half = float(stats.t.ppf(0.5 + level / 2, len(diffs) - 1)) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return mean, mean - half, mean + half


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def write_docs_section(name: str, body: str, path: Path = DOCS_RESULTS) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in docs/results.md."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def run_sampled(cmd: Sequence[str], sample: Callable[[int], None], *, every: float,
                env: Mapping[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (its stdout captured as text) while a thread calls ``sample(pid)`` every ``every`` seconds,
    e.g. to follow the child's memory or the machine's load while it runs."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, text=True, env=env, cwd=cwd)
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            sample(proc.pid)
            done.wait(every)

    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate()
    finally:
        done.set()
        sampler.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def child_command(sub: Any, name: str, ints: Sequence[str] = (), strs: Sequence[str] = ()) -> argparse.ArgumentParser:
    """A benchmark's child-process subcommand ``name`` (``sub``: ``add_subparsers()``): required integer options
    ``ints`` and required string options ``strs``."""
    cmd: argparse.ArgumentParser = sub.add_parser(name)
    for a in ints:
        cmd.add_argument(a, type=int, required=True)
    for a in strs:
        cmd.add_argument(a, required=True)
    return cmd
