"""Faults injected into a running emulation with the engine's own operations.

``kill`` (SIGKILL; undone by starting the container again: a device that reboots), ``pause`` (the
cgroup freezer), ``partition`` (disconnect from the fleet network), ``throttle`` (a lower CPU quota and the Pi
firmware's throttling flags in its heartbeat: :mod:`fedge.emulate.throttle`), ``resume`` (undo pause, partition
and throttle now) of a device — or, in a sharded fleet, of a shard's broker or relay (``broker-NAME``,
``relay-NAME``) — and ``restart`` of the broker, the coordinator, a shard's broker or a relay.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from fedge.common.atomicfile import write_atomic
from fedge.emulate import FAULTS
from fedge.emulate.compose import BROKER, COORDINATOR, NETWORK
from fedge.emulate.discovery import docker_sdk
from fedge.emulate.emulation import Emulation
from fedge.emulate.throttle import cool, throttle, throttled_devices
from fedge.errors import ConfigError, EmulationError

log = logging.getLogger(__name__)

PARTITIONS = "partitions.json"
"""In the emulation directory: the fleet address of each partitioned device (to reconnect it with)."""

SHAPE_LINK = "/usr/local/bin/fedge-shape-link"
"""In the device image (docker/shape-link.sh): shapes the fleet interface and the ingress ifb from the FEDGE_* env."""


def fault(emu: Emulation, client: Any, action: str, target: str, *, duration: float | None = None) -> str:
    """Inject a fault with the engine's own operations; with ``duration``, undo it after that many seconds.

    kill: SIGKILL the container (with ``duration``: start it again, a device that reboots);
    pause: freeze its processes (cgroup freezer); partition: disconnect it from the fleet network;
    throttle (devices only): lower its CPU quota and make it report itself hot and throttling;
    resume: undo pause/partition/throttle now, or start a killed device again; restart: restart the broker or
    the coordinator. A sharded fleet's shard brokers and relays take every one of them. A fault that makes
    no sense in the container's state (killing an exited device, pausing a paused one) is an
    :class:`EmulationError` in words, and so is whatever else the engine refuses: an operator command never
    answers with a traceback.
    """
    try:
        return _fault(emu, client, action, target, duration)
    except docker_sdk().errors.APIError as exc:
        # The state checks below come first; this is for a race with the container (it exited meanwhile)
        # or an engine that refuses for its own reasons: its explanation, not its traceback.
        words = getattr(exc, "explanation", None) or str(exc)
        raise EmulationError(f"the Docker engine refused to {action} {target}: {words}",
                             hint=f"see its state: fedge emulate status --dir {emu.out}") from exc


def container_state(c: Any) -> tuple[str, str]:
    """(the engine's status word — running, paused, exited, created, restarting, dead —, the state in words)."""
    c.reload()
    st = c.attrs["State"]
    status = str(st.get("Status") or ("running" if st.get("Running") else "exited"))
    if status == "exited":
        code = st.get("ExitCode")
        how = ("killed: out of memory" if st.get("OOMKilled") else "killed with SIGKILL" if code == 137
               else "stopped" if code in (0, 143) else f"exit code {code}")
        return status, f"it exited ({how}) at {str(st.get('FinishedAt', '?'))[:19].replace('T', ' ')} UTC"
    return status, {"paused": "it is paused", "created": "it was never started",
                    "restarting": "it is restarting", "dead": "the engine failed to remove it"}.get(status, status)


def _fault(emu: Emulation, client: Any, action: str, target: str, duration: float | None) -> str:
    shard = emu.shard_services  # a sharded fleet's shard brokers and relays (none: a flat fleet)
    listed = f"; shard brokers and relays: {', '.join(shard)}" if shard else ""
    if action == "restart":
        if target not in (BROKER, COORDINATOR, *shard):
            takes = "broker, coordinator, a shard broker or a relay" if shard else "broker or coordinator"
            raise ConfigError(f"fault restart takes {takes}, not {target!r}",
                              hint=f"to reboot a device: fedge emulate fault kill DEVICE --for S{listed}")
        emu.container(client, target).restart(timeout=5)
        return f"restarted {target}"
    if action not in FAULTS:
        raise ConfigError(f"unknown fault {action!r}", hint=f"one of {', '.join(FAULTS)}")
    if action == "throttle" and target not in emu.devices:
        raise ConfigError(f"fault throttle takes a device, not {target!r}", hint=f"devices: {', '.join(emu.devices)}")
    if target not in (*emu.devices, *shard):
        raise ConfigError(f"{target!r} is not a device{', shard broker or relay' if shard else ''} of this emulation",
                          hint=f"devices: {', '.join(emu.devices)}{listed}")
    c = emu.container(client, target)
    status, words = container_state(c)
    again = f"fedge emulate fault resume {target} --dir {emu.out}"
    if action == "resume":
        return _resume(emu, client, c, target, status)
    if status not in ("running", "paused"):
        raise EmulationError(f"{target} is not running, so there is nothing to {action}: {words}",
                             hint=f"start it again with `{again}`" if status == "exited" else None)
    if action == "pause" and status == "paused":
        raise EmulationError(f"{target} is already paused", hint=f"undo it with `{again}`")
    if action == "throttle":
        if status == "paused":
            raise EmulationError(f"{target} is paused: a frozen device cannot report its heat",
                                 hint=f"unfreeze it first with `{again}`")
        return throttle(emu, c, target, duration)
    net = client.networks.get(f"{emu.project}_{NETWORK}")
    if action == "kill":
        c.kill()
        done = f"killed {target}"
        undo = c.start
    elif action == "pause":
        _pause(client, c)
        done = f"paused {target}"
        undo = c.unpause
    else:  # partition
        address = c.attrs["NetworkSettings"]["Networks"].get(net.name, {}).get("IPAddress") or None
        if net.name not in c.attrs["NetworkSettings"]["Networks"]:
            raise EmulationError(f"{target} is already cut off the fleet network", hint=f"undo it with `{again}`")
        net.disconnect(c)
        _partitions(emu, target, address)  # for `fault resume` in another process
        done = f"cut {target} off the fleet network"

        def undo() -> None:
            _reconnect(net, c, target, _partitions(emu, target), shape=target in emu.devices)
    if duration is not None:
        time.sleep(duration)
        undo()
        done += f" for {duration:g} s, then undid it"
    return done


def _resume(emu: Emulation, client: Any, c: Any, target: str, status: str) -> str:
    """Undo whatever holds the device: start it if it exited (a killed device boots again), unfreeze it,
    reconnect it to the fleet network; in words, what was done (or that nothing held it)."""
    if status == "exited":
        c.start()
        started = f"started {target} again"
        return started + (f"; {cool(emu, c, target)}" if target in throttled_devices(emu) else "")
    done = []
    if status == "paused":
        c.unpause()
        done.append("unpaused")
    if target in throttled_devices(emu):
        done.append(cool(emu, c, target))
    net = client.networks.get(f"{emu.project}_{NETWORK}")
    c.reload()
    if net.name not in c.attrs["NetworkSettings"]["Networks"]:
        _reconnect(net, c, target, _partitions(emu, target), shape=target in emu.devices)
        done.append("reconnected to the fleet network")
    if not done:
        return f"{target} is running and connected: nothing to resume"
    return f"resumed {target}: {' and '.join(done)}"


def _partitions(emu: Emulation, device: str, address: str | None = None) -> str | None:
    """Remember the fleet address of a device being partitioned (``address`` given), or forget and
    return it (to reconnect it with that address)."""
    path = emu.out / PARTITIONS
    known = json.loads(path.read_text()) if path.is_file() else {}
    old = known.pop(device, None)
    if address is not None:
        known[device] = address
    write_atomic(path, (json.dumps(known) + "\n").encode())
    return address if address is not None else old


def _pause(client: Any, c: Any) -> None:
    """Freeze a device's processes; with its CPU quota lifted for the moment of freezing if need be.

    runc's cgroup-v1 freezer gives the tasks a few milliseconds to reach the frozen state and else fails
    ("unable to freeze"); a device throttled to a few percent of a core sleeps most of every CFS
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
    hc = c.attrs["HostConfig"]
    period, quota = hc.get("CpuPeriod") or 0, hc.get("CpuQuota") or 0
    if quota > 0:
        set_cpus(c, len(os.sched_getaffinity(0)))
    try:
        c.pause()
    finally:
        if quota > 0:
            c.update(cpu_period=period or None, cpu_quota=quota)


def set_cpus(c: Any, cpus: float) -> None:
    """Give a running container ``cpus`` host cores: its CFS quota per its period (100 ms if it has none)."""
    c.reload()
    period = c.attrs["HostConfig"].get("CpuPeriod") or 100_000
    c.update(cpu_period=period, cpu_quota=round(cpus * period))


def _reconnect(net: Any, c: Any, device: str, address: str | None = None, *, shape: bool = True) -> None:
    """Connect a partitioned device again, with its old ``address`` if given, and (``shape``) shape its link again.

    The engine gives the container a new interface (a new veth pair, eth1 after eth0) without the qdiscs
    and the ingress redirect the boot script put on the old one: unshaped, the device would upload at the
    host's speed. Without ``address`` the engine may hand it another one (one a killed or restarted
    container freed): its MQTT connection then hangs until the keep-alive runs out. A shard's broker or relay
    (``shape`` False) has no shaped link; its service name is its alias again, so its clients find it.
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
    if not shape:
        return
    code, out = c.exec_run(["/bin/sh", SHAPE_LINK], user="root")
    if code != 0:
        log.warning("%s is reconnected but its link is not shaped again (%s exited %s): %s", device, SHAPE_LINK,
                    code, out.decode("utf-8", "replace").strip() if isinstance(out, bytes) else out)
