"""``fedge simulate``, ``fedge compare`` and ``fedge data stats``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.errors import ConfigError
from fedge.fleet.config import FleetConfig, load_fleet
from fedge.fleet.sim_sections import BACKENDS
from fedge.sim.transports import TRANSPORTS

if TYPE_CHECKING:
    from fedge.coordinator.engine import RoundReport


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="run a whole fleet on this machine",
                       description="Run a fleet config end to end on this machine and report per-device results.")
    p.add_argument("config", help="fleet config (TOML), e.g. examples/digits-fedproto.toml")
    p.add_argument("--out", default="runs/latest", help="output directory (results.json, plots, checkpoints)")
    p.add_argument("--transport", default="inprocess", choices=tuple(TRANSPORTS),
                   help="; ".join(f"{name}: {t.help}" for name, t in TRANSPORTS.items()))
    p.add_argument("--rounds", type=int, help="override [run] rounds")
    p.add_argument("--method", help="override [run] method")
    p.add_argument("--seed", type=int, help="override [run] seed")
    p.add_argument("--data-dir", help="override [run] data_dir")
    p.add_argument("--backend", choices=BACKENDS,
                   help="override [simulation] backend: where the devices train — here one after another "
                        "(sequential), in worker processes (process) or Ray actors (ray)")
    p.add_argument("--workers", type=int, help="override [simulation] workers (default: one per available CPU)")
    p.add_argument("--address", help="override [simulation] address: join the Ray cluster at HOST:PORT ('auto': "
                                      "the one `ray start` runs on this machine); implies --backend ray")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--samples", action="store_true",
                   help="also write an image grid and a checkpoint per generator (samples/, checkpoints/generators/)")
    p.set_defaults(func=_simulate)

    c = sub.add_parser("compare", help="two simulated runs side by side in virtual time",
                       description="Time to a target accuracy of two `fedge simulate` runs (e.g. one fleet "
                                   "synchronous and asynchronous), the ratio, final accuracies, bytes and busy "
                                   "shares; writes one plot with both curves against virtual time (docs/async.md).")
    c.add_argument("run_a", metavar="RUN_A", help="a finished run's --out directory (its results.json)")
    c.add_argument("run_b", metavar="RUN_B", help="the other run's --out directory")
    c.add_argument("--target", type=float, metavar="PCT",
                   help="global accuracy in percent to time both runs to (default: 95 %% of the better final one)")
    c.add_argument("--out", default="compare.png", help="the plot (PNG) to write (default: compare.png)")
    c.set_defaults(func=_compare)

    d = sub.add_parser("data", help="inspect how a fleet config partitions its data")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    s = dsub.add_parser("stats", help="class histogram of every device's share")
    s.add_argument("config")
    s.add_argument("--data-dir")
    s.set_defaults(func=_stats)


def _override(args: argparse.Namespace) -> FleetConfig:
    """The config file with the command line's overrides applied."""
    import dataclasses

    cfg = load_fleet(args.config)
    changes: dict[str, Any] = {
        k: v
        for k, v in (
            ("rounds", getattr(args, "rounds", None)),
            ("method", getattr(args, "method", None)),
            ("seed", getattr(args, "seed", None)),
            ("data_dir", str(Path(args.data_dir).resolve()) if args.data_dir else None),
        )
        if v is not None
    }
    if changes:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **changes))
    sim: dict[str, Any] = {k: v for k, v in (("backend", getattr(args, "backend", None)),
                                             ("workers", getattr(args, "workers", None)),
                                             ("address", getattr(args, "address", None))) if v is not None}
    if "address" in sim:
        sim.setdefault("backend", "ray")
    if sim:
        try:  # the section validates itself: a bad --workers is the same error as a bad key
            cfg = dataclasses.replace(cfg, simulation=dataclasses.replace(cfg.simulation, **sim))
        except ConfigError as exc:
            raise ConfigError(f"{cfg.source}: [simulation] (command line) {exc.message}", hint=exc.hint) from exc
    return cfg


def _simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fedge.sim.report import build_results, format_table, write_results
    from fedge.sim.simulate import simulate

    cfg = _override(args)
    bar = tqdm(total=cfg.run.rounds + 1, desc=f"{cfg.run.method} rounds", unit="round", disable=args.no_progress)

    def on_round(rep: RoundReport) -> None:
        accs = [m["acc_global"] for m in rep.metrics.values() if "acc_global" in m]
        postfix: dict[str, Any] = {"phase": rep.phase, "devices": len(rep.accepted)}
        if accs:
            postfix["acc"] = f"{100 * sum(accs) / len(accs):.1f}%"
        bar.set_postfix(postfix)
        bar.update(1)

    res = simulate(cfg, transport=args.transport, out_dir=args.out, on_round=on_round)
    bar.close()
    results = build_results(res)
    paths = write_results(results, args.out)
    print(format_table(results))
    print(f"\nwrote {', '.join(str(p) for p in paths)} and {args.out}/checkpoints/")
    if args.samples:
        from fedge.edge.generators.grid import write_sample_grids

        grids = write_sample_grids([d.method for d in res.devices], args.out)
        print(f"wrote {len(grids)} sample grid(s): {', '.join(str(g) for g in grids) or 'no generator was trained'}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from fedge.sim.compare import compare_runs, format_comparison, plot_comparison, read_run

    a, b = read_run(args.run_a), read_run(args.run_b)
    c = compare_runs(a, b, target=None if args.target is None else args.target / 100,
                     labels=(str(args.run_a), str(args.run_b)))
    print(format_comparison(c))
    print(f"\nwrote {plot_comparison(c, args.out)}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from fedge.fleet.devices import class_histograms, load_fleet_data

    args.rounds = args.method = args.seed = None
    cfg = _override(args)
    data = load_fleet_data(cfg)
    classes = data.train.classes
    width = max(5, *(len(c[:7]) for c in classes))
    print(f"{cfg.run.dataset}: partition {cfg.partition.kind}, {cfg.num_devices} devices, seed {cfg.run.seed}")
    print("device".ljust(22) + "".join(c[:7].rjust(width + 1) for c in classes) + "   train  local-test  val")
    for dev_id, tr, te, val in class_histograms(cfg, data):
        counts = "".join(str(int(v)).rjust(width + 1) for v in tr)
        print(dev_id.ljust(22) + counts + f"{int(tr.sum()):8d}{int(te.sum()):12d}{val:5d}")
    return 0
