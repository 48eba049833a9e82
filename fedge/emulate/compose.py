"""The compose file of an emulated fleet: broker, coordinator and one service per device.

Plain Compose-spec (no ``version:`` key, no top-level ``name:``), which both Debian's
docker-compose 1.29 and ``docker compose`` v2 accept; paths are relative to the file's directory
except the broker's config, which Mosquitto reads by the absolute path ``fedge broker config``
wrote into it, so it is mounted at that same path.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.emulate.limits import DeviceLimits
from fedge.errors import ConfigError

BROKER = "broker"
COORDINATOR = "coordinator"
HTTP_PORT = 8321  # the coordinator's dashboard inside its container
HTTP_TOKEN = "token"  # its file in DIR/http/
NETWORK = "fleet"
ROLE_LABEL = "io.fedge.role"
PROFILE_LABEL = "io.fedge.profile"


@dataclass(frozen=True)
class Images:
    """Image tags of one emulation."""

    device: str
    coordinator: str
    broker: str


@dataclass(frozen=True)
class CoordinatorArgs:
    """What the coordinator container runs with (paths inside the container)."""

    devices: int
    min_devices: int
    deadline_slack: float = 3.0
    round_timeout_s: float = 600.0
    quorum_timeout_s: float = 600.0
    wait_for_fleet_s: float = 120.0
    """Round 1 waits this long for every device's hello (the emulator starts the coordinator once all are online)."""
    http_port: int | None = None
    """The host's loopback port of the coordinator's dashboard and /metrics (None: not served)."""


def fleet_subnet(project: str) -> str:
    """The fleet network's IPv4 subnet: a /24 in 10.200.0.0-10.249.255.0 picked by the project's hash.

    A configured subnet (rather than the engine's pick) lets ``fault partition`` reconnect a device with
    the address it had: the engine allows a fixed address only on a network with a configured subnet,
    and with another address the device's open MQTT connection would hang until its keep-alive runs
    out, as a real board's does when its address changes, which a short outage does not do.
    """
    h = hashlib.sha256(project.encode()).digest()
    return f"10.{200 + h[0] % 50}.{h[1]}.0/24"


def check_subnet(subnet: str, devices: int) -> str:
    """``subnet`` (``fedge emulate up --subnet``) in canonical form, if it is a private IPv4 network with
    room for the broker, the coordinator, ``devices`` devices and the engine's gateway; else ConfigError."""
    try:
        net = ipaddress.ip_network(subnet, strict=False)
    except ValueError as exc:
        raise ConfigError(f"--subnet {subnet!r} is not a network ({exc})", hint="e.g. --subnet 10.201.7.0/24") from exc
    if net.version != 4 or not net.is_private:
        raise ConfigError(f"--subnet {subnet} is not a private IPv4 network",
                          hint="pick one in 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16 that no other network uses")
    hosts = net.num_addresses - 2  # network and broadcast addresses
    if hosts < devices + 3:
        raise ConfigError(f"--subnet {subnet} has {hosts} host addresses; the emulation needs {devices + 3} "
                          f"({devices} devices, broker, coordinator, gateway)", hint="use a larger prefix, e.g. /24")
    return str(net)


