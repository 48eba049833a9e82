"""The ``fedge`` command line. The only module that prints for the user.

Each area adds its sub-commands from its ``cli.py`` module through
``add_parser(subparsers)``; the command handler is stored as ``func`` and returns
an exit code. A :class:`FedgeError` becomes a two-line message and its exit code.
No area's command line imports another's: an action that one area adds under
another's command (``fedge profile probe``, measured with the exporter; ``fedge coordinator
worker``, a scale-out service) is
registered here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from fedge import __version__
from fedge.errors import FedgeError

# Modules that contribute sub-commands, in help order.
COMMAND_MODULES = (
    "fedge.profiles.cli",
    "fedge.sim.cli",
    "fedge.coordinator.cli",
    "fedge.observe.cli",
    "fedge.scaleout.cli",
    "fedge.edge.cli",
    "fedge.export.cli",
    "fedge.runtime.cli",
    "fedge.broker.cli",
    "fedge.deploy.cli",
    "fedge.flash.cli",
    "fedge.emulate.cli",
    "fedge.audit.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedge", description="Federated learning for fleets of heterogeneous edge devices."
    )
    parser.add_argument("--version", action="version", version=f"fedge {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    added: dict[str, Any] = {}
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that area is not built (yet); its commands are absent
                continue
            raise
        added[name] = module.add_parser(sub)
    if "fedge.profiles.cli" in added and "fedge.export.cli" in added:
        from fedge.export.cli import add_probe_parser

        add_probe_parser(added["fedge.profiles.cli"])
    if "fedge.coordinator.cli" in added and "fedge.scaleout.cli" in added:
        from fedge.scaleout.cli import add_worker_parser

        add_worker_parser(added["fedge.coordinator.cli"])
    return parser


def _report(exc: FedgeError) -> int:
    print(f"fedge: error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  fix: {exc.hint}", file=sys.stderr)
    return exc.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        from fedge.common.extras import missing_extra

        err = missing_extra(exc)
        if err is None:
            raise
        return _report(err)
    except FedgeError as exc:
        return _report(exc)
    except KeyboardInterrupt:
        print("fedge: interrupted", file=sys.stderr)
        return 130
