"""What watching a fleet costs at N = 1,000 (issue 28's targets): the page loads in < 1 s, a ``/metrics``
scrape takes < 50 ms, and serving both — one scrape every 5 s, one open page — costs the coordinator at most
5 % more CPU per round.

The fleet is ``benchmarks.fleet_scale``'s: N lightweight devices speaking the wire protocol through Mosquitto
on loopback to the real coordinator (``RoundEngine`` + FedProto + the MQTT transport, checkpointing every round)
in its own process. Runs alternate between the coordinator alone ("off") and the coordinator with what
``fedge coordinator run --http`` adds ("on": the FleetMonitor, FleetMetrics and the web server), so that
load drift on a shared machine does not favour either. During an "on" run:

* a real headless Chromium (Debian's chromium through chromium-driver) opens the page a few seconds into
  the run — its load time is the browser's navigation timing (``loadEventEnd``), server drawing included —
  and keeps it open: the page fetches its live part every 5 s itself (every 2 s below 200 devices);
* a scraper GETs ``/metrics`` every 5 s and times each (request to last byte).

Coordinator CPU (user + sys of its process) per training round is the median over the rounds of all runs of
a mode. The device side is not in the coordinator's process. Writes ``benchmarks/results/observe.json``.

    .venv/bin/python -m benchmarks.observe                       # N = 1000, 40 rounds, 2 repeats per mode
    .venv/bin/python -m benchmarks.observe --n 100 --rounds 10 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS
from benchmarks.fleet_scale import run_fedge
from fedge.mqtt.broker import MosquittoProcess, loopback_config

OUT = RESULTS / "observe.json"
SCRAPE_EVERY_S = 5.0
PAGE_AFTER_S = 4.0  # open the page this long after the server is up: devices registered, rounds under way


class Watcher(threading.Thread):
    """One open page (Chromium) and a scrape every 5 s, against the coordinator whose URL appears in a file."""

    def __init__(self, url_file: Path) -> None:
        super().__init__(daemon=True)
        self.url_file = url_file
        self.stop_event = threading.Event()
        self.scrapes_ms: list[float] = []
        self.scrape_bytes = 0
        self.page_load_ms: float | None = None
        self.page_bytes = 0
        self.browser_note = ""
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.url_file.is_file() or not self.url_file.read_text():
            if self.stop_event.wait(0.05):
                return
        url = self.url_file.read_text().strip()
        browser = None
        start = time.monotonic()
        next_scrape = start + 1.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            if browser is None and not self.browser_note and now - start >= PAGE_AFTER_S:
                browser = self._open_page(url)
            if now >= next_scrape:
                next_scrape = now + SCRAPE_EVERY_S
                try:
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                        body = r.read()
                    self.scrapes_ms.append(1000 * (time.perf_counter() - t0))
                    self.scrape_bytes = len(body)
                except OSError as exc:  # the coordinator has finished
                    self.errors.append(str(exc))
            self.stop_event.wait(0.05)
        if browser is not None:
            browser.quit()

    def _open_page(self, url: str) -> Any:
        if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
            self.browser_note = "no chromium/chromedriver: apt-get install chromium chromium-driver"
            return None
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or ""
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                    f"--user-data-dir={tempfile.mkdtemp(prefix='fedge-bench-chromium-')}"):
            opts.add_argument(arg)
        browser = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver") or ""), options=opts)
        browser.get(url + "/")
        nav = browser.execute_script("return performance.getEntriesByType('navigation')[0].toJSON()")
        self.page_load_ms = float(nav["loadEventEnd"])  # from the navigation's start, server drawing included
        self.page_bytes = int(nav.get("transferSize") or 0)
        self.browser_note = "chromium"
        return browser


def drawing_ms(n: int, rounds: int = 40, repeat: int = 20) -> dict[str, float]:
    """Server-side time of one /metrics text and one page, in this process, for a fleet of ``n`` devices each
    with a heartbeat and ``rounds`` rounds of reports: what a scrape and a page cost the coordinator itself,
    apart from the network and the machine's load."""
    from fedge.common.health import parse_health
    from fedge.common.rounds import DeviceInfo
    from fedge.coordinator.report import RoundReport
    from fedge.edge.health import HealthSampler
    from fedge.observe.dashboard import page
    from fedge.observe.metrics import FleetMetrics
    from fedge.observe.monitor import FleetMonitor

    rec = parse_health(HealthSampler("tier-m").sample(last_round=rounds, model_round=rounds, last_error=None))
    ids = [f"dev-{i:04d}" for i in range(n)]
    mon = FleetMonitor(fleet="f", method="fedproto", total_rounds=rounds,
                       fleet_devices={d: DeviceInfo(d, "tier-m", f"profile-{i % 5}") for i, d in enumerate(ids)})
    for d in mon.devices.values():
        d.health, d.health_at, d.registered = rec, time.time(), True
    for r in range(1, rounds + 1):
        mon.add_report(RoundReport(round=r, phase="train", accepted=ids, bytes_up=dict.fromkeys(ids, 2992),
                                   bytes_down=dict.fromkeys(ids, 3300), seconds=0.4,
                                   metrics={d: {"acc_global": 0.5, "acc_local": 0.8} for d in ids}))
    metrics = FleetMetrics(mon)
    out = {}
    for name, fn in (("metrics", metrics.render), ("page", lambda: page(mon.view())),
                     ("page_all_rows", lambda: page(mon.view(), every_row=True))):
        fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="devices (default 1000)")
    p.add_argument("--rounds", type=int, default=40, help="training rounds per run (default 40)")
    p.add_argument("--repeat", type=int, default=2, help="runs per mode, alternating (default 2)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="fedge-observe-") as tmp:
        broker = MosquittoProcess(port=None, max_message_bytes=1 << 20)
        broker.config_path.write_text(loopback_config(broker.port, max_message_bytes=1 << 20))
        broker.start()
        try:
            for rep in range(args.repeat):
                for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    work = Path(tmp) / f"{mode}-{rep}"
                    url_file = work / "url"
                    watcher = Watcher(url_file) if mode == "on" else None
                    if watcher is not None:
                        watcher.start()
                    t0 = time.perf_counter()
                    res = run_fedge(broker.port, args.n, args.rounds, work, observe=url_file if watcher else None)
                    if watcher is not None:
                        watcher.stop_event.set()
                        watcher.join(60)
                        res["scrapes_ms"] = watcher.scrapes_ms
                        res["scrape_bytes"] = watcher.scrape_bytes
                        res["page_load_ms"] = watcher.page_load_ms
                        res["page_bytes"] = watcher.page_bytes
                        res["browser"] = watcher.browser_note
                    res["wall_s"] = time.perf_counter() - t0
                    runs[mode].append(res)
                    cpu = statistics.median(res["cpu_seconds_per_round"])
                    print(f"run {rep + 1} {mode:>3}: median coordinator CPU {1000 * cpu:.1f} ms/round, round "
                          f"{1000 * statistics.median(res['round_seconds']):.0f} ms"
                          + (f", scrapes {[round(x) for x in res['scrapes_ms']]} ms, page "
                             f"{res['page_load_ms']} ms" if mode == "on" else ""), flush=True)
        finally:
            broker.close()
    cpu = {m: statistics.median([c for r in rs for c in r["cpu_seconds_per_round"]]) for m, rs in runs.items()}
    mean_cpu = {m: statistics.fmean([c for r in rs for c in r["cpu_seconds_per_round"]]) for m, rs in runs.items()}
    scrapes = [s for r in runs["on"] for s in r["scrapes_ms"]]
    pages = [r["page_load_ms"] for r in runs["on"] if r["page_load_ms"] is not None]
    summary = {
        "n": args.n, "rounds": args.rounds, "repeat": args.repeat,
        "coordinator_cpu_ms_per_round": {m: 1000 * c for m, c in cpu.items()},
        "coordinator_cpu_ms_per_round_mean": {m: 1000 * c for m, c in mean_cpu.items()},
        "cpu_increase_pct_median": 100 * (cpu["on"] / cpu["off"] - 1),
        "cpu_increase_pct_mean": 100 * (mean_cpu["on"] / mean_cpu["off"] - 1),
        "round_ms": {m: 1000 * statistics.median([s for r in rs for s in r["round_seconds"]])
                     for m, rs in runs.items()},
        "scrape_ms": {"median": statistics.median(scrapes) if scrapes else None, "max": max(scrapes, default=None),
                      "count": len(scrapes), "bytes": max((r["scrape_bytes"] for r in runs["on"]), default=0)},
        "page_load_ms": {"each": pages, "max": max(pages, default=None),
                         "bytes": max((r["page_bytes"] for r in runs["on"]), default=0)},
        "browser": sorted({r["browser"] for r in runs["on"]}),
        "server_side_ms": drawing_ms(args.n),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"N = {args.n}: coordinator CPU per round {summary['coordinator_cpu_ms_per_round']['off']:.1f} ms off, "
          f"{summary['coordinator_cpu_ms_per_round']['on']:.1f} ms on ({summary['cpu_increase_pct_median']:+.1f} % "
          f"median, {summary['cpu_increase_pct_mean']:+.1f} % mean; target <= +5 %); /metrics scrape median "
          f"{summary['scrape_ms']['median']} ms, max {summary['scrape_ms']['max']} ms (target < 50); page load "
          f"{summary['page_load_ms']['max']} ms (target < 1000); drawn in this process: "
          f"{ {k: round(v, 1) for k, v in summary['server_side_ms'].items()} } ms; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
