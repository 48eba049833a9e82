"""Finding what an emulation runs on: the Docker SDK, the engine, the compose CLI, a project's containers.

The containers are found by the labels compose puts on them (project and service), through the
Docker SDK for Python (``docker`` package, the ``[emulate]`` extra). Nothing parses ``docker ps`` text.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from typing import Any

from fedge.errors import EmulationError

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


def docker_sdk() -> Any:
    """The Docker SDK for Python (``docker``). Imported by name so that type checkers run from the
    repository root do not take the top-level ``docker/`` directory for it."""
    try:
        sdk = importlib.import_module("docker")
    except ModuleNotFoundError as exc:
        raise EmulationError("the Docker SDK for Python is not installed",
                             hint="pip install 'fedge[emulate]' (or pip install docker)") from exc
    if not hasattr(sdk, "from_env"):
        raise EmulationError(f"`import docker` found {getattr(sdk, '__path__', sdk)}, not the Docker SDK",
                             hint="pip install 'fedge[emulate]'")
    return sdk


def docker_client() -> Any:
    """A Docker SDK client for the local engine, or a clear error saying how to get one."""
    docker = docker_sdk()
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        raise EmulationError(f"no Docker engine answers: {exc}",
                             hint="start dockerd (apt-get install docker.io; dockerd &), or set DOCKER_HOST") from exc
    return client


def compose_command() -> list[str]:
    """``docker compose`` (v2 plugin) when present, else ``docker-compose`` (Debian's 1.29)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise EmulationError("neither `docker compose` nor `docker-compose` is installed",
                         hint="apt-get install docker-compose (or install the compose plugin)")


def project_containers(client: Any, project: str) -> dict[str, Any]:
    """The containers of compose project ``project`` (all states), by service name."""
    found = client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"})
    return {c.labels.get(SERVICE_LABEL, c.name): c for c in found}
