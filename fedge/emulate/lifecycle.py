"""An emulation's life: write its directory (``prepare``), start it, wait for it, take it down.

``prepare`` writes everything into the emulation directory and ``start`` runs it with the compose CLI
(``docker compose`` v2, else Debian's ``docker-compose``), so ``compose.yaml`` is what runs. Between
starting the devices and the coordinator, :func:`wait_online` reads the devices' retained statuses
from the broker through :mod:`fedge.mqtt` (its client and topic tree), as the coordinator would.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.common.atomicfile import write_atomic
from fedge.emulate.compose import (
    BROKER,
    COORDINATOR,
    HTTP_PORT,
    HTTP_TOKEN,
    NETWORK,
    CoordinatorArgs,
    Images,
    check_subnet,
    compose_dict,
    fleet_subnet,
    to_yaml,
)
from fedge.emulate.emulation import Emulation, project_name
from fedge.emulate.limits import DeviceLimits, DevicePlan, device_plans, limits_for, oom_message
from fedge.emulate.status import logs, service_state, status
from fedge.errors import EmulationError, TransportError
from fedge.mqtt.broker import free_port, port_is_free

if TYPE_CHECKING:
    from fedge.broker.config import BrokerOptions

log = logging.getLogger(__name__)


def _broker_options(sign: bool = False) -> BrokerOptions:
    """The broker config ``prepare`` writes: Mosquitto runs as root in its container (no account to drop
    to) and the devices reach it as "broker"; with ``sign``, the fleet's signing key too."""
    from fedge.broker.config import BrokerOptions

    return BrokerOptions(hostname=BROKER, run_as="root", sign=sign)


