"""What the dashboard and /metrics tests share: a small real fleet over Mosquitto watched by a FleetMonitor,
a real Prometheus server on loopback, and what reads the page in a real headless Chromium (the
``browser`` fixture of conftest.py)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fedge.coordinator.engine import EngineConfig, RoundEngine, RoundReport
from fedge.fleet.config import FleetConfig, device_ids, load_fleet
from fedge.mqtt.broker import MosquittoProcess, free_port
from fedge.observe.metrics import FleetMetrics
from fedge.observe.monitor import FleetMonitor, fleet_infos
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet

FLEET_TOML = """
[run]
method = "fedproto"
rounds = {rounds}
dataset = "digits"
fleet = "{fleet}"
seed = 3

[partition]
kind = "dirichlet"
alpha = 0.5
fraction = 0.2

[train]
lr = 0.05
local_epochs = 1

[[devices]]
profile = "rpi4-2gb"
count = 2
arch = "tier-xs"

[[devices]]
profile = "x86-gateway"
count = 1
arch = "tier-xs"
"""


def small_fleet(tmp: Path, fleet: str, rounds: int = 2, extra: str = "") -> FleetConfig:
    """The three-device fleet; ``extra``: TOML tables appended (e.g. a ``[coordinator]`` table)."""
    path = tmp / f"{fleet}.toml"
    path.write_text(FLEET_TOML.format(fleet=fleet, rounds=rounds) + extra)
    return load_fleet(path)


@dataclass
class WatchedRun:
    engine: RoundEngine
    reports: list[RoundReport]
    monitor: FleetMonitor
    metrics: FleetMetrics


def run_watched(cfg: FleetConfig, broker: MosquittoProcess, state_dir: Path | None = None) -> WatchedRun:
    """The fleet over ``broker`` (devices in threads, heartbeats every 10 s), with a monitor and metrics."""
    devices, strat = build_fleet(cfg)
    coord, agents, stop = start_fleet(cfg, devices, broker.settings())
    assert coord is not None
    try:
        ids = [i for i, _ in device_ids(cfg)]
        infos = {d.info.device_id: d.info for d in devices}
        a = cfg.asynchronous  # [coordinator] mode = "async": versions (docs/async.md)
        monitor = FleetMonitor(fleet=cfg.run.fleet, method=cfg.run.method, total_rounds=strat.total_rounds(),
                               transport=coord, fleet_devices={**fleet_infos(None, ids), **infos}, wait_log_s=0,
                               buffer_size=a.buffer_size if a is not None else 0)
        metrics = FleetMetrics(monitor)
        engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method, asynchronous=a),
                             state_dir=state_dir, observers=[monitor, metrics.observer])
        monitor.run_id = engine.run_id
        reports = engine.run()

        def settle(what: str, done: Callable[[], bool], limit_s: float = 60.0) -> None:
            deadline = time.monotonic() + limit_s
            while not done():
                if time.monotonic() > deadline:
                    raise AssertionError(f"after {limit_s:.0f} s, still waiting for {what}: {coord.statuses()}")
                monitor.tick()
                time.sleep(0.1)
            monitor.tick()

        # the first heartbeats (1 s after each device started) ...
        settle("every device's first heartbeat", lambda: all(d.health is not None for d in monitor.devices.values()))
        # ... then each device leaves as `fedge edge` does once its service ends after the final round: its
        # connection closes with a retained "offline". start_fleet's devices keep theirs open until stop(), which
        # closes the coordinator's right after (a status still on its way then never arrived: under load the
        # tests' offline counts were one short), so close them here and wait until the coordinator has them all.
        for agent in agents:
            agent.transport.close()

        def offline() -> bool:
            statuses = coord.statuses()
            return all(dev in statuses and not statuses[dev][0] for dev in infos)

        settle("every device's offline status", offline)
        return WatchedRun(engine, reports, monitor, metrics)
    finally:
        stop()


class Prometheus:
    """Debian's ``prometheus`` on a free loopback port, scraping one target every second."""

    def __init__(self, workdir: Path, target: str, *, token_file: Path | None = None) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: apt-get install prometheus (.ci/run does it)")
        self.port = free_port()
        auth = (f"    authorization:\n      type: Bearer\n      credentials_file: {token_file}\n"
                if token_file else "")
        config = workdir / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          "scrape_configs:\n  - job_name: fedge\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
                          f"{auth}    static_configs:\n      - targets: ['{target}']\n")
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            doc = json.load(r)
        assert doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The query's result once it is not empty (Prometheus scrapes every second)."""
        end = time.time() + timeout_s
        last: Exception | None = None
        while time.time() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}")
            try:
                found = self.query(expr)
                if found:
                    return found
            except OSError as exc:  # not listening yet
                last = exc
            time.sleep(0.5)
        raise AssertionError(f"no series for {expr} after {timeout_s:.0f} s (last error: {last})")

    def targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/targets", timeout=5) as r:
            return list(json.load(r)["data"]["activeTargets"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# -- the browser ------------------------------------------------------------------------------------------

def screenshot_dir(tmp_path: Path) -> Path:
    """Where the screenshots go: $FEDGE_SCREENSHOT_DIR (to look at them), else the test's tmp_path."""
    out = Path(os.environ.get("FEDGE_SCREENSHOT_DIR") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def cells(browser: Any, device: str) -> dict[str, str]:
    """A device's row on the page: its state, its text, and the exact numbers its cells carry."""
    from selenium.webdriver.common.by import By

    row = browser.find_element(By.CSS_SELECTOR, f'#devices tr[data-device="{device}"]')
    out = {"state": row.get_attribute("data-state") or "", "text": row.text}
    for cls in ("accepted", "up", "down", "acc"):
        out[cls] = row.find_element(By.CSS_SELECTOR, f"td.{cls}").get_attribute("data-value") or ""
    return out


def assert_not_blank(png: bytes) -> None:
    """A screenshot of a drawn page: wide, with contrast and many colours (text, tables, charts)."""
    from PIL import Image, ImageStat

    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.size[0] >= 1000
    stat = ImageStat.Stat(img)
    assert max(stat.stddev) > 20, stat.stddev  # a blank page has no variance
    colours = img.resize((200, 300)).getcolors(200 * 300) or []
    assert len(colours) > 30, len(colours)  # text, table lines, the charts' colours


T = TypeVar("T")


def retry(fn: Callable[[], T]) -> T:
    """``fn()``, again if the page replaced its live part while ``fn`` read it (every 2 s)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for attempt in range(10):
        try:
            return fn()
        except StaleElementReferenceException:
            if attempt == 9:
                raise
            time.sleep(0.3)
    raise AssertionError("unreachable")


def check_numbers_equal_reports(browser: Any, reports: list[RoundReport], ids: list[str]) -> None:
    """Every device's accepted updates, bytes up and down and last accuracy on the page are those of the reports."""
    for dev in ids:
        row = cells(browser, dev)
        accepted = [r for r in reports if dev in r.accepted]
        assert int(row["accepted"]) == len(accepted), dev
        assert int(row["up"]) == sum(r.bytes_up[dev] for r in accepted), dev
        assert int(row["down"]) == sum(r.bytes_down[dev] for r in accepted), dev
        last = [r.metrics[dev]["acc_global"] for r in accepted if "acc_global" in r.metrics.get(dev, {})]
        assert (float(row["acc"]) if row["acc"] else None) == (last[-1] if last else None), dev
