"""Asynchronous mode beside what main gained after it was written: aggregation workers and relays (issue 29) and
the parallel simulation backends (issue 30) are refused with an async fleet, naming the key and the fix; the
fleet monitor, the dashboard and /metrics (issue 28) count versions in async mode."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import tiny_fleet
from prometheus_client.parser import text_string_to_metric_families

from fedge.cli import main
from fedge.common.asyncmode import AsyncSettings
from fedge.common.messages import Message
from fedge.common.rounds import RoundInfo
from fedge.common.transport import Inbound
from fedge.coordinator.observer import EngineObserver
from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet
from fedge.observe.dashboard import page
from fedge.observe.fileview import monitor_from_state_dir
from fedge.observe.metrics import FleetMetrics
from fedge.observe.monitor import FleetMonitor

ASYNC_TOML = """
[run]
method = "fedavg"
rounds = 2
dataset = "digits"
fleet = "compose"

[coordinator]
mode = "async"
buffer_size = 2

[[devices]]
profile = "rpi4-2gb"
count = 3
arch = "tier-xs"
"""


def _write(tmp_path: Path, text: str = ASYNC_TOML) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


# -- the parallel simulation backends ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["process", "ray"])
def test_async_with_a_parallel_backend_is_refused_at_load(backend: str) -> None:
    doc = {"run": {"method": "fedavg", "rounds": 2}, "coordinator": {"mode": "async"},
           "simulation": {"backend": backend}, "devices": [{"profile": "rpi4-2gb", "count": 3}]}
    with pytest.raises(ConfigError) as err:
        parse_fleet(doc, source="fleet.toml")
    assert err.value.message.startswith(f'fleet.toml: [simulation] backend = {backend!r} with [coordinator] mode = '
                                        '"async"'), err.value.message
    assert 'use backend = "sequential"' in (err.value.hint or "") and 'drop mode = "async"' in (err.value.hint or "")
    # the same fleet without async mode loads with the parallel backend, and async alone on the sequential one
    del doc["coordinator"]
    assert parse_fleet(doc).simulation.backend == backend
    assert parse_fleet({**doc, "coordinator": {"mode": "async"}, "simulation": {}}).asynchronous is not None


def test_async_with_backend_on_the_command_line_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend process`` replaces the section after the load: ``fedge simulate`` checks again."""
    out = tmp_path / "out"
    assert main(["simulate", str(_write(tmp_path)), "--backend", "process", "--no-progress",
                 "--out", str(out)]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert "[simulation] backend = 'process' with [coordinator] mode = \"async\"" in err, err
    assert "--backend sequential" in err and "Traceback" not in err
    assert not out.exists()  # refused before any work


# -- aggregation workers and relays -----------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "flag"), [
    (["coordinator", "run", "--state-dir", "{tmp}/state", "--broker", "mqtt://127.0.0.1:1", "--workers"],
     "--workers"),
    (["coordinator", "worker", "--broker", "mqtt://127.0.0.1:1", "--name", "worker-1"], "`fedge coordinator worker`"),
    (["relay", "--broker", "mqtt://127.0.0.1:1", "--shard", "mqtt://127.0.0.1:2", "--name", "relay-1"],
     "`fedge relay`"),
    (["broker", "config", "--out", "{tmp}/broker", "--shards", "2"], "--shards"),
    (["broker", "config", "--out", "{tmp}/broker", "--workers", "2"], "--workers"),
])
def test_async_with_workers_or_relays_is_refused_naming_the_key_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    """Every command that would split an asynchronous fleet's aggregation refuses before it connects or writes."""
    config = _write(tmp_path)
    args = [a.format(tmp=tmp_path) for a in argv]
    args += ["--fleet", str(config)] if args[0] == "broker" else ["--config", str(config)]
    assert main(args) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert f'[coordinator] mode = "async" cannot run with {flag}' in err, err
    assert "no --workers, no --shards, no relays" in err and 'drop mode = "async"' in err
    assert "Traceback" not in err
    assert not (tmp_path / "broker").exists() and not (tmp_path / "state").exists()


def test_a_partial_aggregator_refuses_an_async_engine_config() -> None:
    from fedge.common.method_settings import FedAvgSettings
    from fedge.coordinator.config import EngineConfig
    from fedge.coordinator.strategies.fedavg import FedAvgStrategy
    from fedge.scaleout.aggregator import PartialAggregator

    strat = FedAvgStrategy(FedAvgSettings(), num_classes=10, rounds=2)
    with pytest.raises(ConfigError, match='mode = "async" cannot run with a partial aggregator'):
        PartialAggregator(strat, EngineConfig(asynchronous=AsyncSettings(buffer_size=2, fleet_size=3)), "w0")
    PartialAggregator(strat, EngineConfig(), "w0")  # synchronous rounds split


def test_a_partial_that_reaches_an_async_version_is_refused_and_counted() -> None:
    """A misconfigured worker's partial cannot enter a version: refused as partial-async under its sender, and the
    version is still made from the devices' own updates."""
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 3, rounds=2, asynchronous=AsyncSettings(buffer_size=2, fleet_size=3))
    transport = fleet.engine.transport
    inner = transport.collect
    rogue = Message("partial", "worker-1", 1, "default", info={"devices": {}}).to_bytes()

    def collect(round: int, expected: Collection[str], deadline: float) -> Iterator[Inbound]:
        if round == 1:
            yield Inbound(rogue, "worker-1", kind="partial")
        yield from inner(round, expected, deadline)

    transport.collect = collect  # type: ignore[method-assign]
    reports = fleet.engine.run()
    assert reports[0].rejected == {"partial-async": 1}
    assert reports[0].rejected_by_device == {"worker-1": {"partial-async": 1}}
    assert len(reports[0].accepted) == 2 and reports[0].partials == {}
    assert all(len(r.accepted) == 2 for r in reports[:-1])


