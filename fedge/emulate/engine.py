"""Run an emulated fleet on a Docker engine: up, status, logs, down and faults.

``up`` writes everything into the emulation directory and starts it with the compose CLI
(``docker compose`` v2, else Debian's ``docker-compose``), so ``compose.yaml`` is what runs; the
other operations find the containers by their compose labels through the Docker SDK for Python
(``docker`` package, the ``[emulate]`` extra) and use the engine's own kill, pause, network
disconnect and restart. Nothing parses ``docker ps`` text.

Layout of the emulation directory::

    compose.yaml          broker, coordinator, one service per device, with their limits
    emulation.json        project name, images, per-device plan and limits, calibration
    fleet.toml            the fleet config the coordinator runs
    broker/               `fedge broker config --hostname broker` (accounts, ACL, bundles)
    devices/ID/           the flashed payload each device boots from (mounted at /boot/firmware)
    coordinator/          the coordinator's state (reports.jsonl, globals, state.json)
    calibration.json      this host's training rates (reused)
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.units import format_bytes
from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.emulate.compose import (
    BROKER,
    COORDINATOR,
    NETWORK,
    CoordinatorArgs,
    Images,
    check_subnet,
    compose_dict,
    fleet_subnet,
    to_yaml,
)
from fedge.emulate.limits import DeviceLimits, DevicePlan, device_plans, limits_for, oom_message
from fedge.errors import ConfigError, EmulationError

log = logging.getLogger(__name__)

STATE = "emulation.json"
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

    def save(self) -> None:
        doc = {"project": self.project, "arch": self.arch, "fleet": self.fleet, "images": self.images.__dict__,
               "plans": self.plans, "limits": self.limits, "oom_messages": self.messages}
        (self.out / STATE).write_text(json.dumps(doc, indent=1) + "\n")

    @classmethod
    def load(cls, out: str | Path) -> Emulation:
        p = Path(out).resolve()
        f = p / STATE
        if not f.is_file():
            raise EmulationError(f"{p} holds no emulation ({STATE} is missing)",
                                 hint="pass the --dir that `fedge emulate up --out` wrote")
        d = json.loads(f.read_text())
        return cls(p, d["project"], d["arch"], d["fleet"], Images(**d["images"]), d["plans"], d["limits"],
                   d.get("oom_messages", {}))

    @property
    def devices(self) -> list[str]:
        return list(self.limits)

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
        found = client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={self.project}"})
        return {c.labels.get(SERVICE_LABEL, c.name): c for c in found}

    def container(self, client: Any, service: str) -> Any:
        known = [BROKER, COORDINATOR, *self.devices]
        if service not in known:
            raise ConfigError(f"no device or service {service!r} in this emulation",
                              hint=f"use one of {', '.join(known)}")
        c = self.containers(client).get(service)
        if c is None:
            raise EmulationError(f"{service} has no container (the emulation is down)",
                                 hint=f"fedge emulate up ... --out {self.out}")
        return c


# -- up -----------------------------------------------------------------------------------------------
def prepare(fleet_path: str | Path, out: str | Path, *, arch: str = "amd64", images: Images,
            rates: dict[tuple[str, int], float] | None = None, loss_pct: float = 0.0,
            min_devices: int | None = None, deadline_slack: float = 3.0,
            device_args: tuple[str, ...] = (), subnet: str | None = None) -> Emulation:
    """Write the emulation directory (broker config, flashed devices, compose.yaml); start nothing.

    ``subnet`` is the fleet network's IPv4 subnet (default :func:`fleet_subnet`'s pick).

    ``rates`` maps (arch, batch) to the host's training MAC/s (:func:`fedge.emulate.calibrate.calibrate`
    measures what is missing).
    """
    from fedge.broker.config import BrokerOptions, write_broker_config
    from fedge.emulate.calibrate import calibrate
    from fedge.flash.flash import flash
    from fedge.fleet.config import device_ids, load_fleet
    from fedge.fleet.devices import load_fleet_data

    outp = Path(out).resolve()
    cfg = load_fleet(fleet_path)
    ids = [i for i, _ in device_ids(cfg)]
    subnet = check_subnet(subnet, len(ids)) if subnet else fleet_subnet(project_name(outp))
    outp.mkdir(parents=True, exist_ok=True)
    data = load_fleet_data(cfg)
    samples = {dev: len(split.train) for dev, split in zip(ids, data.splits, strict=True)}
    plans = device_plans(cfg, samples)
    wanted = {(p.arch, p.batch_size) for p in plans}
    rates = dict(rates or {})
    missing = wanted - set(rates)
    if missing:
        rates.update(calibrate(missing, embed_dim=cfg.run.embed_dim, cache=outp / "calibration.json"))
    cores = len(os.sched_getaffinity(0))
    limits = [limits_for(p, rates[(p.arch, p.batch_size)], host_cores=cores, loss_pct=loss_pct) for p in plans]
    for lim in limits:
        if lim.cpus < lim.cpus_wanted:
            log.warning("%s: its profile trains as fast as %.2f host cores; this host has %d, so it runs slower",
                        lim.device_id, lim.cpus_wanted, cores)
    if sum(lim.cpus for lim in limits) > cores:
        log.warning("the devices' CPU quotas add up to %.2f cores, more than this host's %d: devices that train "
                    "at the same time run slower than their profiles", sum(lim.cpus for lim in limits), cores)
    shutil.copyfile(fleet_path, outp / "fleet.toml")
    shutil.rmtree(outp / "broker" / "data", ignore_errors=True)
    # Mosquitto runs as root in its container (no account to drop to) and the devices reach it as "broker".
    write_broker_config(cfg.run.fleet, ids, outp / "broker", BrokerOptions(hostname=BROKER, run_as="root"),
                        fleet_config=outp / "fleet.toml")
    for p in plans:
        # The payload `fedge flash DEVICE --to DIR` writes (no first-boot hook: the container's entry point,
        # docker/device-boot.sh, runs its install.sh), so the emulation boots what a real card would carry.
        boot = outp / "devices" / p.device_id
        boot.mkdir(parents=True, exist_ok=True)
        # An over-memory plan is flashed all the same: the twin runs it to show the kernel's OOM kill.
        flash(p.device_id, outp / "fleet.toml", outp / "broker", boot, init="none", force=True, check_memory=False)
    # A new run: the previous run's coordinator state and retained broker messages would resume it.
    shutil.rmtree(outp / "coordinator", ignore_errors=True)
    (outp / "coordinator").mkdir()
    coord = CoordinatorArgs(devices=len(ids), min_devices=len(ids) if min_devices is None else min_devices,
                            deadline_slack=deadline_slack)
    # No `platform:` key: an image made by `docker import` on a 20.10 engine is labelled with the host's
    # architecture whatever its binaries are, and binfmt_misc runs them regardless.
    doc = compose_dict(outp, images, limits, coord, device_args=device_args, subnet=subnet)
    header = (f"fedge emulation of {fleet_path} ({len(ids)} devices, {arch}), written by `fedge emulate up`.\n"
              "Each device's cpus, mem_limit and FEDGE_* link settings come from its profile (docs/emulate.md).\n"
              f"Run it by hand: docker-compose -p {project_name(outp)} -f compose.yaml up -d")
    (outp / "compose.yaml").write_text(to_yaml(doc, header))
    emu = Emulation(outp, project_name(outp), arch, cfg.run.fleet, images,
                    plans={p.device_id: _plan_dict(p) for p in plans},
                    limits={lim.device_id: lim.to_dict() for lim in limits},
                    messages={p.device_id: oom_message(p) for p in plans})
    emu.save()
    return emu


def _plan_dict(p: DevicePlan) -> dict[str, Any]:
    return {"profile": p.profile.name, "arch": p.arch, "batch_size": p.batch_size, "local_epochs": p.local_epochs,
            "samples": p.samples, "macs": p.macs, "params": p.params, "train_memory_mb": p.train_memory_mb,
            "round_time_s": p.round_time_s, "upload_precision": p.upload_precision,
            "ram_mb": p.profile.hardware.ram_mb, "train_budget_mb": p.profile.budgets.train_memory_mb}


def start(emu: Emulation, client: Any, *, online_timeout: float = 600.0) -> None:
    """Start broker and devices, wait until every device is online, then start the coordinator.

    The coordinator starts last so that it finds every device's retained hello at once and round 1
    runs with the whole fleet, as ``fedge simulate`` does.
    """
    emu.compose("up", "-d", "--no-build", BROKER, *emu.devices)
    wait_online(emu, client, timeout=online_timeout)
    emu.compose("up", "-d", "--no-build", COORDINATOR)


def _broker_address(emu: Emulation, client: Any) -> str:
    c = emu.container(client, BROKER)
    c.reload()
    nets = c.attrs["NetworkSettings"]["Networks"]
    net = nets.get(f"{emu.project}_{NETWORK}") or next(iter(nets.values()))
    return str(net["IPAddress"])


def wait_online(emu: Emulation, client: Any, *, timeout: float) -> None:
    """Wait until every device's retained status is "online" (read with the coordinator's account)."""
    from fedge.mqtt.client import new_paho_client
    from fedge.mqtt.topics import FleetTopics

    topics = FleetTopics(emu.fleet)
    online: set[str] = set()
    cli = new_paho_client(f"fedge-emulate-{emu.project}", clean_session=True)
    cli.username_pw_set("fedge-coordinator", (emu.out / "broker" / "coordinator" / "password").read_text().strip())

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        parsed = topics.parse_device(msg.topic)
        if parsed is not None:
            (online.add if msg.payload == b"online" else online.discard)(parsed.device_id)

    cli.on_message = on_message
    cli.on_connect = lambda c, *_a: c.subscribe(topics.device_filter("status"), qos=1)
    end = time.monotonic() + timeout
    host = _broker_address(emu, client)
    while True:
        try:
            cli.connect(host, 1883, keepalive=30)
            break
        except OSError:
            if time.monotonic() > end:
                raise EmulationError(f"the broker at {host}:1883 did not accept connections in {timeout:g} s",
                                     hint=f"fedge emulate logs broker --dir {emu.out}") from None
            time.sleep(0.5)
    cli.loop_start()
    try:
        next_check = time.monotonic() + 2.0
        while not set(emu.devices) <= online:
            if time.monotonic() > next_check:
                # A device that exited while booting never comes online: say so now, with its log's end.
                next_check = time.monotonic() + 2.0
                gone = [s for s in status(emu, client, sample=False)
                        if s.device_id not in online and s.state not in ("running", "paused")]
                if gone:
                    tail = logs(emu, client, gone[0].device_id, tail=5).strip()
                    raise EmulationError(
                        f"{gone[0].device_id} {gone[0].state} before coming online"
                        + (f" ({gone[0].message})" if gone[0].message else "") + f"; its log ends:\n{tail}",
                        hint=f"fedge emulate logs {gone[0].device_id} --dir {emu.out}")
            if time.monotonic() > end:
                dead = [s.device_id + " " + s.state for s in status(emu, client, sample=False)
                        if s.device_id not in online]
                raise EmulationError(f"devices not online after {timeout:g} s: {', '.join(dead)}",
                                     hint=f"fedge emulate logs DEVICE --dir {emu.out}")
            time.sleep(0.5)
    finally:
        cli.loop_stop()
        cli.disconnect()
    log.info("all %d devices online", len(emu.devices))


def down(emu: Emulation) -> None:
    """Stop and remove the containers and the network; the directory (results, state) stays."""
    emu.compose("down", "--remove-orphans", "--timeout", "5")


# -- status -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceStatus:
    """One line of ``fedge emulate status``."""

    device_id: str
    profile: str
    state: str
    """running, paused, exited (code N), OOM-killed, missing."""
    round: int | None
    """The last round whose update the coordinator accepted from the device."""
    cpu_pct: float | None
    """Of one host core, while running."""
    mem_mb: float | None
    mem_peak_mb: float | None
    mem_limit_mb: int
    tx_bytes: int | None
    """Bytes the container sent on the fleet network (while it exists)."""
    sent_bytes: int
    """Update bytes the coordinator accepted from the device."""
    message: str = ""


def _stats(container: Any) -> tuple[float | None, float | None, float | None, int | None]:
    """CPU % of one core, memory and peak memory (MiB), bytes sent; from one stats sample."""
    try:
        s = container.stats(stream=False)
    except Exception:  # the container stopped between listing and sampling
        return None, None, None, None
    cpu = s.get("cpu_stats", {})
    pre = s.get("precpu_stats", {})
    d_cpu = cpu.get("cpu_usage", {}).get("total_usage", 0) - pre.get("cpu_usage", {}).get("total_usage", 0)
    d_sys = cpu.get("system_cpu_usage", 0) - pre.get("system_cpu_usage", 0)
    ncpu = cpu.get("online_cpus") or 1
    pct = 100.0 * d_cpu / d_sys * ncpu if d_sys > 0 else None
    mem = s.get("memory_stats", {})
    usage = mem.get("usage")
    # cgroup v1 reports the page cache inside usage: subtract it, as `docker stats` does.
    cache = mem.get("stats", {}).get("total_inactive_file", mem.get("stats", {}).get("inactive_file", 0))
    used = (usage - cache) / 2**20 if usage is not None else None
    peak = mem.get("max_usage")
    tx = sum(n.get("tx_bytes", 0) for n in (s.get("networks") or {}).values()) if s.get("networks") else None
    return pct, used, peak / 2**20 if peak else None, tx


def status(emu: Emulation, client: Any, *, sample: bool = True) -> list[DeviceStatus]:
    """Per device: state in words, last round, CPU, memory, bytes sent."""
    containers = emu.containers(client)
    # live: the coordinator may be appending a report right now
    reports = read_reports(emu.out / "coordinator" / REPORTS_FILE, live=True)
    out = []
    for dev in emu.devices:
        lim = emu.limits[dev]
        last = max((r.round for r in reports if dev in r.accepted), default=None)
        sent = sum(int(r.bytes_up.get(dev, 0)) for r in reports)
        c = containers.get(dev)
        if c is None:
            out.append(DeviceStatus(dev, lim["profile"], "missing", last, None, None, None,
                                    lim["mem_limit_mb"], None, sent, "no container (down?)"))
            continue
        c.reload()
        st = c.attrs["State"]
        message = ""
        if st.get("OOMKilled"):
            state, message = "OOM-killed", emu.messages.get(dev, f"{dev} ran out of memory")
        elif st.get("Paused"):
            state = "paused"
        elif st.get("Running"):
            state = "running"
        else:
            code = st.get("ExitCode")
            state = f"exited ({code})"
            if code == 137:
                message = f"{dev} was killed (SIGKILL)"
        cpu = mem = peak = tx = None
        if sample and state in ("running", "paused"):
            cpu, mem, peak, tx = _stats(c)
        out.append(DeviceStatus(dev, lim["profile"], state, last, cpu, mem, peak, lim["mem_limit_mb"], tx, sent,
                                message))
    return out


def service_state(emu: Emulation, client: Any, service: str) -> str:
    c = emu.containers(client).get(service)
    if c is None:
        return "missing"
    c.reload()
    st = c.attrs["State"]
    return "running" if st.get("Running") else f"exited ({st.get('ExitCode')})"


def logs(emu: Emulation, client: Any, service: str, *, tail: int | None = None) -> str:
    c = emu.container(client, service)
    raw = c.logs(tail=tail if tail is not None else "all")
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


# -- faults -------------------------------------------------------------------------------------------
def fault(emu: Emulation, client: Any, action: str, target: str, *, duration: float | None = None) -> str:
    """Inject a fault with the engine's own operations; with ``duration``, undo it after that many seconds.

    kill: SIGKILL the container (with ``duration``: start it again, a device that reboots);
    pause: freeze its processes (cgroup freezer); partition: disconnect it from the fleet network;
    resume: undo pause/partition now; restart: restart the broker or the coordinator.
    """
    if action == "restart":
        if target not in (BROKER, COORDINATOR):
            raise ConfigError(f"fault restart takes broker or coordinator, not {target!r}",
                              hint="to reboot a device: fedge emulate fault kill DEVICE --for S")
        emu.container(client, target).restart(timeout=5)
        return f"restarted {target}"
    if target not in emu.devices:
        raise ConfigError(f"{target!r} is not a device of this emulation", hint=f"devices: {', '.join(emu.devices)}")
    c = emu.container(client, target)
    net = client.networks.get(f"{emu.project}_{NETWORK}")
    if action == "kill":
        c.kill()
        done = f"killed {target}"
        undo = c.start
    elif action == "pause":
        _pause(client, c)
        done = f"paused {target}"
        undo = c.unpause
    elif action == "partition":
        c.reload()
        address = c.attrs["NetworkSettings"]["Networks"].get(net.name, {}).get("IPAddress") or None
        net.disconnect(c)
        _partitions(emu, target, address)  # for `fault resume` in another process
        done = f"cut {target} off the fleet network"

        def undo() -> None:
            _reconnect(net, c, target, _partitions(emu, target))
    elif action == "resume":
        c.reload()
        if c.attrs["State"].get("Paused"):
            c.unpause()
        if net.name not in c.attrs["NetworkSettings"]["Networks"]:
            _reconnect(net, c, target, _partitions(emu, target))
        return f"resumed {target}"
    else:
        raise ConfigError(f"unknown fault {action!r}", hint="kill, pause, partition, resume or restart")
    if duration is not None:
        time.sleep(duration)
        undo()
        done += f" for {duration:g} s, then undid it"
    return done


PARTITIONS = "partitions.json"


def _partitions(emu: Emulation, device: str, address: str | None = None) -> str | None:
    """Remember the fleet address of a device being partitioned (``address`` given), or forget and
    return it (to reconnect it with that address)."""
    path = emu.out / PARTITIONS
    known = json.loads(path.read_text()) if path.is_file() else {}
    old = known.pop(device, None)
    if address is not None:
        known[device] = address
    path.write_text(json.dumps(known) + "\n")
    return address if address is not None else old


def set_cpus(client: Any, container: Any, cpus: float) -> None:
    """Change a running container's CPU quota (``--cpus``). docker-py's ``Container.update`` has no
    NanoCpus, and the engine refuses a CpuQuota on a container created with NanoCpus: the API takes it."""
    client.api._post_json(client.api._url("/containers/{0}/update", container.id),
                          data={"NanoCpus": round(cpus * 1e9)})


def _pause(client: Any, c: Any) -> None:
    """Freeze a device's processes; with its CPU quota lifted for the moment of freezing if need be.

    runc's cgroup-v1 freezer gives the tasks a few milliseconds to reach the frozen state and else fails
    ("unable to freeze"); a device throttled to a few percent of a core sleeps ~94 ms of every 100 ms CFS
    period, so a busy one often cannot freeze in time. The quota is restored as soon as it is frozen
    (a frozen container uses no CPU).
    """
    try:
        c.pause()
        return
    except docker_sdk().errors.APIError as exc:
        if "freeze" not in str(exc):
            raise
        log.info("%s did not freeze under its CPU quota (%s); pausing it with the quota lifted", c.name, exc)
    c.reload()
    nano = c.attrs["HostConfig"].get("NanoCpus") or 0
    set_cpus(client, c, len(os.sched_getaffinity(0)))
    try:
        c.pause()
    finally:
        if nano:
            set_cpus(client, c, nano / 1e9)


SHAPE_LINK = "/usr/local/bin/fedge-shape-link"
"""In the device image (docker/shape-link.sh): shapes the fleet interface and the ingress ifb from the FEDGE_* env."""


def _reconnect(net: Any, c: Any, device: str, address: str | None = None) -> None:
    """Connect a partitioned device again, with its old ``address`` if given, and shape its link again.

    The engine gives the container a new interface (a new veth pair, eth1 after eth0) without the qdiscs
    and the ingress redirect the boot script put on the old one: unshaped, the device would upload at the
    host's speed. Without ``address`` the engine may hand it another one (one a killed or restarted
    container freed): its MQTT connection then hangs until the keep-alive runs out.
    """
    try:
        net.connect(c, aliases=[device], ipv4_address=address)
    except docker_sdk().errors.APIError as exc:
        if not address:
            raise
        # An emulation written before the fleet network had a configured subnet: any address will do.
        log.warning("%s: reconnecting with another address than %s (%s): its MQTT connection hangs until the "
                    "keep-alive runs out", device, address, exc)
        net.connect(c, aliases=[device])
    code, out = c.exec_run(["/bin/sh", SHAPE_LINK], user="root")
    if code != 0:
        log.warning("%s is reconnected but its link is not shaped again (%s exited %s): %s", device, SHAPE_LINK,
                    code, out.decode("utf-8", "replace").strip() if isinstance(out, bytes) else out)


def wait_exited(emu: Emulation, client: Any, service: str, timeout: float) -> int:
    """Wait until ``service``'s container exits; its exit code (EmulationError on timeout)."""
    c = emu.container(client, service)
    try:
        res = c.wait(timeout=timeout)
    except Exception as exc:  # requests' ReadTimeout/ConnectionError: the engine's wait did not return in time
        raise EmulationError(f"{service} did not finish in {timeout:g} s",
                             hint="fedge emulate status / logs show where it is") from exc
    return int(res.get("StatusCode", -1))


