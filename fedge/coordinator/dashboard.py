"""The dashboard: the routes the web server (:mod:`fedge.coordinator.web`) serves for one fleet view."""

from __future__ import annotations

import html
import logging
from collections.abc import Callable
from typing import Any

from fedge.coordinator.monitor import FleetMonitor
from fedge.coordinator.web import Routes

log = logging.getLogger(__name__)


def routes_for(view: Callable[[], dict[str, Any]], metrics: Callable[[], bytes] | None = None) -> Routes:
    """The page, its live fragment, ``/api/state`` and ``/metrics`` of a view function."""

    def fragment() -> str:
        v = view()
        rows = "".join(f"<tr><td>{html.escape(d['device'])}</td><td>{html.escape(d['state'])}</td></tr>"
                       for d in v["devices"])
        return f"<table>{rows}</table>"

    def page() -> str:
        return f"<!doctype html><title>fedge</title><div id=live>{fragment()}</div>"

    return Routes(page=page, fragment=fragment, state=view, metrics=metrics)


def monitor_routes(monitor: FleetMonitor, metrics: Callable[[], bytes] | None = None) -> Routes:
    return routes_for(monitor.view, metrics)
