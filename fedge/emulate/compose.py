"""The compose file of an emulated fleet: broker, coordinator and one service per device; for a sharded fleet,
one broker and one relay per shard too (``broker-NAME``, ``relay-NAME``).

Plain Compose-spec (no ``version:`` key, no top-level ``name:``), which both Debian's
docker-compose 1.29 and ``docker compose`` v2 accept; paths are relative to the file's directory
except the broker's config, which Mosquitto reads by the absolute path ``fedge broker config``
wrote into it, so it is mounted at that same path.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.emulate.limits import DeviceLimits
from fedge.errors import ConfigError

if TYPE_CHECKING:
    from fedge.fleet.shards import Shard

BROKER = "broker"
COORDINATOR = "coordinator"
MQTT_PORT = 1883  # every broker's listener, each in its own container
FEDGE_BIN = "/opt/fedge/venv/bin/fedge"  # in the coordinator image (docker/device.Dockerfile's venv)
RELAY_CPUS = 0.25
"""A relay container's CPU quota (host cores): it decodes, checks and sums its shard's updates once a round."""
RELAY_MEM_MB = 384
"""A relay container's memory limit, MiB (no swap): Python with numpy and the coordinator's aggregator."""
SHARD_LABEL = "io.fedge.shard"
HTTP_PORT = 8321  # the coordinator's dashboard inside its container
HTTP_TOKEN = "token"  # its file in DIR/http/
NETWORK = "fleet"
ROLE_LABEL = "io.fedge.role"
PROFILE_LABEL = "io.fedge.profile"
HEALTH_OVERRIDE_PATH = "/run/fedge-health-override.json"
"""Inside a device container: the health override its agent reads (``$FEDGE_HEALTH_OVERRIDE``), written by
``fedge emulate fault throttle`` (:mod:`fedge.emulate.throttle`); absent, the device reports its real readings."""


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


def shard_broker(shard: str) -> str:
    """The compose service (and host name) of shard ``shard``'s broker; its relay's is the relay's account."""
    return f"{BROKER}-{shard}"


def check_subnet(subnet: str, devices: int, shards: int = 0) -> str:
    """``subnet`` (``fedge emulate up --subnet``) in canonical form, if it is a private IPv4 network with
    room for the broker, the coordinator, ``devices`` devices, a broker and a relay per shard and the engine's
    gateway; else ConfigError."""
    try:
        net = ipaddress.ip_network(subnet, strict=False)
    except ValueError as exc:
        raise ConfigError(f"--subnet {subnet!r} is not a network ({exc})", hint="e.g. --subnet 10.201.7.0/24") from exc
    if net.version != 4 or not net.is_private:
        raise ConfigError(f"--subnet {subnet} is not a private IPv4 network",
                          hint="pick one in 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16 that no other network uses")
    hosts = net.num_addresses - 2  # network and broadcast addresses
    need = devices + 3 + 2 * shards
    if hosts < need:
        what = f"{devices} devices, broker, coordinator, " + (f"{shards} shard brokers and relays, " if shards else "")
        raise ConfigError(f"--subnet {subnet} has {hosts} host addresses; the emulation needs {need} "
                          f"({what}gateway)", hint="use a larger prefix, e.g. /24")
    return str(net)


