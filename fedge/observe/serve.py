"""Serving the fleet view over HTTP: the ``--http`` flags checked before anything connects, and the dashboard
with /metrics started for a live monitor (``fedge coordinator run --http``) or for a state directory
(``fedge dashboard``, :mod:`fedge.observe.cli`).

/metrics needs prometheus_client (``pip install 'fedge[observe]'``); without it the page is served alone and
a warning says why /metrics is off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fedge.coordinator.observer import EngineObserver
from fedge.errors import ConfigError
from fedge.observe.dashboard import monitor_routes
from fedge.observe.monitor import FleetMonitor
from fedge.observe.web import DashboardServer, Endpoint, check_bind, load_token, parse_endpoint

if TYPE_CHECKING:
    from fedge.observe.metrics import FleetMetrics

log = logging.getLogger(__name__)


def http_flags(http: str | None, token_file: str | None) -> tuple[Endpoint | None, str | None]:
    """(the ``--http`` endpoint or None, the token), refused when wrong: a token file without ``--http``, a bad
    address, an unreadable token, or an address beyond loopback without a token."""
    if http is None:
        if token_file:
            raise ConfigError("--http-token-file without --http", hint="add --http HOST:PORT")
        return None, None
    endpoint = parse_endpoint(http)
    token = load_token(token_file)
    check_bind(endpoint, token)
    return endpoint, token


def metrics_type() -> type[FleetMetrics] | None:
    """:class:`~fedge.observe.metrics.FleetMetrics`, or None (logged) when prometheus_client is missing."""
    try:
        from fedge.observe.metrics import FleetMetrics
    except ModuleNotFoundError as exc:
        if exc.name != "prometheus_client":
            raise
        log.warning("/metrics is off: prometheus_client is not installed (pip install 'fedge[observe]')")
        return None
    return FleetMetrics


def start_web(monitor: FleetMonitor, endpoint: Endpoint, token: str | None
              ) -> tuple[DashboardServer, list[EngineObserver]]:
    """The dashboard and /metrics server for a live ``monitor``: (the started server, the observers the engine
    must tell before its first round, so that /metrics' histograms see every round)."""
    observers: list[EngineObserver] = []
    metrics_cls = metrics_type()
    render = None
    if metrics_cls is not None:
        metrics = metrics_cls(monitor)
        observers.append(metrics.observer)
        render = metrics.render
    return DashboardServer(monitor_routes(monitor, render), endpoint, token).start(), observers
