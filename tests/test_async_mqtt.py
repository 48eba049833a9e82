"""Asynchronous mode over a real Mosquitto: a coordinator killed with SIGKILL in the middle of a version's buffer
resumes that version and loses no update it had accepted (issue 27, items 2 and 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedge.common.messages import Message
from fedge.coordinator.store import EngineStore
from fedge.fleet.config import load_fleet
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient
from fedge.mqtt.settings import TransportSettings
from fedge.mqtt.topics import FleetTopics
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet

FLEET_TOML = """
[run]
method = "fedproto"
rounds = 5
dataset = "digits"
fleet = "async-kill"
seed = 5

[partition]
kind = "dirichlet"
alpha = 0.5
fraction = 0.2

[train]
lr = 0.05
local_epochs = 1

[coordinator]
mode = "async"
buffer_size = 3
max_staleness = 5

[[devices]]
profile = "rpi4-2gb"
count = 4
arch = "tier-xs"
"""

FAST = {"reconnect_min_s": 0.2, "reconnect_max_s": 1.0}
WIRE = TransportSettings(global_timeout_s=20)
# Seconds each device sleeps before training: arrivals spread, so a buffer of three fills one update at a time.
DELAYS = (0.3, 1.0, 1.8, 2.6)


def test_a_coordinator_killed_mid_buffer_resumes_its_version_and_loses_no_accepted_update(
        tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET_TOML)
    cfg = load_fleet(path)
    state = tmp_path / "state"
    buffer = state / "buffer"
    devices, _ = build_fleet(cfg)
    _, agents, stop = start_fleet(cfg, devices, mosquitto.settings(**FAST), WIRE, coordinator=False)
    for agent, delay in zip(agents, DELAYS, strict=True):
        train = agent.method.train_round

        def slow(info: Any, train: Any = train, delay: float = delay) -> Any:
            time.sleep(delay)
            return train(info)

        agent.method.train_round = slow  # type: ignore[method-assign]
    announced: list[tuple[int, str, dict[str, int]]] = []
    cond = threading.Condition()

    def on_round(m: Any) -> None:
        if m.payload:
            msg = Message.from_bytes(m.payload)
            with cond:
                announced.append((msg.round, msg.msg_id, msg.info["round"].get("assigned") or {}))
                cond.notify_all()

    spy = MqttClient(mosquitto.settings(), "spy", on_message=on_round).start(5)
    spy.subscribe(FleetTopics(cfg.run.fleet).round)
    cmd = [sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(path), "--broker", mosquitto.url,
           "--state-dir", str(state), "--min-devices", "4", "--round-timeout", "0", "--deadline-slack", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        # Wait until version 2 or later holds one or two accepted updates (of three), after a checkpoint: kill.
        held: list[bytes] = []
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            if (state / "state.json").is_file():
                done = json.loads((state / "state.json").read_text())["completed"]
                held = EngineStore(state).buffer_load(done + 1)[0] if buffer.is_dir() else []
                if done >= 1 and 1 <= len(held) < 3:
                    break
            time.sleep(0.02)
        assert held, (proc.poll(), proc.stdout.read().decode() if proc.poll() is not None and proc.stdout else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        saved = json.loads((state / "state.json").read_text())
        version = saved["completed"] + 1
        held = EngineStore(state).buffer_load(version)[0]  # what it had accepted when it died
        kept = [Message.from_bytes(raw) for raw in held]
        assert 1 <= len(kept) < 3, [(m.sender, m.round) for m in kept]
        before = len(announced)
        last = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=240)
        out = last.stdout.decode()
        assert last.returncode == 0, out
        assert f"resuming fedproto on fleet async-kill after round {version - 1}" in out, out
    finally:
        stop()
        spy.stop()
    reports = [json.loads(line) for line in (state / "reports.jsonl").read_text().splitlines()]
    print(f"killed in version {version} holding {[(m.sender, m.round) for m in kept]}; refused per version:",
          [r["rejected"] for r in reports], "staleness:", [r["staleness"] for r in reports])
    # the restarted process announced the version it died in first, with the tasks it had handed out
    assert announced[before][0] == version, announced[before:]
    assert [r["round"] for r in reports] == [1, 2, 3, 4, 5, 6]  # five versions and the final evaluation
    assert all(len(r["accepted"]) == 3 for r in reports[:5]), [r["accepted"] for r in reports]
    resumed = reports[version - 1]
    # every update accepted before the kill counts in the version it was accepted into, once, with its staleness
    for msg in kept:
        assert msg.sender in resumed["accepted"], (msg.sender, resumed)
        assert resumed["staleness"][msg.sender] == version - msg.round
    assert len(set(resumed["accepted"])) == 3
    # refusals are only the copies a device sent again, or work from before a version the fleet moved past
    for r in reports:
        assert set(r["rejected"]) <= {"replay", "unassigned", "stale"}, (r["round"], r["rejected"])
    assert not list(buffer.glob("*.update*"))  # cleared once each version was saved


ASYNC_WATCHED = """
[coordinator]
mode = "async"
buffer_size = 2
max_staleness = 3
"""


def test_an_async_fleet_over_mosquitto_is_watched_in_versions(tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    """The dashboard and /metrics of an asynchronous run over a real broker, scraped by a real Prometheus: the page
    counts versions, /metrics has the buffer size and the staleness of every accepted update, with the numbers of
    reports.jsonl."""
    import urllib.request

    from observe_helpers import Prometheus, run_watched, small_fleet
    from prometheus_client.parser import text_string_to_metric_families

    from fedge.coordinator.store import REPORTS_FILE, read_reports
    from fedge.observe.dashboard import monitor_routes
    from fedge.observe.web import DashboardServer, Endpoint

    cfg = small_fleet(tmp_path, "async-watched", rounds=3, extra=ASYNC_WATCHED)
    run = run_watched(cfg, mosquitto, state_dir=tmp_path / "state")
    reports = read_reports(tmp_path / "state" / REPORTS_FILE)
    versions = reports[:-1]
    assert [r.round for r in reports] == [1, 2, 3, 4] and all(len(r.accepted) == 2 for r in versions)
    stale = [s for r in versions for s in r.staleness.values()]
    assert len(stale) == 6
    server = DashboardServer(monitor_routes(run.monitor, run.metrics.render), Endpoint("127.0.0.1", 0)).start()
    prom = Prometheus(tmp_path, server.url.removeprefix("http://"))
    try:
        def get(path: str) -> bytes:
            with urllib.request.urlopen(server.url + path, timeout=10) as r:
                return bytes(r.read())

        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(get("/metrics").decode()) for s in fam.samples}
        assert got[("fedge_async_buffer_size", ())] == 2
        assert got[("fedge_update_staleness_count", ())] == len(stale)
        assert got[("fedge_update_staleness_sum", ())] == sum(stale)
        assert got[("fedge_rounds_completed_total", ())] == 4
        assert got[("fedge_updates_accepted_total", ())] == sum(len(r.accepted) for r in reports)
        state = json.loads(get("/api/state"))
        assert (state["mode"], state["unit"], state["buffer_size"]) == ("async", "version", 2)
        assert [r["staleness_max"] for r in state["rounds"]] == [max(r.staleness.values()) for r in versions] + [None]
        html = get("/").decode()
        assert "finished: 4 versions" in html and "acc % (last version)" in html
        # Prometheus reads the hand-made histogram as one
        count = prom.wait_for("fedge_update_staleness_count")
        assert float(count[0]["value"][1]) == len(stale)
        assert float(prom.wait_for("histogram_quantile(1, fedge_update_staleness_bucket)")[0]["value"][1]) >= 0
    finally:
        prom.stop()
        server.stop()


def test_an_async_fleet_with_signed_state_verifies_every_announcement(tmp_path: Path,
                                                                      mosquitto: MosquittoProcess) -> None:
    """Signed state (issue 31) in asynchronous mode: the coordinator announces a version again whenever it hands out
    tasks, each a new signed descriptor carrying round.assigned and the session; devices holding the fleet key accept
    every one (none refused as a replay or unsigned) and the run completes its versions."""
    from fedge.common.signing import Signer, Verifier, generate_key
    from fedge.coordinator.config import EngineConfig
    from fedge.coordinator.engine import RoundEngine
    from fedge.mqtt.device_transport import MqttDeviceTransport

    generate_key(tmp_path / "signing.key", tmp_path / "fleet.pub")
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET_TOML.replace('fleet = "async-kill"', 'fleet = "async-signed"').replace("rounds = 5",
                                                                                                  "rounds = 3"))
    cfg = load_fleet(path)
    assert cfg.asynchronous is not None and cfg.asynchronous.buffer_size == 3
    devices, strat = build_fleet(cfg)
    coord, agents, stop = start_fleet(cfg, devices, mosquitto.settings(), WIRE,
                                      signer=Signer.from_file(tmp_path / "signing.key"),
                                      verifier=Verifier.from_file(tmp_path / "fleet.pub"))
    assert coord is not None
    try:
        engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method=cfg.run.method,
                                                        asynchronous=cfg.asynchronous))
        reports = engine.run()
    finally:
        stop()
    assert [r.round for r in reports] == [1, 2, 3, 4]
    assert all(len(r.accepted) == 3 for r in reports[:-1]) and len(reports[-1].accepted) == 4
    assert all(set(r.rejected) <= {"stale", "unassigned"} for r in reports), [r.rejected for r in reports]
    for agent in agents:
        t = agent.transport
        assert isinstance(t, MqttDeviceTransport) and t.verifier is not None
        assert t.stats.rejected == {}, (agent.device.device_id, t.stats.rejected)  # every descriptor verified
        assert t.changes >= 4  # descriptors of three versions (announced again with new tasks) and the final
    assert sum(a.task_done is not None for a in agents) == 4  # every device trained at least one task


def test_fedge_simulate_over_mqtt_runs_async_versions_on_the_real_clock(tmp_path: Path, embedded_broker: None) -> None:
    """``fedge simulate --transport mqtt`` with an asynchronous fleet: versions of K updates over the embedded
    broker, and no virtual clock in results.json (versions on the real clock have no synchronous replay)."""
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    path = tmp_path / "fleet.toml"
    path.write_text(FLEET_TOML.replace('fleet = "async-kill"', 'fleet = "async-sim"').replace("rounds = 5",
                                                                                               "rounds = 2"))
    res = simulate(load_fleet(path), transport="mqtt")
    assert [r.round for r in res.reports] == [1, 2, 3]
    assert all(len(r.accepted) == 3 and len(r.staleness) == 3 for r in res.reports[:-1])
    assert res.clock is None
    doc = build_results(res)
    assert doc["clock"] is None and [r["round"] for r in doc["rounds_log"]] == [1, 2, 3]