def prepare(fleet_path: str | Path, out: str | Path, *, arch: str = "amd64", images: Images,
            rates: dict[tuple[str, int], float] | None = None, loss_pct: float = 0.0,
            min_devices: int | None = None, deadline_slack: float = 3.0,
            device_args: tuple[str, ...] = (), subnet: str | None = None, sign: bool = False,
            shards: int | None = None) -> Emulation:
    """Write the emulation directory (broker config, flashed devices, compose.yaml); start nothing.

    A fleet config with ``[[shards]]``, or ``shards`` = N (``--shards N``: N even shards under the root), is
    emulated sharded (:mod:`fedge.emulate.shards`): a broker and a relay container per shard, each device on
    its shard's broker; a layout that does not fit is refused before anything is written.

    ``sign``: the fleet signs (``fedge broker config --sign``): every bundle carries ``fleet.pub``, so each device
    verifies the round descriptors and global state and accepts over-the-air updates (``fedge deploy``, with
    ``broker/coordinator/signing.key`` and the ``broker/deploy`` account) into its model store; the coordinator
    signs with the key, which ``prepare`` puts in its state directory.

    ``subnet`` is the fleet network's IPv4 subnet (default :func:`fleet_subnet`'s pick).

    ``rates`` maps (arch, batch) to the host's training MAC/s (:func:`fedge.emulate.calibrate.calibrate`
    measures what is missing).
    """
    from fedge.broker.config import write_broker_config
    from fedge.emulate.shards import emulated_layout, shard_records, sharded_fleet_text, write_shard_brokers
    from fedge.flash.flash import flash
    from fedge.fleet.config import device_ids, load_fleet
    from fedge.fleet.devices import load_fleet_data

    outp = Path(out).resolve()
    cfg = load_fleet(fleet_path)
    ids = [i for i, _ in device_ids(cfg)]
    layout = emulated_layout(cfg, ids, shards)
    fleet_text = sharded_fleet_text(Path(fleet_path).read_text(), layout, source=str(fleet_path)) if layout else ""
    subnet = check_subnet(subnet, len(ids), len(layout)) if subnet else fleet_subnet(project_name(outp))
    outp.mkdir(parents=True, exist_ok=True)
    data = load_fleet_data(cfg)
    samples = {dev: len(split.train) for dev, split in zip(ids, data.splits, strict=True)}
    plans = device_plans(cfg, samples)
    limits = _device_limits(plans, rates, loss_pct=loss_pct, embed_dim=cfg.run.embed_dim,
                            cache=outp / "calibration.json")
    shutil.rmtree(outp / "broker" / "data", ignore_errors=True)
    if layout:
        write_shard_brokers(fleet_text, outp, layout, _broker_options(sign))
    else:
        shutil.copyfile(fleet_path, outp / "fleet.toml")
        write_broker_config(cfg.run.fleet, ids, outp / "broker", _broker_options(sign),
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
    if sign:  # `fedge coordinator run` signs with STATE_DIR/signing.key when it exists
        shutil.copy2(outp / "broker" / "coordinator" / "signing.key", outp / "coordinator" / "signing.key")
    _write_http_token(outp / "http")
    http_port = free_port()
    coord = CoordinatorArgs(devices=len(ids), min_devices=len(ids) if min_devices is None else min_devices,
                            deadline_slack=deadline_slack, http_port=http_port)
    # No `platform:` key: an image made by `docker import` on a 20.10 engine is labelled with the host's
    # architecture whatever its binaries are, and binfmt_misc runs them regardless.
    doc = compose_dict(outp, images, limits, coord, device_args=device_args, subnet=subnet, shards=layout)
    sharded = f", {len(layout)} shards with a broker and a relay each" if layout else ""
    header = (f"fedge emulation of {fleet_path} ({len(ids)} devices{sharded}, {arch}), written by `fedge emulate up`.\n"
              "Each device's cpus, mem_limit and FEDGE_* link settings come from its profile (docs/emulate.md).\n"
              f"Run it by hand: docker-compose -p {project_name(outp)} -f compose.yaml up -d")
    (outp / "compose.yaml").write_text(to_yaml(doc, header))
    emu = Emulation(outp, project_name(outp), arch, cfg.run.fleet, images,
                    plans={p.device_id: _plan_dict(p) for p in plans},
                    limits={lim.device_id: lim.to_dict() for lim in limits},
                    messages={p.device_id: oom_message(p) for p in plans}, http_port=http_port,
                    shards=shard_records(layout))
    emu.save()
    return emu


def _device_limits(plans: list[DevicePlan], rates: dict[tuple[str, int], float] | None, *, loss_pct: float,
                   embed_dim: int, cache: Path) -> list[DeviceLimits]:
    """Each device's container limits from its plan and the host's measured training rate of its model and batch
    (calibrated now, into ``cache``, where ``rates`` lacks one); a device or fleet the host is too small for is
    logged (it runs, slower than its profile)."""
    from fedge.emulate.calibrate import calibrate

    rates = dict(rates or {})
    missing = {(p.arch, p.batch_size) for p in plans} - set(rates)
    if missing:
        rates.update(calibrate(missing, embed_dim=embed_dim, cache=cache))
    cores = len(os.sched_getaffinity(0))
    limits = [limits_for(p, rates[(p.arch, p.batch_size)], host_cores=cores, loss_pct=loss_pct) for p in plans]
    for lim in limits:
        if lim.cpus < lim.cpus_wanted:
            log.warning("%s: its profile trains as fast as %.2f host cores; this host has %d, so it runs slower",
                        lim.device_id, lim.cpus_wanted, cores)
    if sum(lim.cpus for lim in limits) > cores:
        log.warning("the devices' CPU quotas add up to %.2f cores, more than this host's %d: devices that train "
                    "at the same time run slower than their profiles", sum(lim.cpus for lim in limits), cores)
    return limits


def _write_http_token(http_dir: Path) -> None:
    """The dashboard's token: a fresh one (0600) the coordinator reads and the operator types into the browser."""
    http_dir.mkdir(exist_ok=True)
    # 0600 from its first byte, even over an older token a looser umask or a hand left readable
    write_atomic(http_dir / HTTP_TOKEN, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)


def _plan_dict(p: DevicePlan) -> dict[str, Any]:
    return {"profile": p.profile.name, "arch": p.arch, "batch_size": p.batch_size, "local_epochs": p.local_epochs,
            "samples": p.samples, "macs": p.macs, "params": p.params, "train_memory_mb": p.train_memory_mb,
            "round_time_s": p.round_time_s, "upload_precision": p.upload_precision,
            "ram_mb": p.profile.hardware.ram_mb, "train_budget_mb": p.profile.budgets.train_memory_mb}


def start(emu: Emulation, client: Any, *, online_timeout: float = 600.0) -> None:
    """Start the brokers (a sharded fleet's shard brokers and relays too) and the devices, wait until every device
    is online, then start the coordinator.

    The coordinator starts last so that it finds every device's retained hello at once and round 1
    runs with the whole fleet, as ``fedge simulate`` does. A sharded fleet's devices are online on the root
    broker once their relay has forwarded their statuses, so the wait covers the relays too.
    """
    emu.compose("up", "-d", "--no-build", BROKER, *emu.shard_services, *emu.devices)
    wait_online(emu, client, timeout=online_timeout)
    start_coordinator(emu)


def start_coordinator(emu: Emulation) -> None:
    """Start the coordinator's container, its dashboard on a host port that is free now.

    ``prepare`` picked the port when it wrote compose.yaml, and the devices may have taken minutes to come online
    since: another program on this host may have bound it meanwhile, and Docker would then refuse to start the
    coordinator ("address already in use"). Such a port is replaced by a free one (a window of milliseconds is
    left, between this check and Docker's bind)."""
    old = emu.http_port
    if old is not None and not port_is_free(old):
        new = free_port()
        compose = emu.out / "compose.yaml"
        mapping = f"127.0.0.1:{old}:{HTTP_PORT}"
        text = compose.read_text()
        if mapping not in text:
            raise EmulationError(f"{compose} does not publish the dashboard on {mapping}",
                                 hint="it was edited by hand: run `fedge emulate up` again to write it anew")
        write_atomic(compose, text.replace(mapping, f"127.0.0.1:{new}:{HTTP_PORT}").encode())
        emu.http_port = new
        emu.save()
        log.warning("the dashboard's port %d was taken since compose.yaml was written; it is on %d", old, new)
    emu.compose("up", "-d", "--no-build", COORDINATOR)


def broker_address(emu: Emulation, client: Any) -> str:
    """The broker container's address on the fleet network (the host reaches it there, port 1883)."""
    c = emu.container(client, BROKER)
    c.reload()
    nets = c.attrs["NetworkSettings"]["Networks"]
    net = nets.get(f"{emu.project}_{NETWORK}") or next(iter(nets.values()))
    return str(net["IPAddress"])


def wait_online(emu: Emulation, client: Any, *, timeout: float) -> None:
    """Wait until every device's retained status is "online" (read with the coordinator's account on the root
    broker: a sharded fleet's statuses come through the relays)."""
    from fedge.mqtt.client import MqttClient, Received
    from fedge.mqtt.connection import DEFAULT_PORT, BrokerSettings
    from fedge.mqtt.topics import STATUS_ONLINE, FleetTopics

    topics = FleetTopics(emu.fleet)
    online: set[str] = set()
    password = (emu.out / "broker" / "coordinator" / "password").read_text().strip()

    def on_message(m: Received) -> None:
        parsed = topics.parse_device(m.topic)
        if parsed is not None:
            (online.add if m.payload == STATUS_ONLINE else online.discard)(parsed.device_id)

    end = time.monotonic() + timeout
    host = broker_address(emu, client)
    # The broker container may still be starting: retry about every half second (paho's back-off,
    # capped at 1 s) until it accepts the connection or the timeout runs out.
    broker = BrokerSettings(host=host, port=DEFAULT_PORT, username=_broker_options().coordinator_user,
                            password=password, keepalive_s=30, reconnect_min_s=0.5, reconnect_max_s=1.0)
    mq = MqttClient(broker, f"fedge-emulate-{emu.project}", clean_session=True, on_message=on_message)
    mq.subscribe(topics.device_filter("status"))
    try:
        mq.start(wait_s=max(end - time.monotonic(), 0.0))
    except TransportError as exc:
        raise EmulationError(f"the broker at {host}:{DEFAULT_PORT} did not accept connections in {timeout:g} s "
                             f"({exc.message})", hint=f"fedge emulate logs broker --dir {emu.out}") from None
    try:
        next_check = time.monotonic() + 2.0
        while not set(emu.devices) <= online:
            if time.monotonic() > next_check:
                # A device that exited while booting never comes online: say so now, with its log's end.
                next_check = time.monotonic() + 2.0
                _check_shard_services(emu, client)
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
                relays = " (or their shard's relay-NAME, which forwards it)" if emu.shards else ""
                raise EmulationError(f"devices not online after {timeout:g} s: {', '.join(dead)}",
                                     hint=f"fedge emulate logs DEVICE --dir {emu.out}{relays}")
            time.sleep(0.5)
    finally:
        mq.stop()
    log.info("all %d devices online", len(emu.devices))


def _check_shard_services(emu: Emulation, client: Any) -> None:
    """A shard's broker or relay that exited while the fleet boots: an error naming it, with its log's end."""
    for svc in emu.shard_services:
        state = service_state(emu, client, svc)
        if state != "running":
            tail = logs(emu, client, svc, tail=5).strip() if state != "missing" else ""
            raise EmulationError(f"{svc} {state} before the devices came online"
                                 + (f"; its log ends:\n{tail}" if tail else ""),
                                 hint=f"fedge emulate logs {svc} --dir {emu.out}")


def wait_exited(emu: Emulation, client: Any, service: str, timeout: float) -> int:
    """Wait until ``service``'s container exits; its exit code (EmulationError on timeout)."""
    c = emu.container(client, service)
    try:
        res = c.wait(timeout=timeout)
    except Exception as exc:  # requests' ReadTimeout/ConnectionError: the engine's wait did not return in time
        raise EmulationError(f"{service} did not finish in {timeout:g} s",
                             hint="fedge emulate status / logs show where it is") from exc
    return int(res.get("StatusCode", -1))


def down(emu: Emulation) -> None:
    """Stop and remove the containers and the network; the directory (results, state) stays."""
    emu.compose("down", "--remove-orphans", "--timeout", "5")
