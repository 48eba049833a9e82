"""``fedge audit privacy RUN_DIR``: memorization of every generator a run trained."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("audit", help="measure what a finished run reveals",
                       description="Measurements of a finished run's privacy.")
    asub = p.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    a = asub.add_parser("privacy", help="MND memorization ratio of every generator of a run",
                        description="For every generator or decoder the run trained (GeFL, GeFL-F, FedVTC), the "
                                    "mean nearest-neighbour distance ratio of its samples to each device's training "
                                    "images, in pixels and in a fixed network's features (docs/privacy.md).")
    a.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of `fedge simulate ... --samples`")
    a.add_argument("--config", help="the fleet config of the run (default: the one results.json names)")
    a.add_argument("--data-dir", help="data directory of the run's data set")
    a.add_argument("--out", help="where to write privacy.json and the figures (default RUN_DIR/audit)")
    a.add_argument("--train", type=int, default=1000, help="training images per device, at most (default 1000)")
    a.add_argument("--held-out", type=int, default=600, help="held-out and synthetic images, at most (default 600)")
    a.add_argument("--seed", type=int, default=0)
    a.set_defaults(func=_privacy)
    return p


def _privacy(args: argparse.Namespace) -> int:
    from fedge.audit.privacy import AuditSizes, audit_run
    from fedge.audit.report import format_audit_table
    from fedge.errors import ConfigError

    if args.train < 2 or args.held_out < 2:
        raise ConfigError("--train and --held-out must be >= 2")
    report = audit_run(args.run_dir, config=args.config, data_dir=args.data_dir, out_dir=args.out,
                       sizes=AuditSizes(args.train, args.held_out, args.seed))
    print(format_audit_table(report))
    out = args.out or f"{args.run_dir}/audit"
    print(f"\nwrote {out}/privacy.json and {len(report['audits'])} figure(s) (closest-*.png)")
    return 0
