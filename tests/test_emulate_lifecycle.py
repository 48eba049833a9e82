"""``fedge emulate up``'s wait for the fleet, without a Docker engine: a stand-in for the engine's client
and a real Mosquitto. The wait reads the devices' retained statuses through ``fedge.mqtt`` with the
coordinator's account, and says which device is missing or died while booting.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import fedge.mqtt.connection
from fedge.emulate.compose import BROKER, Images
from fedge.emulate.discovery import PROJECT_LABEL, SERVICE_LABEL
from fedge.emulate.emulation import Emulation
from fedge.emulate.lifecycle import wait_online
from fedge.errors import EmulationError
from fedge.mqtt.broker import LOOPBACK, MosquittoProcess
from fedge.mqtt.client import MqttClient
from fedge.mqtt.topics import STATUS_OFFLINE, STATUS_ONLINE, FleetTopics

PROJECT = "fedge-emu-000000"


class FakeContainer:
    """What the emulation reads of a container: labels, state, the broker's address, the log."""

    def __init__(self, service: str, *, running: bool = True, exit_code: int = 0, log: bytes = b"") -> None:
        self.name = f"{PROJECT}-{service}-1"
        self.labels = {PROJECT_LABEL: PROJECT, SERVICE_LABEL: service}
        self.attrs: dict[str, Any] = {
            "State": {"Running": running, "Paused": False, "OOMKilled": False, "ExitCode": exit_code},
            "NetworkSettings": {"Networks": {f"{PROJECT}_fleet": {"IPAddress": LOOPBACK}}},
        }
        self._log = log

    def reload(self) -> None:
        pass

    def logs(self, tail: Any = "all") -> bytes:
        return self._log


class FakeClient:
    def __init__(self, containers: list[FakeContainer]) -> None:
        self.containers = self
        self._all = containers

    def list(self, all: bool = False, filters: dict[str, str] | None = None) -> list[FakeContainer]:
        return [c for c in self._all if filters == {"label": f"{PROJECT_LABEL}={PROJECT}"}]


def _emulation(tmp_path: Path, devices: list[str]) -> Emulation:
    (tmp_path / "broker" / "coordinator").mkdir(parents=True)
    (tmp_path / "broker" / "coordinator" / "password").write_text("secret\n")
    limits = {d: {"profile": "rpi4-4gb", "mem_limit_mb": 512} for d in devices}
    return Emulation(tmp_path, PROJECT, "amd64", "t", Images("d", "c", "b"), {}, limits)


def _device(broker: MosquittoProcess, device: str, status: bytes) -> MqttClient:
    """A device that left its retained status on the broker."""
    cli = MqttClient(broker.settings(), f"dev-{device}").start()
    cli.require_published([cli.publish(FleetTopics("t").status(device), status, retain=True)], 5, "status")
    return cli


@pytest.fixture
def broker_port(mosquitto: MosquittoProcess, monkeypatch: pytest.MonkeyPatch) -> MosquittoProcess:
    # The emulation's broker listens on the MQTT port in its container; here on a free loopback port.
    monkeypatch.setattr(fedge.mqtt.connection, "DEFAULT_PORT", mosquitto.port)
    return mosquitto


def test_it_returns_once_every_device_is_online(tmp_path: Path, broker_port: MosquittoProcess) -> None:
    emu = _emulation(tmp_path, ["d1", "d2"])
    client = FakeClient([FakeContainer(BROKER), FakeContainer("d1"), FakeContainer("d2")])
    first = _device(broker_port, "d1", STATUS_ONLINE)
    done = threading.Event()

    def wait() -> None:
        wait_online(emu, client, timeout=20)
        done.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        assert not done.wait(1.5)  # d2 has not said online yet
        second = _device(broker_port, "d2", STATUS_ONLINE)
        assert done.wait(10)
        second.stop()
    finally:
        first.stop()
        waiter.join(20)


def test_it_names_the_devices_that_stay_offline(tmp_path: Path, broker_port: MosquittoProcess) -> None:
    emu = _emulation(tmp_path, ["d1", "d2"])
    client = FakeClient([FakeContainer(BROKER), FakeContainer("d1"), FakeContainer("d2")])
    clients = [_device(broker_port, "d1", STATUS_ONLINE), _device(broker_port, "d2", STATUS_OFFLINE)]
    try:
        with pytest.raises(EmulationError, match=r"devices not online after 1\.5 s: d2 running"):
            wait_online(emu, client, timeout=1.5)
    finally:
        for c in clients:
            c.stop()


def test_a_device_that_exits_while_booting_is_named_with_its_log(tmp_path: Path,
                                                                broker_port: MosquittoProcess) -> None:
    emu = _emulation(tmp_path, ["d1", "d2"])
    dead = FakeContainer("d2", running=False, exit_code=1, log=b"booting\nTraceback: no bundle\n")
    client = FakeClient([FakeContainer(BROKER), FakeContainer("d1"), dead])
    first = _device(broker_port, "d1", STATUS_ONLINE)
    try:
        with pytest.raises(EmulationError, match=r"d2 exited \(1\) before coming online") as err:
            wait_online(emu, client, timeout=20)
        assert "Traceback: no bundle" in err.value.message
    finally:
        first.stop()


def test_no_broker_is_an_emulation_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge.mqtt.broker import free_port

    monkeypatch.setattr(fedge.mqtt.connection, "DEFAULT_PORT", free_port())
    emu = _emulation(tmp_path, ["d1"])
    with pytest.raises(EmulationError, match="did not accept connections in 1 s") as err:
        wait_online(emu, FakeClient([FakeContainer(BROKER)]), timeout=1)
    assert "fedge emulate logs broker" in (err.value.hint or "")


def test_a_relay_that_exits_while_the_fleet_boots_is_named_with_its_log(tmp_path: Path,
                                                                       broker_port: MosquittoProcess) -> None:
    """A sharded fleet's devices are online on the root broker only through their relay: one that died is named,
    with its log's end, rather than its devices timing out."""
    emu = _emulation(tmp_path, ["d1", "d2"])
    emu.shards = [{"name": "1", "parent": None, "broker": "broker-1", "relay": "relay-1", "up": "broker",
                   "devices": ["d1", "d2"]}]
    dead = FakeContainer("relay-1", running=False, exit_code=2, log=b"fedge: error: no such account\n")
    client = FakeClient([FakeContainer(BROKER), FakeContainer("broker-1"), dead, FakeContainer("d1"),
                         FakeContainer("d2")])
    with pytest.raises(EmulationError, match=r"relay-1 exited \(2\) before the devices came online") as err:
        wait_online(emu, client, timeout=20)
    assert "fedge: error: no such account" in err.value.message
    assert err.value.hint == f"fedge emulate logs relay-1 --dir {tmp_path}"