def compose_dict(out: Path, images: Images, limits: list[DeviceLimits], coord: CoordinatorArgs,
                 *, platform: str | None = None, device_args: tuple[str, ...] = (),
                 subnet: str | None = None) -> dict[str, Any]:
    """The compose document (a dict ready for YAML). ``out`` is the emulation directory (absolute).

    ``device_args`` are appended to every device's ``fedge edge run`` (e.g. ``--keep-running``);
    ``subnet`` is the fleet network's (:func:`fleet_subnet`; default: the engine picks one).
    """
    broker_dir = str(out / "broker")
    services: dict[str, Any] = {
        BROKER: {
            "image": images.broker,
            "command": ["-c", f"{broker_dir}/mosquitto.conf"],
            "volumes": [f"./broker:{broker_dir}"],
            "networks": [NETWORK],
            "labels": {ROLE_LABEL: "broker"},
        },
        COORDINATOR: {
            "image": images.coordinator,
            "command": [
                "--config", "/fedge/fleet.toml", "--state-dir", "/fedge/state",
                "--broker", f"mqtt://{BROKER}:1883", "--username", "fedge-coordinator",
                "--password-file", "/fedge/broker/coordinator/password",
                # Round 1 waits for every device's hello, as `fedge simulate` starts with all of them; later
                # rounds start once --min-devices are online (a killed device does not stop the fleet).
                "--wait-for-fleet", f"{coord.wait_for_fleet_s:g}",
                "--min-devices", str(coord.min_devices), "--quorum-timeout", f"{coord.quorum_timeout_s:g}",
                "--deadline-slack", f"{coord.deadline_slack:g}", "--round-timeout", f"{coord.round_timeout_s:g}",
            ],
            "volumes": ["./fleet.toml:/fedge/fleet.toml:ro", "./broker/coordinator:/fedge/broker/coordinator:ro",
                        "./coordinator:/fedge/state"],
            "environment": {"PYTHONUNBUFFERED": "1"},
            "depends_on": [BROKER],
            "networks": [NETWORK],
            "labels": {ROLE_LABEL: "coordinator"},
        },
    }
    if coord.http_port is not None:
        # Inside its container the coordinator must bind all of its addresses to be reachable through the
        # published port, so it needs the token (fedge.coordinator.web refuses otherwise); the host side is
        # published on loopback only.
        services[COORDINATOR]["command"] += ["--http", f"0.0.0.0:{HTTP_PORT}", "--http-token-file",
                                             f"/fedge/http/{HTTP_TOKEN}"]
        services[COORDINATOR]["volumes"].append("./http:/fedge/http:ro")
        services[COORDINATOR]["ports"] = [f"127.0.0.1:{coord.http_port}:{HTTP_PORT}"]
    for lim in limits:
        svc: dict[str, Any] = {
            "image": images.device,
            "hostname": lim.device_id,
            "volumes": [f"./devices/{lim.device_id}:/boot/firmware:ro"],
            # tc inside the container shapes its own link (docker/shape-link.sh).
            "cap_add": ["NET_ADMIN"],
            "cpus": lim.cpus,
            "mem_limit": f"{lim.mem_limit_mb}m",
            "memswap_limit": f"{lim.mem_limit_mb}m",  # no swap: a Pi without zram/swap runs out, not slows down
            "environment": {
                "OMP_NUM_THREADS": str(lim.threads),
                # OpenMP's threads wait for work by spinning: under a CFS quota, on a host whose other containers
                # keep the cores busy, a 2-thread device then burnt its quota spinning and trained 9x slower
                # than with waits that sleep (docs/emulate.md); a real device has its cores to itself
                "OMP_WAIT_POLICY": "PASSIVE",
                "FEDGE_UPLINK_KBIT": str(lim.uplink_kbit),
                "FEDGE_DOWNLINK_KBIT": str(lim.downlink_kbit),
                "FEDGE_DELAY_MS": f"{lim.delay_ms:g}",
                "FEDGE_LOSS_PCT": f"{lim.loss_pct:g}",
            },
            "depends_on": [BROKER],
            "networks": [NETWORK],
            "labels": {ROLE_LABEL: "device", PROFILE_LABEL: lim.profile},
        }
        if device_args:
            svc["command"] = list(device_args)
        if platform:
            svc["platform"] = platform
        services[lim.device_id] = svc
    network: dict[str, Any] = {"ipam": {"config": [{"subnet": subnet}]}} if subnet else {}
    return {"services": services, "networks": {NETWORK: network}}


def to_yaml(doc: dict[str, Any], header: str) -> str:
    """Readable YAML: keys in the order written, one comment header."""
    import yaml

    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