# -- watching an asynchronous run -------------------------------------------------------------------------------

class Snapshots(EngineObserver):
    """What the monitor says while each version is being built (after the monitor has heard of it)."""

    def __init__(self, monitor: FleetMonitor) -> None:
        self.monitor = monitor
        self.lines: list[str] = []
        self.rounds: list[dict[str, Any]] = []

    def round_started(self, info: RoundInfo, expected: Collection[str], pending: Collection[str]) -> None:
        line = self.monitor.waiting_line()
        self.lines.append(line[1] if line else "")
        self.rounds.append(dict(self.monitor.view()["round"] or {}))


def _samples(text: bytes) -> dict[str, float]:
    return {s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def test_the_monitor_dashboard_and_metrics_of_an_async_run_count_versions(tmp_path: Path) -> None:
    a = AsyncSettings(buffer_size=2, max_staleness=2, fleet_size=4)
    fleet = tiny_fleet("fedavg", ["tier-xs"] * 4, rounds=4, asynchronous=a)
    ids = [ag.device.device_id for ag in fleet.agents]
    monitor = FleetMonitor(fleet="default", method="fedavg", total_rounds=4, wait_log_s=0, buffer_size=2,
                           fleet_devices={ag.device.device_id: ag.device for ag in fleet.agents})
    metrics = FleetMetrics(monitor)
    snaps = Snapshots(monitor)
    fleet.engine.observers += [monitor, metrics.observer, snaps]
    reports = fleet.engine.run()
    versions = reports[:-1]
    stale = [s for r in versions for s in r.staleness.values()]
    assert len(stale) == 8 and max(stale) >= 1  # four devices, K = 2: half of the updates are a version late

    # while a version was being built: the devices training for it, not "N of M devices"
    assert snaps.lines[0] == "version 1 (train): waiting for the 2 updates of 4 devices training, after 0 s: " \
                             + "; ".join(f"{d} (no update yet)" for d in ids), snaps.lines[0]
    assert snaps.rounds[0]["training"] == 4 and snaps.rounds[0]["round"] == 1
    assert snaps.lines[-1].startswith("round 5 (final): waiting for 4 of 4 devices"), snaps.lines[-1]

    view = monitor.view()
    assert (view["mode"], view["unit"], view["buffer_size"], view["completed"]) == ("async", "version", 2, 5)
    assert [r["staleness_max"] for r in view["rounds"]] == [max(r.staleness.values()) for r in versions] + [None]
    for dev in view["devices"]:  # the version its last accepted update went into (the final evaluation: 5)
        assert dev["last_round"] == 5 and dev["accepted"] == 1 + sum(dev["device"] in r.accepted for r in versions)

    html = page(view)
    assert "finished: 5 versions" in html and "last version" in html and "acc % (last version)" in html
    assert ">version</text>" in html and ">round</text>" not in html  # the charts' x axis
    last = versions[-1]
    mean = sum(last.staleness.values()) / len(last.staleness)
    assert (f"staleness of the updates in version {last.round}: mean {mean:.1f}, max {max(last.staleness.values())}"
            in html)

    got = _samples(metrics.render())
    assert got["fedge_async_buffer_size"] == 2
    assert got["fedge_update_staleness_count"] == len(stale) and got["fedge_update_staleness_sum"] == sum(stale)
    assert got["fedge_update_staleness_bucket|le=0.0"] == stale.count(0)
    assert got["fedge_rounds_completed_total"] == 5 and got["fedge_updates_accepted_total"] == 8 + 4
    assert all(got[f"fedge_device_last_round|device={d}|profile=test"] == 5 for d in ids)

    # a synchronous run says rounds and has no staleness series
    sync = tiny_fleet("fedavg", ["tier-xs"] * 2, rounds=1)
    plain = FleetMonitor(fleet="default", method="fedavg", total_rounds=1, wait_log_s=0)
    sync.engine.observers.append(plain)
    sync.engine.run()
    assert (plain.view()["mode"], plain.view()["unit"]) == ("sync", "round")
    assert "finished: 2 rounds" in page(plain.view())
    names = _samples(FleetMetrics(plain).render())
    assert not any(k.startswith(("fedge_update_staleness", "fedge_async")) for k in names)


def test_the_dashboard_of_an_async_state_directory_counts_versions(tmp_path: Path) -> None:
    """``fedge dashboard RUN_DIR`` after the fact: the reports' staleness marks the run asynchronous."""
    from fedge.coordinator.engine import RoundEngine

    fleet = tiny_fleet("fedavg", ["tier-xs"] * 3, rounds=2, asynchronous=AsyncSettings(buffer_size=2, fleet_size=3))
    engine = RoundEngine(fleet.engine.strategy, fleet.engine.transport, fleet.engine.config, state_dir=tmp_path)
    engine.run()
    mon = monitor_from_state_dir(tmp_path)
    view = mon.view()
    assert (view["mode"], view["unit"], view["buffer_size"]) == ("async", "version", None)
    assert "finished: 3 versions" in page(view)
    got = _samples(FleetMetrics(mon).render())
    assert got["fedge_update_staleness_count"] == 4 and "fedge_async_buffer_size" not in got
