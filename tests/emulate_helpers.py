"""A stand-in for the Docker engine as ``fedge.emulate`` uses it (containers found by their compose labels, their
state, kill/start/pause/restart/update, the fleet network), for the fault and status tests that need no engine."""

from __future__ import annotations

from typing import Any

from fedge.emulate.compose import HEALTH_OVERRIDE_PATH, NETWORK
from fedge.emulate.discovery import PROJECT_LABEL, SERVICE_LABEL


class Container:
    """One service's container: its State as the engine reports it; the operations change it and are recorded."""

    def __init__(self, status: str = "running", exit_code: int = 0, *, project: str = "p", service: str = "dev-1",
                 networks: tuple[str, ...] | None = None) -> None:
        self.name = f"{project}_{service}_1"
        self.labels = {PROJECT_LABEL: project, SERVICE_LABEL: service}
        self.status = status
        self.exit_code = exit_code
        self.networks = set(networks if networks is not None else (f"{project}_{NETWORK}",))
        self.calls: list[str] = []
        self.cpu_period, self.cpu_quota = 0, 0
        self.env = [f"FEDGE_HEALTH_OVERRIDE={HEALTH_OVERRIDE_PATH}"]

    @property
    def attrs(self) -> dict[str, Any]:
        return {"State": {"Status": self.status, "Running": self.status in ("running", "paused"),
                          "Paused": self.status == "paused", "ExitCode": self.exit_code,
                          "FinishedAt": "2026-12-01T04:47:51.215Z", "OOMKilled": False},
                "NetworkSettings": {"Networks": {n: {"IPAddress": "10.200.0.5"} for n in self.networks}},
                "HostConfig": {"CpuPeriod": self.cpu_period, "CpuQuota": self.cpu_quota},
                "Config": {"Env": self.env}}

    def reload(self) -> None:
        pass

    def kill(self) -> None:
        self.calls.append("kill")
        self.status, self.exit_code = "exited", 137

    def start(self) -> None:
        self.calls.append("start")
        self.status = "running"

    def restart(self, timeout: int = 10) -> None:
        self.calls.append("restart")
        self.status = "running"

    def pause(self) -> None:
        self.calls.append("pause")
        self.status = "paused"

    def unpause(self) -> None:
        self.calls.append("unpause")
        self.status = "running"

    def update(self, cpu_period: int | None = None, cpu_quota: int | None = None) -> None:
        self.calls.append(f"update {cpu_period} {cpu_quota}")
        self.cpu_period, self.cpu_quota = cpu_period or 0, max(0, cpu_quota or 0)

    def exec_run(self, cmd: list[str], user: str = "") -> tuple[int, bytes]:
        self.calls.append("exec " + " ".join(cmd))
        return 0, b""


class Network:
    """The fleet network: (dis)connects containers, remembering the aliases each reconnection gave."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.aliases: list[list[str]] = []

    def disconnect(self, c: Container) -> None:
        c.networks.discard(self.name)

    def connect(self, c: Container, aliases: list[str], ipv4_address: str | None = None) -> None:
        self.aliases.append(aliases)
        c.networks.add(self.name)


class Client:
    """The engine's client: ``containers.list`` by project label, ``networks.get`` of the project's fleet network."""

    def __init__(self, *containers: Container, project: str = "p") -> None:
        self._all = list(containers)
        self.net = Network(f"{project}_{NETWORK}")
        self.containers = self
        self.networks = self

    def list(self, all: bool = False, filters: dict[str, str] | None = None) -> list[Container]:
        return [c for c in self._all if filters == {"label": f"{PROJECT_LABEL}={c.labels[PROJECT_LABEL]}"}]

    def get(self, name: str) -> Network:
        assert name == self.net.name, name
        return self.net
