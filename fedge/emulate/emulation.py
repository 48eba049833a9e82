"""One emulation: what ``fedge emulate up`` wrote into its directory, read back by every other command.

Layout of the emulation directory::

    compose.yaml          broker, coordinator, one service per device, with their limits (sharded: a
                          broker-NAME and a relay-NAME service per shard too)
    emulation.json        project name, images, per-device plan and limits, calibration, shards
    fleet.toml            the fleet config the coordinator runs (sharded: [[shards]] naming the containers)
    broker/               `fedge broker config --hostname broker` (accounts, ACL, bundles; sharded: the root
                          broker, shards/shard-NAME/ and relays/relay-NAME/password)
    devices/ID/           the flashed payload each device boots from (mounted at /boot/firmware)
    coordinator/          the coordinator's state (reports.jsonl, globals, state.json)
    relays/relay-NAME/    a relay's state (relay-state.json, rounds.jsonl: each device it counted per round)
    calibration.json      this host's training rates (reused)
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.atomicfile import write_atomic
from fedge.emulate.compose import BROKER, COORDINATOR, Images
from fedge.emulate.discovery import compose_command, project_containers
from fedge.errors import ConfigError, EmulationError

STATE = "emulation.json"


def project_name(out: Path) -> str:
    """Compose project name of the emulation directory ``out`` (absolute): ``fedge-NAME-HASH``.

    Lower-case letters, digits, '-' and '_' as compose requires; the 6 hex digits of the directory's
    absolute path keep two emulations in directories of the same name (two test runs' ``.../emu``)
    from sharing containers and a network on one engine.
    """
    name = re.sub(r"[^a-z0-9_-]", "-", f"fedge-{out.name}".lower()).strip("-_") or "fedge-emulation"
    return f"{name}-{hashlib.sha256(str(out).encode()).hexdigest()[:6]}"


@dataclass
class Emulation:
    """What ``up`` wrote to ``emulation.json``; the other commands read it back."""

    out: Path
    project: str
    arch: str
    fleet: str
    images: Images
    plans: dict[str, dict[str, Any]]
    limits: dict[str, dict[str, Any]]
    messages: dict[str, str] = field(default_factory=dict)
    http_port: int | None = None  # the coordinator's dashboard on the host's loopback (token in http/token)
    shards: list[dict[str, Any]] = field(default_factory=list)
    """A sharded fleet's shards, in ``[[shards]]`` order: {"name", "parent" (None: the root), "broker" and "relay"
    (their services), "up" (the broker service the relay reports to), "devices"}."""

    @property
    def dashboard(self) -> str | None:
        """The dashboard's URL on this host (None: an emulation written before it was served)."""
        return None if self.http_port is None else f"http://127.0.0.1:{self.http_port}/"

    def save(self) -> None:
        doc = {"project": self.project, "arch": self.arch, "fleet": self.fleet, "images": self.images.__dict__,
               "plans": self.plans, "limits": self.limits, "oom_messages": self.messages,
               "http_port": self.http_port, "shards": self.shards}
        write_atomic(self.out / STATE, (json.dumps(doc, indent=1) + "\n").encode())

    @classmethod
    def load(cls, out: str | Path) -> Emulation:
        p = Path(out).resolve()
        f = p / STATE
        if not f.is_file():
            raise EmulationError(f"{p} holds no emulation ({STATE} is missing)",
                                 hint="pass the --dir that `fedge emulate up --out` wrote")
        d = json.loads(f.read_text())
        return cls(p, d["project"], d["arch"], d["fleet"], Images(**d["images"]), d["plans"], d["limits"],
                   d.get("oom_messages", {}), d.get("http_port"), d.get("shards", []))

    @property
    def devices(self) -> list[str]:
        return list(self.limits)

    @property
    def shard_services(self) -> list[str]:
        """Each shard's broker and relay services (``broker-NAME``, ``relay-NAME``), shard by shard."""
        return [str(s[k]) for s in self.shards for k in ("broker", "relay")]

    @property
    def services(self) -> list[str]:
        """Every service of the compose project: broker, coordinator, the shards' brokers and relays, devices."""
        return [BROKER, COORDINATOR, *self.shard_services, *self.devices]

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*compose_command(), "-p", self.project, "-f", str(self.out / "compose.yaml"), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=self.out)
        if check and proc.returncode != 0:
            hint = None
            if "overlaps" in proc.stderr:
                # The fleet network's subnet (fleet_subnet's pick or --subnet) is in use on this host.
                hint = "another network on this host uses that subnet: run `fedge emulate up` again with --subnet CIDR"
            raise EmulationError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-1500:]}", hint=hint)
        return proc

    def containers(self, client: Any) -> dict[str, Any]:
        """service name → container (all states)."""
        return project_containers(client, self.project)

    def container(self, client: Any, service: str) -> Any:
        known = self.services
        if service not in known:
            raise ConfigError(f"no device or service {service!r} in this emulation",
                              hint=f"use one of {', '.join(known)}")
        c = self.containers(client).get(service)
        if c is None:
            raise EmulationError(f"{service} has no container (the emulation is down)",
                                 hint=f"fedge emulate up ... --out {self.out}")
        return c
