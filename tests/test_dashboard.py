"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by selenium) against a
real Mosquitto fleet: the page lists every device with the numbers of reports.jsonl, shows a killed device
offline and a refused device's reason, draws its charts (elements present, a screenshot that is not blank),
and refreshes itself; the same page after the fact from the state directory (``fedge dashboard``). No
password or token on the page, in /metrics, in /api/state or in the log."""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from observe_helpers import (
    assert_not_blank,
    cells,
    check_numbers_equal_reports,
    retry,
    screenshot_dir,
    small_fleet,
)

from fedge.common.messages import Message
from fedge.coordinator.config import EngineConfig, slot_checks
from fedge.coordinator.engine import RoundEngine
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.report import RoundReport
from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.fleet.config import device_ids
from fedge.fleet.slots import checked_slots
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.observe.dashboard import monitor_routes, profile_colours
from fedge.observe.metrics import FleetMetrics
from fedge.observe.monitor import FleetMonitor
from fedge.observe.web import DashboardServer, Endpoint
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet

SECRET = "mqtt-password-not-for-pages-31337"
TOKEN = "http-token-not-for-pages-424242"


class Gate(EngineObserver):
    """Holds the engine after a chosen round until the test lets it go (the page is checked meanwhile)."""

    def __init__(self, after: int, on_round: Any = None) -> None:
        self.after = after
        self.on_round = on_round
        self.reached = threading.Event()
        self.go = threading.Event()

    def round_finished(self, report: RoundReport, aggregation_s: float) -> None:
        if self.on_round is not None:
            self.on_round(report)
        if report.round == self.after:
            self.reached.set()
            self.go.wait(120)


def test_the_dashboard_of_a_live_fleet_in_chromium(tmp_path: Path, mosquitto: MosquittoProcess, browser: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from selenium.webdriver.common.by import By

    caplog.set_level(logging.DEBUG)
    cfg = small_fleet(tmp_path, "dash", rounds=3)
    # x86-gateway-1 will announce another model than its slot: refused (hello-slot)
    ids = [i for i, _ in device_ids(cfg)]
    assert ids == ["rpi4-2gb-1", "rpi4-2gb-2", "x86-gateway-1"]
    devices, strat = build_fleet(cfg)
    refused_id = "x86-gateway-1"
    honest = [d for d in devices if d.info.device_id != refused_id]
    liar_info = next(d.info for d in devices if d.info.device_id == refused_id)
    settings = mosquitto.settings().with_credentials("coordinator", SECRET)  # anonymous broker: taken, unchecked
    coord, agents, stop = start_fleet(cfg, honest, settings)
    assert coord is not None
    liar = MqttDeviceTransport(mosquitto.settings(), cfg.run.fleet, refused_id).start()
    liar.send_hello(Message("hello", refused_id, 0, cfg.run.fleet,
                            info={"device": {**liar_info.to_dict(), "arch": "tier-xl"}}).to_bytes())
    slots = slot_checks(checked_slots(cfg), own_data=False)
    monitor = FleetMonitor(fleet=cfg.run.fleet, method=cfg.run.method, total_rounds=strat.total_rounds(),
                           transport=coord, fleet_devices={k: v.info for k, v in slots.items()}, wait_log_s=1.0)
    metrics = FleetMetrics(monitor)
    killed = "rpi4-2gb-2"

    def kill(report: RoundReport) -> None:
        if report.round == 1:
            next(a for a in agents if a.device.device_id == killed).transport.abort()  # type: ignore[attr-defined]

    gate = Gate(after=2, on_round=kill)
    state = tmp_path / "state"
    engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method, slots=slots,
                                                    allowed_devices=frozenset(ids), min_devices=1),
                         state_dir=state, observers=[monitor, metrics.observer, gate])
    monitor.run_id = engine.run_id
    monitor.start()
    server = DashboardServer(monitor_routes(monitor, metrics.render), Endpoint("127.0.0.1", 0)).start()
    result: list[Any] = []
    runner = threading.Thread(target=lambda: result.append(engine.run()), daemon=True)
    try:
        engine.register_pending()
        runner.start()
        assert gate.reached.wait(180), "round 2 never finished"
        # the live page, held after round 2: rpi4-2gb-2 was killed after round 1, x86-gateway-1 refused
        browser.get(server.url + "/")  # how fast it loads is a benchmark's question, not this test's
        first_version = browser.find_element(By.ID, "live").get_attribute("data-version")
        deadline = time.time() + 30
        while time.time() < deadline:  # heartbeats (1 s after start) and the killed device's last-will
            if retry(lambda: "no heartbeat" not in cells(browser, "rpi4-2gb-1")["text"]
                     and cells(browser, killed)["state"] == "offline"):
                break
            time.sleep(1)  # the page refreshes itself every 2 s
        # the page replaces its live part every 2 s: read it in one piece, again if it changed under us
        retry(lambda: check_live_page(browser, ids, killed, refused_id))
        page = browser.page_source
        assert SECRET not in page and TOKEN not in page
        png = browser.get_screenshot_as_png()
        (screenshot_dir(tmp_path) / "dashboard_live.png").write_bytes(png)
        assert_not_blank(png)
        # it refreshes itself: the next heartbeats (every 10 s) change the view, and the page shows the new one
        deadline = time.time() + 25
        def version() -> str:
            return str(browser.find_element(By.ID, "live").get_attribute("data-version"))

        while time.time() < deadline and retry(version) == first_version:
            time.sleep(0.5)
        assert retry(version) != first_version
        gate.go.set()
        runner.join(120)
        assert not runner.is_alive() and result
        # the finished run: every number of the table equals reports.jsonl
        reports = read_reports(state / REPORTS_FILE)
        assert [r.round for r in reports] == [1, 2, 3, 4]
        browser.get(server.url + "/")
        check_numbers_equal_reports(browser, reports, ids)
        for path in ("/metrics", "/api/state", "/fragment"):
            with urllib.request.urlopen(server.url + path, timeout=10) as r:
                body = r.read().decode()
            assert SECRET not in body and TOKEN not in body, path
    finally:
        gate.go.set()
        server.stop()
        monitor.stop()
        liar.close()
        stop()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET not in logged
    assert "x86-gateway-1 (refused: hello-slot:" in logged or any(
        "x86-gateway-1" in r.getMessage() for r in caplog.records if r.name == "fedge.coordinator.gate")


def check_live_page(browser: Any, ids: list[str], killed: str, refused_id: str) -> None:
    from selenium.webdriver.common.by import By

    rows = browser.find_elements(By.CSS_SELECTOR, "#devices tbody tr")
    assert sorted(r.get_attribute("data-device") for r in rows) == sorted(ids)
    assert cells(browser, "rpi4-2gb-1")["state"] == "online"
    assert cells(browser, killed)["state"] == "offline"
    liar_row = cells(browser, refused_id)
    assert liar_row["state"] == "refused"
    reason = browser.find_element(By.CSS_SELECTOR, f'#devices tr[data-device="{refused_id}"] .refusal').text
    assert reason == ("hello-slot: x86-gateway-1's hello contradicts its slot in the fleet config: arch: "
                      "expected 'tier-xs', got 'tier-xl'")
    assert "no heartbeat" not in cells(browser, "rpi4-2gb-1")["text"]  # its health is shown
    memory = browser.find_element(By.CSS_SELECTOR, '#devices tr[data-device="rpi4-2gb-1"] td.health-mem').text
    assert re.fullmatch(r"[\d.]+ [kMG]B / [\d.]+ [kMGT]B free of [\d.]+ [kMGT]B", memory), memory
    # the charts: one accuracy line and its band per profile, bars for both rounds, a line per device
    acc = browser.find_element(By.ID, "chart-acc-profile")
    assert len(acc.find_elements(By.CSS_SELECTOR, "polyline.series")) == 1  # one profile answered: rpi4-2gb
    assert len(browser.find_element(By.ID, "chart-up-profile").find_elements(By.CSS_SELECTOR, "rect.bar")) == 2
    dev_lines = browser.find_element(By.ID, "chart-acc-device").find_elements(By.CSS_SELECTOR, "polyline")
    assert sorted(p.get_attribute("data-label") for p in dev_lines) == ["rpi4-2gb-1", "rpi4-2gb-2"]


def test_the_dashboard_of_a_state_directory_after_the_fact(tmp_path: Path, mosquitto: MosquittoProcess,
                                                          browser: Any) -> None:
    """``fedge dashboard STATE_DIR``'s page from the files alone: the same numbers as reports.jsonl."""
    from observe_helpers import run_watched
    from selenium.webdriver.common.by import By

    cfg = small_fleet(tmp_path, "after")
    run_watched(cfg, mosquitto, state_dir=tmp_path / "state")
    reports = read_reports(tmp_path / "state" / REPORTS_FILE)
    page_file = tmp_path / "page.html"
    from fedge.cli import main

    assert main(["dashboard", str(tmp_path / "state"), "--config", cfg.source, "--once", str(page_file)]) == 0
    browser.get(page_file.as_uri())
    ids = [i for i, _ in device_ids(cfg)]
    assert [r.get_attribute("data-state") for r in browser.find_elements(By.CSS_SELECTOR, "#devices tbody tr")] \
        == ["registered"] * 3
    check_numbers_equal_reports(browser, reports, ids)
    assert browser.find_element(By.ID, "status").get_attribute("data-state") == "finished"
    assert len(browser.find_element(By.ID, "chart-acc-device").find_elements(By.CSS_SELECTOR, "polyline")) == 3
    png = browser.get_screenshot_as_png()
    (screenshot_dir(tmp_path) / "dashboard_after.png").write_bytes(png)
    assert_not_blank(png)


def test_colours_never_repeat() -> None:
    from fedge.observe.dashboard import device_colour

    assert len({device_colour(i) for i in range(1000)}) == 1000
    assert len(set(profile_colours([f"p{i}" for i in range(30)]).values())) == 30
