"""``/metrics``: the fleet in the Prometheus exposition format, with ``prometheus_client`` (``fedge[observe]``).

The numbers are read from the :class:`~fedge.observe.monitor.FleetMonitor` at scrape time by a
custom collector (nothing is updated per message on the engine's thread), except the two histograms,
which the :class:`MetricsObserver` feeds once per round. Names (every counter also has ``_created``
as prometheus_client writes them):

========================================  =========  ===================================================
``fedge_info{fleet,method,run}``          gauge      1; the run's labels
``fedge_devices{state}``                  gauge      devices of the fleet by state: online, offline,
                                                     refused, no_hello (registered: after the fact)
``fedge_round``                           gauge      the round in progress (0: none)
``fedge_round_pending_devices``           gauge      devices the round in progress still waits for
``fedge_rounds_completed_total``          counter    rounds completed (the final evaluation round too)
``fedge_updates_accepted_total``          counter    updates accepted
``fedge_updates_refused_total{reason}``   counter    messages refused, by the round reports' reason
                                                     (``hello-slot``, ``late``, ``nonfinite`` ...)
``fedge_health_accepted_total``           counter    heartbeats accepted
``fedge_health_refused_total{reason}``    counter    heartbeats refused (``health-malformed`` ...)
``fedge_thermal_held_total``              counter    candidates the thermal guard held out of a round (hot:
                                                     ``[coordinator] thermal_guard``), summed over rounds
``fedge_bytes_up_total``                  counter    bytes of accepted updates
``fedge_bytes_down_total``                counter    bytes devices received for their accepted rounds
``fedge_round_duration_seconds``          histogram  a round, announce to checkpoint
``fedge_aggregation_duration_seconds``    histogram  the strategy's ``finish_round``
``fedge_async_buffer_size``               gauge      asynchronous mode only: updates per version (K)
``fedge_update_staleness``                histogram  asynchronous mode only: versions between the one an
                                                     accepted update trained from and the one it went into
``fedge_device_*{device,profile}``        gauge      per device: ``online``, ``last_seen_timestamp_seconds``,
                                                     ``last_round``, ``accepted_updates``, and from its
                                                     heartbeat ``health_timestamp_seconds``,
                                                     ``rss_bytes``, ``cpu_percent``, ``cpu_temperature_celsius``,
                                                     ``throttled_flags``, ``memory_available_bytes``,
                                                     ``disk_free_bytes``, ``uptime_seconds``, and
                                                     ``power_watts_estimate``: the profile's ``[power]``
                                                     model at the heartbeat's CPU use (built-in profiles;
                                                     docs/profiles.md, "The energy model")
========================================  =========  ===================================================

In asynchronous mode (docs/async.md) a round is a global version: ``fedge_round`` is the version being
built, ``fedge_round_pending_devices`` the devices training for it (holding a task), ``fedge_rounds_completed``
the versions published, and ``fedge_device_last_round`` the version a device's last accepted update went into.

No secret ever appears: labels are device ids, profiles, reasons, the fleet, method and run id.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fedge.common.health import HealthRecord
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.report import RoundReport
from fedge.observe.monitor import FleetMonitor, device_state
from fedge.profiles import list_profiles, load_profile
from fedge.profiles.power import Power

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STALENESS_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100)
AGGREGATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STATES = ("online", "offline", "refused", "no_hello", "registered")
# per-device health gauges: metric suffix -> (record field, help)
HEALTH_GAUGES: dict[str, tuple[str, str]] = {
    "rss_bytes": ("rss_bytes", "resident memory of the device's agent"),
    "cpu_percent": ("cpu_percent", "the agent's CPU since its previous heartbeat (100 = one core)"),
    "cpu_temperature_celsius": ("cpu_temp_c", "hottest CPU thermal zone"),
    "throttled_flags": ("throttled", "Raspberry Pi firmware throttle flags (get_throttled)"),
    "memory_available_bytes": ("mem_available_bytes", "memory left to the device (within its cgroup limit)"),
    "disk_free_bytes": ("disk_free_bytes", "free space on the device's root file system"),
    "uptime_seconds": ("uptime_s", "seconds since the device booted"),
}


class FleetCollector(Collector):
    """The fleet-level series, read from a :class:`FleetMonitor` at each scrape."""

    def __init__(self, monitor: FleetMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        mon = self.monitor
        statuses = mon.transport.statuses() if mon.transport is not None else {}
        pending = len(mon.pending()) if mon.state == "round" else 0
        info = GaugeMetricFamily("fedge_info", "the run this coordinator serves", labels=["fleet", "method", "run"])
        states = GaugeMetricFamily("fedge_devices", "devices of the fleet by state", labels=["state"])
        with mon._lock:
            info.add_metric([mon.fleet, mon.method, mon.run_id], 1)
            counts = dict.fromkeys(STATES, 0)
            for d in mon.devices.values():
                counts[device_state(d, statuses.get(d.device_id), mon.live).replace(" ", "_")] += 1
            for word, n in counts.items():
                states.add_metric([word], n)
            current = mon.current.round if mon.state == "round" and mon.current is not None else 0
            refused = CounterMetricFamily("fedge_updates_refused", "messages refused, by reason", labels=["reason"])
            for reason, n in sorted(mon.updates_refused.items()):
                refused.add_metric([reason], n)
            h_refused = CounterMetricFamily("fedge_health_refused", "heartbeats refused, by reason", labels=["reason"])
            for reason, n in sorted(mon.health_refused.items()):
                h_refused.add_metric([reason], n)
            scalars = [
                GaugeMetricFamily("fedge_round", "the round in progress (0: none)", value=current),
                GaugeMetricFamily("fedge_round_pending_devices", "devices the round in progress still waits for",
                                  value=pending),
                CounterMetricFamily("fedge_rounds_completed", "rounds completed", value=mon.completed),
                CounterMetricFamily("fedge_updates_accepted", "updates accepted", value=mon.updates_accepted),
                CounterMetricFamily("fedge_health_accepted", "heartbeats accepted", value=mon.health_accepted),
                CounterMetricFamily("fedge_thermal_held", "candidates the thermal guard held out of a round (hot)",
                                    value=mon.thermal_held),
                CounterMetricFamily("fedge_bytes_up", "bytes of accepted updates", value=mon.bytes_up),
                CounterMetricFamily("fedge_bytes_down", "bytes devices received for their accepted rounds",
                                    value=mon.bytes_down),
            ]
            if mon.asynchronous:
                if mon.buffer_size:
                    scalars.append(GaugeMetricFamily("fedge_async_buffer_size", "updates per global version (K)",
                                                     value=mon.buffer_size))
                scalars.append(staleness_histogram(mon.staleness))
        yield info
        yield states
        yield from scalars
        yield refused
        yield h_refused


def staleness_histogram(counts: Counter[int]) -> HistogramMetricFamily:
    """``fedge_update_staleness`` from the monitor's staleness -> accepted updates (cumulative buckets)."""
    buckets = [(str(float(le)), sum(n for s, n in counts.items() if s <= le)) for le in STALENESS_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily("fedge_update_staleness", "versions between the one an accepted update trained "
                                 "from and the one it went into", buckets=buckets,
                                 sum_value=sum(s * n for s, n in counts.items()))


# per-device gauges: name -> help; written by device_gauges() below
DEVICE_GAUGES: dict[str, str] = {
    "online": "1 if the device's latest status is online, 0 if offline",
    "last_seen_timestamp_seconds": "unix time of the last message from the device",
    "last_round": "the last round whose update was accepted",
    "accepted_updates": "updates accepted from the device",
    "health_timestamp_seconds": "unix time the device's last accepted heartbeat arrived",
    **{name: text for name, (_, text) in HEALTH_GAUGES.items()},
    "power_watts_estimate": "the board's power by its profile's energy model at the heartbeat's CPU use",
}


@functools.lru_cache(maxsize=256)
def _power(profile: str) -> Power | None:
    """The energy model of a built-in profile named ``profile`` (None: not a built-in, or no ``[power]``)."""
    if profile not in list_profiles():
        return None
    return load_profile(profile).power


def power_estimate_w(profile: str, health: HealthRecord) -> float | None:
    """A live device's power: its profile's ``[power]`` at the share of its cores its agent used since the last
    heartbeat (``cpu_percent`` ÷ 100 × ``cpu_count``); None when either is unknown."""
    power = _power(profile)
    if power is None or health.cpu_percent is None or not health.cpu_count:
        return None
    return power.estimate_w(health.cpu_percent / (100.0 * health.cpu_count))


def _label(value: str) -> str:
    """A label value as the exposition format escapes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def device_gauges(monitor: FleetMonitor) -> str:
    """The ``fedge_device_*`` families in the exposition format.

    Written here rather than through a prometheus_client collector: generate_latest spends ~20 µs on each
    sample, 230 ms for the ~12 series per device of a 1,000-device fleet, and a scrape must stay under
    50 ms. Labels are escaped as prometheus_client escapes them; values are Python's shortest repr.
    """
    mon = monitor
    statuses = mon.transport.statuses() if mon.transport is not None else {}
    seen = mon.transport.last_seen() if mon.transport is not None else {}
    rows: dict[str, list[str]] = {name: [] for name in DEVICE_GAUGES}
    with mon._lock:
        for d in mon.devices.values():
            labels = f'{{device="{_label(d.device_id)}",profile="{_label(d.profile)}"}} '
            st = statuses.get(d.device_id)
            if st is not None:
                rows["online"].append(labels + ("1" if st[0] else "0"))
            last = max(seen.get(d.device_id, 0.0), d.health_at)
            if last:
                rows["last_seen_timestamp_seconds"].append(labels + repr(float(last)))
            rows["last_round"].append(labels + str(d.last_round))
            rows["accepted_updates"].append(labels + str(d.accepted))
            h = d.health
            if h is None:
                continue
            rows["health_timestamp_seconds"].append(labels + repr(float(d.health_at)))
            for name, (attr, _) in HEALTH_GAUGES.items():
                value = getattr(h, attr)
                if value is not None:
                    rows[name].append(labels + repr(value))
            watts = power_estimate_w(d.profile, h)
            if watts is not None:
                rows["power_watts_estimate"].append(labels + repr(watts))
    out = []
    for name, text in DEVICE_GAUGES.items():
        full = f"fedge_device_{name}"
        out.append(f"# HELP {full} {text}\n# TYPE {full} gauge\n")
        out.extend(f"{full}{row}\n" for row in rows[name])
    return "".join(out)


class MetricsObserver(EngineObserver):
    """The two histograms, observed once per round."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rounds = Histogram("fedge_round_duration_seconds", "a round, from announcing it to its checkpoint",
                                buckets=ROUND_BUCKETS, registry=registry)
        self.aggregation = Histogram("fedge_aggregation_duration_seconds", "the strategy's finish_round",
                                     buckets=AGGREGATION_BUCKETS, registry=registry)

    def round_finished(self, report: RoundReport, aggregation_s: float) -> None:
        self.rounds.observe(report.seconds)
        self.aggregation.observe(aggregation_s)


class FleetMetrics:
    """A private registry (two coordinators in one process never share series) with the fleet's metrics."""

    def __init__(self, monitor: FleetMonitor) -> None:
        self.monitor = monitor
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FleetCollector(monitor))
        self.observer = MetricsObserver(self.registry)
        for seconds, aggregation_s in list(monitor.round_hist):  # rounds before a restart, or replayed
            self.observer.rounds.observe(seconds)
            self.observer.aggregation.observe(aggregation_s)

    def render(self) -> bytes:
        """The exposition text of one scrape: prometheus_client's registry, then the per-device gauges."""
        return generate_latest(self.registry) + device_gauges(self.monitor).encode()

