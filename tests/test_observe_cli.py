"""The commands end to end: ``fedge coordinator run --http --tensorboard`` with two ``fedge edge run`` processes over
Mosquitto. The page, /api/state and /metrics answer while the run goes on, with a token; the heartbeats of both
devices reach the page; TensorBoard's reader finds the rounds; the broker password given on the command line
appears nowhere: not in the log (-vv), not on the page, not in /metrics; ``fedge dashboard --once`` draws the
finished run from its state directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from observe_helpers import small_fleet

from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.mqtt.broker import MosquittoProcess

pytestmark = pytest.mark.slow  # 47-99 s here: three rounds of two fedge edge run processes

PASSWORD = "broker-password-never-shown-777"
TOKEN = "dashboard-token-never-shown-888"


def get(url: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return bytes(r.read())


def wait_for_hellos(broker: MosquittoProcess, fleet: str, ids: set[str], timeout_s: float = 180) -> None:
    """Until every device of ``ids`` has its retained hello on the broker (each process imports torch first: on
    a loaded machine that takes longer than the coordinator's --wait-for-fleet)."""
    from fedge.mqtt.client import MqttClient, Received
    from fedge.mqtt.topics import FleetTopics

    topics = FleetTopics(fleet)
    seen: set[str] = set()

    def on_message(m: Received) -> None:
        parsed = topics.parse_device(m.topic)
        if parsed is not None:
            seen.add(parsed.device_id)

    mq = MqttClient(broker.settings(), "test-hello-watch", clean_session=True, on_message=on_message)
    mq.subscribe(topics.device_filter("hello"))
    mq.start()
    try:
        deadline = time.time() + timeout_s
        while not ids <= seen:
            assert time.time() < deadline, f"hellos after {timeout_s:.0f} s: {sorted(seen)}"
            time.sleep(0.2)
    finally:
        mq.stop()


def test_coordinator_run_with_http_and_tensorboard(tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    cfg = small_fleet(tmp_path, "cli", rounds=3)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "coordinator.log").open("w+b")
    # The devices first, the coordinator once their hellos are retained on the broker: it then finds them at
    # once, and its "waiting for hellos" lines name the third device of the fleet, which never says hello.
    devices = [subprocess.Popen([sys.executable, "-m", "fedge", "edge", "run", "--config", cfg.source, "--device-id",
                                 dev, "--broker", mosquitto.url, "--heartbeat", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env) for dev in ("rpi4-2gb-1", "x86-gateway-1")]
    procs = list(devices)
    states: list[dict] = []
    try:
        wait_for_hellos(mosquitto, cfg.run.fleet, {"rpi4-2gb-1", "x86-gateway-1"})
        coord = subprocess.Popen(
            [sys.executable, "-m", "fedge", "-vv", "coordinator", "run", "--config", cfg.source, "--broker",
             mosquitto.url, "--username", "coordinator", "--password", PASSWORD, "--state-dir", str(tmp_path / "state"),
             "--wait-for-fleet", "8", "--min-devices", "2", "--http", "127.0.0.1:0", "--http-token-file", str(token),
             "--tensorboard", str(tmp_path / "tb"), "--wait-log", "2",
                 # no wall-clock deadline: on a loaded machine a late device would drop out of a round
                 # (CI saw [2, 2, 1, 2] accepted); the rounds wait for both devices
                 "--deadline-slack", "0", "--round-timeout", "0"], stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(coord)
        url = None
        deadline = time.time() + 120
        while time.time() < deadline and url is None:
            log.seek(0)
            found = re.search(rb"dashboard on (http://127\.0\.0\.1:\d+)/", log.read())
            url = found.group(1).decode() if found else None
            time.sleep(0.2)
        assert url is not None, "the coordinator never said where its dashboard is"
        with pytest.raises(urllib.error.HTTPError) as no_token:
            urllib.request.urlopen(url + "/api/state", timeout=10)
        assert no_token.value.code == 401
        while coord.poll() is None:
            try:
                states.append(json.loads(get(url + "/api/state")))
                page = get(url + "/").decode()
                metrics = get(url + "/metrics").decode()
                assert PASSWORD not in page and PASSWORD not in metrics and TOKEN not in page
            except (urllib.error.URLError, ConnectionError):
                break  # the run ended between two requests
            time.sleep(0.5)
        assert coord.wait(240) == 0
        for d in devices:
            assert d.wait(120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log.seek(0)
    text = log.read().decode()
    assert PASSWORD not in text and TOKEN not in text
    assert "may be read by other users" not in text  # the token file is 0600
    assert states, text[-2000:]
    # heartbeats of both devices reached the monitor; the third device of the fleet never said hello
    healthy = {d["device"] for s in states for d in s["devices"] if d["health"]}
    assert healthy == {"rpi4-2gb-1", "x86-gateway-1"}, text[-2000:]
    last = states[-1]
    assert next(d for d in last["devices"] if d["device"] == "rpi4-2gb-2")["state"] == "no hello"
    assert "waiting for hellos from 1 of 3 devices" in text and "rpi4-2gb-2 (no hello yet)" in text
    reports = read_reports(tmp_path / "state" / REPORTS_FILE)
    assert [len(r.accepted) for r in reports] == [2, 2, 2, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("round/accepted")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("traffic/bytes_up")] == [float(sum(r.bytes_up.values())) for r in reports]
    # after the fact, from the state directory
    page_file = tmp_path / "after.html"
    out = subprocess.run([sys.executable, "-m", "fedge", "dashboard", str(tmp_path / "state"), "--config", cfg.source,
                          "--once", str(page_file)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    html = page_file.read_text()
    for dev in ("rpi4-2gb-1", "x86-gateway-1"):
        row = re.search(rf'<tr data-device="{dev}".*?</tr>', html)
        assert row is not None
        assert 'class="n accepted" data-value="4"' in row.group(0)
        ups = sum(r.bytes_up[dev] for r in reports)
        assert f'class="n up" data-value="{ups}"' in row.group(0)
    assert '<tr data-device="rpi4-2gb-2" data-state="no hello">' in html
