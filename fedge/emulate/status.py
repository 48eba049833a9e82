"""What an emulation is doing: each device's state, round, CPU, memory and bytes; a container's log.

States come from the engine (through the Docker SDK), rounds and bytes from the coordinator's
``reports.jsonl`` in the emulation directory, so a device's figures outlive its container.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.emulate.emulation import Emulation


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
    """``running``, ``exited (CODE)`` or ``missing``: the broker's, the coordinator's or a device's container."""
    c = emu.containers(client).get(service)
    if c is None:
        return "missing"
    c.reload()
    st = c.attrs["State"]
    return "running" if st.get("Running") else f"exited ({st.get('ExitCode')})"


def logs(emu: Emulation, client: Any, service: str, *, tail: int | None = None) -> str:
    """A container's log (its last ``tail`` lines), as text."""
    c = emu.container(client, service)
    raw = c.logs(tail=tail if tail is not None else "all")
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