def compose_dict(out: Path, images: Images, limits: list[DeviceLimits], coord: CoordinatorArgs,
                 *, platform: str | None = None, device_args: tuple[str, ...] = (),
                 subnet: str | None = None, shards: Sequence[Shard] = ()) -> dict[str, Any]:
    """The compose document (a dict ready for YAML). ``out`` is the emulation directory (absolute).

    ``device_args`` are appended to every device's ``fedge edge run`` (e.g. ``--keep-running``);
    ``subnet`` is the fleet network's (:func:`fleet_subnet`; default: the engine picks one). ``shards``: the
    emulated layout (:func:`fedge.emulate.shards.emulated_layout`, brokers at their service names): a broker and
    a relay per shard, and each device then depends on its shard's broker (its bundle names it).
    """
    services: dict[str, Any] = {
        BROKER: _broker(images, out, "broker", {ROLE_LABEL: "broker"}),
        COORDINATOR: {
            "image": images.coordinator,
            "command": [
                "--config", "/fedge/fleet.toml", "--state-dir", "/fedge/state",
                "--broker", f"mqtt://{BROKER}:{MQTT_PORT}", "--username", "fedge-coordinator",
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
        # published port, so it needs the token (fedge.observe.web refuses otherwise); the host side is
        # published on loopback only.
        services[COORDINATOR]["command"] += ["--http", f"0.0.0.0:{HTTP_PORT}", "--http-token-file",
                                             f"/fedge/http/{HTTP_TOKEN}"]
        services[COORDINATOR]["volumes"].append("./http:/fedge/http:ro")
        services[COORDINATOR]["ports"] = [f"127.0.0.1:{coord.http_port}:{HTTP_PORT}"]
    home: dict[str, str] = {}  # device -> the broker service its bundle names (absent: the root's)
    for s in shards:
        services[shard_broker(s.name)] = _broker(images, out, f"broker/shards/{s.dirname}",
                                                 {ROLE_LABEL: "shard-broker", SHARD_LABEL: s.name})
        services[s.relay] = _relay(images, s)
        home.update(dict.fromkeys(s.devices, shard_broker(s.name)))
    for lim in limits:
        svc: dict[str, Any] = {
            "image": images.device,
            "hostname": lim.device_id,
            "volumes": [f"./devices/{lim.device_id}:/boot/firmware:ro"],
            # tc inside the container shapes its own link (docker/shape-link.sh).
            "cap_add": ["NET_ADMIN"],
            # the quota as CPU time per period: a small one gets a longer period (fedge.emulate.limits.cpu_period_us)
            "cpu_period": lim.cpu_period_us,
            "cpu_quota": lim.cpu_quota_us,
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
                "FEDGE_HEALTH_OVERRIDE": HEALTH_OVERRIDE_PATH,  # fault throttle writes it (fedge.emulate.throttle)
            },
            "depends_on": [home.get(lim.device_id, BROKER)],
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


def _broker(images: Images, out: Path, rel: str, labels: dict[str, str]) -> dict[str, Any]:
    """A Mosquitto service of the broker directory ``out/rel`` (``fedge broker config`` wrote it; mounted at its
    absolute path, which its mosquitto.conf names)."""
    path = str(out / rel)
    return {"image": images.broker, "command": ["-c", f"{path}/mosquitto.conf"], "volumes": [f"./{rel}:{path}"],
            "networks": [NETWORK], "labels": labels}


def _relay(images: Images, shard: Shard) -> dict[str, Any]:
    """``fedge relay`` of ``shard`` (brokers at their service names) in the coordinator's image: its shard's broker
    below, its parent's (the root's or its parent shard's) above, its account's password from ``broker/relays``,
    its state (``relay-state.json``, ``rounds.jsonl``) in ``relays/relay-NAME``. ``--detail``: one report entry per
    device in its partials (~100 B each), so the root's reports and ``fedge emulate status`` have each device's
    bytes and metrics as in a flat emulation."""
    parent = BROKER if shard.parent is None else shard_broker(shard.parent)
    own = shard_broker(shard.name)
    return {
        "image": images.coordinator,
        "entrypoint": [FEDGE_BIN, "relay"],
        "command": ["--config", "/fedge/fleet.toml", "--name", shard.relay, "--username", shard.relay,
                    "--password-file", "/fedge/relay/password", "--broker", f"mqtt://{parent}:{MQTT_PORT}",
                    "--shard", f"mqtt://{own}:{MQTT_PORT}", "--state-dir", "/fedge/state", "--detail"],
        "volumes": ["./fleet.toml:/fedge/fleet.toml:ro", f"./broker/relays/{shard.relay}:/fedge/relay:ro",
                    f"./relays/{shard.relay}:/fedge/state"],
        "environment": {"PYTHONUNBUFFERED": "1"},
        "cpus": RELAY_CPUS,
        "mem_limit": f"{RELAY_MEM_MB}m",
        "memswap_limit": f"{RELAY_MEM_MB}m",
        "depends_on": [own, parent],
        "networks": [NETWORK],
        "labels": {ROLE_LABEL: "relay", SHARD_LABEL: shard.name},
    }


def to_yaml(doc: dict[str, Any], header: str) -> str:
    """Readable YAML: keys in the order written, one comment header."""
    import yaml

    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
