"""The ``fedge`` command line. The only module that prints for the user.

Each area adds its sub-commands from a small ``*_cli.py`` module through
``add_parser(subparsers)``; the command handler is stored as ``func`` and returns
an exit code. A :class:`FedgeError` becomes a two-line message and its exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from fedge import __version__
from fedge.errors import FedgeError

# Modules that contribute sub-commands, in help order.
COMMAND_MODULES = (
    "fedge.profiles.cli",
    "fedge.sim.cli",
    "fedge.coordinator.cli",
    "fedge.edge.cli",
    "fedge.export.cli",
    "fedge.broker.cli",
    "fedge.emulate.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedge", description="Federated learning for fleets of heterogeneous edge devices."
    )
    parser.add_argument("--version", action="version", version=f"fedge {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that area is not built (yet); its commands are absent
                continue
            raise
        module.add_parser(sub)
    return parser


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
    except FedgeError as exc:
        print(f"fedge: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  fix: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fedge: interrupted", file=sys.stderr)
        return 130
