"""An asynchronous fleet whose Mosquitto is killed with SIGKILL (issue 47): three FedProto devices on digits
(observe_helpers' small fleet),
``buffer_size = 2``, the broker killed once per run at one point of version 2 and restarted on the same port, with
persistence off and on (``autosave_interval 1``: the restarted broker holds retained messages and the coordinator's
session from up to a second before the crash — an older round descriptor among them).

The kill points:

* ``announced`` — right after the coordinator announced version 2 with its tasks (the devices may not have them);
* ``training`` — while a device trains from version 2;
* ``uploaded`` — a device's update from version 2 was acknowledged by the broker, which dies before the coordinator
  has it (the coordinator's copy is dropped as it arrives, then the broker is killed: what a crash between the
  PUBACK and the delivery loses);
* ``publishing`` — while version 2's global state is being published.

``round_timeout_s = 0`` (wait forever): only the recovery can finish the run. Every time the run completes with
every version filled, the state directory's update logs hold exactly the updates the reports count (none lost,
none twice), and the coordinator's log names the re-announcement."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from observe_helpers import small_fleet

from fedge.common.messages import Message
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.coordinator.store import BUFFER_DIR, LOG_SUFFIX, EngineStore
from fedge.mqtt.broker import MosquittoProcess, free_port, loopback_config
from fedge.mqtt.client import Received
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.settings import TransportSettings
from fedge.mqtt.topics import FleetTopics
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet

ASYNC = """
[coordinator]
mode = "async"
buffer_size = 2
max_staleness = 10
"""

FAST = {"reconnect_min_s": 0.2, "reconnect_max_s": 1.0}
# The coordinator comes back after the devices (1.5-3 s against 0.2-0.4 s): without persistence, what they send
# meanwhile has no subscriber and is dropped — the order that lost the updates in the probe.
SLOW = {"reconnect_min_s": 1.5, "reconnect_max_s": 3.0}
WIRE = TransportSettings(global_timeout_s=20)
KILL_VERSION = 2
DOWN_S = 0.5  # the broker is back this long after the kill
RUN_LIMIT_S = 50.0  # a stalled run fails here (round_timeout_s = 0 would wait forever)


def crashable_broker(workdir: Path, persistence: bool) -> MosquittoProcess:
    """A loopback Mosquitto, with persistence saved every second when ``persistence``."""
    port = free_port()
    config = loopback_config(port, persistence_dir=workdir if persistence else None)
    return MosquittoProcess(config.replace("autosave_interval 30", "autosave_interval 1"), port=port, workdir=workdir)


class Crash:
    """Kills the broker once (SIGKILL) and restarts it on the same port ``DOWN_S`` later."""

    def __init__(self, broker: MosquittoProcess) -> None:
        self.broker = broker
        self.lock = threading.Lock()
        self.where: list[str] = []
        self.back_at = 0.0

    def once(self, where: str) -> bool:
        with self.lock:
            if self.where:
                return False
            self.where.append(where)
            self.broker.kill()
            time.sleep(DOWN_S)
            self.broker.start()
            self.back_at = time.monotonic()
            return True


def arm(point: str, crash: Crash, coord: Any, agents: list[Any], fleet: str) -> None:
    """Make ``crash`` happen at ``point`` of version KILL_VERSION."""
    if point == "announced":
        announce = coord.announce_round

        def announced(data: bytes) -> None:
            announce(data)
            if Message.from_bytes(data).round == KILL_VERSION:
                crash.once(point)

        coord.announce_round = announced
    elif point == "publishing":
        publish = coord.publish_global

        def publishing(artifact: str, data: bytes) -> None:
            if Message.from_bytes(data).round == KILL_VERSION:
                crash.once(point)
            publish(artifact, data)

        coord.publish_global = publishing
    elif point == "training":
        for agent in agents:
            train = agent.method.train_round

            def training(info: Any, train: Any = train) -> Any:
                if info.round == KILL_VERSION:
                    crash.once(point)
                return train(info)

            agent.method.train_round = training
    elif point == "uploaded":
        topics = FleetTopics(fleet)
        for agent in agents:
            def uploaded(m: Received) -> None:
                if m.payload and not m.retain and Message.from_bytes(m.payload).round == KILL_VERSION \
                        and crash.once(point):
                    return  # acknowledged to the device, never delivered to the coordinator
                coord._on_message(m)

            coord.client.route(topics.update(agent.device.device_id), uploaded)
    else:
        raise AssertionError(point)


@pytest.mark.parametrize("persistence", [False, True], ids=["no-persistence", "persistence"])
@pytest.mark.parametrize("point", ["announced", "training", "uploaded", "publishing"])
def test_an_async_fleet_completes_every_version_after_a_broker_sigkill(
        tmp_path: Path, point: str, persistence: bool, mosquitto_bin: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedge")
    fleet = f"crash-{point}-{int(persistence)}"
    cfg = small_fleet(tmp_path, fleet, rounds=3, extra=ASYNC)
    state, archive = tmp_path / "state", tmp_path / "logs"  # archive/buffer/: each version's update log
    (archive / BUFFER_DIR).mkdir(parents=True)
    broker = crashable_broker(tmp_path, persistence).start()
    devices, strat = build_fleet(cfg)
    coord = MqttCoordinatorTransport(broker.settings(**SLOW), fleet, WIRE).start()
    _, agents, stop_devices = start_fleet(cfg, devices, broker.settings(**FAST), WIRE, coordinator=False)

    def stop() -> None:
        stop_devices()
        coord.close()

    coord.wait_for_hellos([d.info.device_id for d in devices], 30)
    crash = Crash(broker)
    try:
        arm(point, crash, coord, agents, fleet)
        engine = RoundEngine(strat, coord, EngineConfig(fleet=fleet, method=cfg.run.method, round_timeout_s=0,
                                                        asynchronous=cfg.asynchronous), state_dir=state)
        assert engine.store is not None
        clear = engine.store.buffer_clear

        def keep_logs(keep_version: int | None = None) -> None:  # the update logs, before a version clears them
            for f in (state / BUFFER_DIR).glob(f"*{LOG_SUFFIX}"):
                shutil.copy(f, archive / BUFFER_DIR / f.name)
            clear(keep_version)

        engine.store.buffer_clear = keep_logs  # type: ignore[method-assign]
        published: dict[int, float] = {}
        runner = threading.Thread(target=lambda: engine.run(lambda r: published.setdefault(r.round,
                                                                                            time.monotonic())),
                                  daemon=True)
        runner.start()
        runner.join(RUN_LIMIT_S)
        assert not runner.is_alive(), (f"stalled after the crash at {crash.where}: {len(engine.reports)} versions, "
                                       f"tasks {engine.tasks}")
    finally:
        stop()
        broker.close()
    assert crash.where == [point] and coord.client.connects >= 2  # the broker really went away once
    reports = engine.reports
    assert [r.round for r in reports] == [1, 2, 3, 4]  # three versions and the final evaluation
    versions = reports[:-1]
    assert all(len(r.accepted) == 2 for r in versions), [r.accepted for r in versions]
    # the state directory's update logs against the reports: every accepted update written once, counted once
    ids: list[str] = []
    for r in versions:
        logged = [Message.from_bytes(raw) for raw in EngineStore(archive).buffer_load(r.round)[0]]
        assert [m.sender for m in logged] == r.accepted, (r.round, [m.sender for m in logged], r.accepted)
        assert {m.sender: r.round - m.round for m in logged} == r.staleness
        ids += [m.msg_id for m in logged]
    assert len(ids) == len(set(ids)) == 6  # no update counted twice, in one version or across versions
    for r in reports:  # what was refused is only the copies sent again, or work the fleet had moved past
        assert set(r.rejected) <= {"replay", "unassigned", "stale"}, (r.round, r.rejected)
    text = caplog.text
    assert f"re-announced version {KILL_VERSION}" in text or f"re-announced version {KILL_VERSION + 1}" in text, \
        text[-3000:]
    back = min(t for v, t in published.items() if t > crash.back_at)
    assert back - crash.back_at < 20.0  # recovered by the re-announcement, not by a timeout
