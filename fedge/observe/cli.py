"""``fedge dashboard``: the dashboard of a run directory, served on loopback or written once to a file.

It reads the coordinator's files (``reports.jsonl``, ``state.json``: :mod:`fedge.observe.fileview`), so it
follows a run still going and shows one long finished; the live page, with device health, is
``fedge coordinator run --http``'s (:mod:`fedge.observe.serve`).
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from fedge.common.rounds import DeviceInfo

Parsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # argparse's type, generic for mypy only

DEFAULT_HTTP_PORT = 8321


def add_parser(sub: Parsers) -> None:
    """Register ``fedge dashboard``."""
    dash = sub.add_parser("dashboard", help="the dashboard of a run directory (live while its coordinator runs)",
                          description="Serve the dashboard of a coordinator's state directory (reports.jsonl, "
                                      "state.json), or of an emulation directory (its coordinator/), on loopback: "
                                      "the fleet table, rounds, accuracy and traffic per device and per profile, "
                                      "read from the files (a run still going is followed as reports.jsonl "
                                      "grows). Live device health is on `fedge coordinator run --http`'s page.")
    dash.add_argument("run_dir", metavar="RUN_DIR", help="a --state-dir, or an emulation directory")
    dash.add_argument("--config", metavar="FLEET.toml", help="the fleet config (profiles of devices that never "
                                                             "said hello; default: RUN_DIR/fleet.toml if there is one)")
    dash.add_argument("--http", default=f"127.0.0.1:{DEFAULT_HTTP_PORT}", metavar="HOST:PORT",
                      help=f"where to serve (default 127.0.0.1:{DEFAULT_HTTP_PORT}; any other address needs a token)")
    dash.add_argument("--http-token-file", metavar="FILE", help="the token every request must carry")
    dash.add_argument("--once", metavar="PAGE.html", help="write the page to this file and exit (no server)")
    dash.set_defaults(func=_dashboard)


def state_dir_of(run_dir: str) -> Path:
    """The state directory in ``run_dir``: itself, or an emulation's ``coordinator/``."""
    from fedge.coordinator.store import REPORTS_FILE, STATE_FILE
    from fedge.errors import ConfigError

    base = Path(run_dir)
    for candidate in (base, base / "coordinator"):
        if (candidate / REPORTS_FILE).is_file() or (candidate / STATE_FILE).is_file():
            return candidate
    raise ConfigError(f"{run_dir} holds no coordinator state (no {REPORTS_FILE} or {STATE_FILE}, here or in "
                      "its coordinator/)", hint="pass the --state-dir of `fedge coordinator run`, or the --out of "
                                                "`fedge emulate up`")


def _fleet_devices(config: str) -> dict[str, DeviceInfo]:
    """Device id -> DeviceInfo (profile, arch) of every device of a fleet config, from its slots."""
    from fedge.fleet.config import load_fleet
    from fedge.fleet.slots import checked_slots

    return {s.device_id: s.info() for s in checked_slots(load_fleet(config))}


def _dashboard(args: argparse.Namespace) -> int:
    from fedge.observe.dashboard import page, routes_for
    from fedge.observe.fileview import FileView
    from fedge.observe.serve import http_flags, metrics_type
    from fedge.observe.web import DashboardServer

    state_dir = state_dir_of(args.run_dir)
    config = args.config
    if config is None and (Path(args.run_dir) / "fleet.toml").is_file():
        config = str(Path(args.run_dir) / "fleet.toml")
    files = FileView(state_dir, _fleet_devices(config) if config else {})
    if args.once:
        Path(args.once).write_text(page(files.view(), title=str(state_dir), every_row=True))
        print(f"wrote {args.once}")
        return 0
    endpoint, token = http_flags(args.http, args.http_token_file)
    assert endpoint is not None  # --http has a default
    metrics_cls = metrics_type()
    render = None
    if metrics_cls is not None:
        def render() -> bytes:
            return metrics_cls(files.monitor()).render()  # the monitor of the files as they are now
    server = DashboardServer(routes_for(files.view, render, title=str(state_dir)), endpoint, token).start()
    print(f"dashboard of {state_dir} on {server.url}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        threading.Event().wait()
    finally:
        server.stop()
    return 0