def format_status(rows: list[DeviceStatus], emu: Emulation, client: Any) -> str:
    """The table ``fedge emulate status`` prints, then one line per device that needs words."""
    lines = [f"broker: {service_state(emu, client, BROKER)}   coordinator: {service_state(emu, client, COORDINATOR)}"]
    # sent: update bytes the coordinator accepted from the device (kept after it exits); net tx: what its
    # container sent on the fleet network, MQTT overhead included (only while the container runs).
    head = (f"{'device':<18} {'profile':<13} {'state':<12} {'round':>5} {'cpu':>6} {'mem MiB':>13} {'sent':>10} "
            f"{'net tx':>10}")
    lines += [head, "-" * len(head)]
    for r in rows:
        mem = f"{r.mem_mb:.0f}/{r.mem_limit_mb}" if r.mem_mb is not None else f"-/{r.mem_limit_mb}"
        cpu = f"{r.cpu_pct:.0f}%" if r.cpu_pct is not None else "-"
        tx = format_bytes(r.tx_bytes, binary=False) if r.tx_bytes is not None else "-"
        lines.append(f"{r.device_id:<18} {r.profile:<13} {r.state:<12} {r.round if r.round is not None else '-':>5} "
                     f"{cpu:>6} {mem:>13} {format_bytes(r.sent_bytes, binary=False):>10} {tx:>10}")
    lines += [r.message for r in rows if r.message]
    return "\n".join(lines)



def limits_of(emu: Emulation) -> list[DeviceLimits]:
    return [DeviceLimits(**d) for d in emu.limits.values()]
