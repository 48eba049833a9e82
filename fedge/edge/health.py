"""The device's heartbeat: a small health record, read from Linux's /proc and /sys, published every few seconds.

Nothing here needs a package beyond the standard library (a Raspberry Pi Zero runs it beside its
training): memory from ``/proc/self/status`` and ``/proc/meminfo`` (and the cgroup's limit, so a
container reports what it may use, not the host's RAM), CPU from the process's own times, the
temperature from the hottest CPU thermal zone, the clock from cpufreq, the Pi firmware's throttle
flags from ``get_throttled`` where the kernel exposes it, free disk with ``statvfs``. Whatever the
machine cannot tell is sent as null. The schema and its limits are :mod:`fedge.common.health`.

For tests and emulation, a JSON file (``fedge edge run --health-override FILE``, or ``$FEDGE_HEALTH_OVERRIDE``) may
override the sensors' readings (:data:`OVERRIDABLE`): ``{"cpu_temp_c": 84.0, "throttled": 327686}`` makes the
device report itself hot and throttling, as ``fedge emulate fault throttle`` does inside a container
(:class:`HealthOverride`). It is read at every heartbeat; while it is absent the device reports its real readings.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedge import __version__
from fedge.common.health import FIELDS, HEARTBEAT_S, MAX_NAME, MAX_TEXT, HealthError, check_field
from fedge.common.messages import Message
from fedge.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = HEARTBEAT_S
PROC = Path("/proc")
SYS = Path("/sys")
# Where the Raspberry Pi firmware driver exposes vcgencmd's get_throttled (kernels since 5.x).
PI_THROTTLED = SYS / "devices/platform/soc/soc:firmware/get_throttled"
# Thermal zones whose type names the CPU (Pi: cpu-thermal; x86: x86_pkg_temp, coretemp; others: soc, cpu0 ...).
CPU_ZONE_WORDS = ("cpu", "x86_pkg", "soc", "core", "package")
HEALTH_OVERRIDE_ENV = "FEDGE_HEALTH_OVERRIDE"
OVERRIDABLE = ("cpu_temp_c", "throttled", "cpu_mhz", "cpu_max_mhz")
"""The readings a health override may set: the sensors of heat and throttling."""
MAX_OVERRIDE_BYTES = 4096


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _kib_fields(path: Path, names: tuple[str, ...]) -> dict[str, int]:
    """``Name:  123 kB`` lines of a /proc file, in bytes."""
    out: dict[str, int] = {}
    text = _read(path) or ""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup in bytes; None where there is none or no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        raw = _read(SYS / "fs/cgroup" / limit_file)
        if raw is None:
            continue
        usage = _read(SYS / "fs/cgroup" / usage_file)
        limit = int(raw) if raw.isdigit() and int(raw) < 1 << 60 else None  # "max", or v1's "no limit" 2^63
        return limit, int(usage) if usage and usage.isdigit() else None
    return None, None


def memory() -> dict[str, int | None]:
    """The agent's RSS, and the RAM it may use and has left (the cgroup's limit where lower than the machine's)."""
    rss = _kib_fields(PROC / "self/status", ("VmRSS",)).get("VmRSS")
    info = _kib_fields(PROC / "meminfo", ("MemTotal", "MemAvailable"))
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    limit, usage = _cgroup_memory()
    if limit is not None and (total is None or limit < total):
        total = limit
        if usage is not None:
            avail = max(0, min(avail if avail is not None else limit, limit - usage))
    return {"rss_bytes": rss, "mem_total_bytes": total, "mem_available_bytes": avail}


def cpu_temperature() -> float | None:
    """The hottest CPU thermal zone in °C (any zone if none is named for the CPU); None without one."""
    temps: list[tuple[bool, float]] = []
    for zone in sorted((SYS / "class/thermal").glob("thermal_zone*")):
        raw = _read(zone / "temp")
        if raw is None or not raw.lstrip("-").isdigit():
            continue
        kind = (_read(zone / "type") or "").lower()
        temps.append((any(w in kind for w in CPU_ZONE_WORDS), int(raw) / 1000.0))
    cpu = [t for is_cpu, t in temps if is_cpu] or [t for _, t in temps]
    return max(cpu) if cpu else None


def cpu_clock() -> tuple[float | None, float | None]:
    """(current, maximum) clock of CPU 0 in MHz from cpufreq; None where the kernel has no cpufreq."""
    base = SYS / "devices/system/cpu/cpu0/cpufreq"

    def mhz(name: str) -> float | None:
        raw = _read(base / name)
        return int(raw) / 1000.0 if raw and raw.isdigit() else None

    return mhz("scaling_cur_freq"), mhz("cpuinfo_max_freq")


def pi_throttled() -> int | None:
    """The Raspberry Pi firmware's throttle flags (vcgencmd get_throttled), where the kernel exposes them."""
    raw = _read(PI_THROTTLED)
    if raw is None:
        return None
    try:  # the driver prints the flags in hex ("50005"), vcgencmd as "throttled=0x50005"
        return int(raw.removeprefix("throttled=").removeprefix("0x"), 16)
    except ValueError:
        return None


def uptime() -> float | None:
    raw = _read(PROC / "uptime")
    try:
        return float(raw.split()[0]) if raw else None
    except (ValueError, IndexError):
        return None


def disk_free(path: str | os.PathLike[str] = "/") -> int | None:
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


class HealthOverride:
    """A JSON object whose fields (:data:`OVERRIDABLE`) replace the sensors' readings in every health record.

    :meth:`read` returns them ({} while the file does not exist); a file that is not a JSON object of those fields,
    each of the schema's type and range (``throttled`` also as a hex string, ``"0x50006"``), is refused with a
    :class:`~fedge.errors.ConfigError` naming the file and the field. :meth:`fields` is what a heartbeat uses: a
    refused file is logged (once per distinct problem) and the real readings are sent.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._last_problem = ""

    def read(self) -> dict[str, Any]:
        """The fields the file overrides ({} while it does not exist); :class:`ConfigError` if it is malformed."""
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_OVERRIDE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(f"health override {self.path}: cannot read it: {exc.strerror or exc}",
                              hint="make it a readable file, or remove it for the real readings") from exc
        if len(raw) > MAX_OVERRIDE_BYTES:
            raise ConfigError(f"health override {self.path}: more than {MAX_OVERRIDE_BYTES} bytes",
                              hint=f"a JSON object of at most these fields: {', '.join(OVERRIDABLE)}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"health override {self.path}: not JSON: {exc}",
                              hint='write a JSON object, e.g. {"cpu_temp_c": 84.0, "throttled": "0x50006"}') from exc
        if not isinstance(data, dict):
            raise ConfigError(f"health override {self.path}: must be a JSON object, got {type(data).__name__}",
                              hint='e.g. {"cpu_temp_c": 84.0, "throttled": "0x50006"}')
        out: dict[str, Any] = {}
        for name, value in data.items():
            if name not in OVERRIDABLE:
                raise ConfigError(f"health override {self.path}: unknown field {str(name)[:40]!r}",
                                  hint=f"it may set {', '.join(OVERRIDABLE)}")
            if name == "throttled" and isinstance(value, str):
                try:
                    value = int(value, 16) if value.lower().startswith("0x") else int(value)
                except ValueError:
                    raise ConfigError(f"health override {self.path}: throttled = {value[:24]!r} is not a number",
                                      hint='the Pi firmware flags as an integer or a hex string, e.g. "0x50006"'
                                      ) from None
            try:
                out[name] = check_field(name, value)
            except HealthError as exc:
                raise ConfigError(f"health override {self.path}: {exc.message}",
                                  hint=f"{name}: {_OVERRIDE_HINTS[name]}") from exc
        return out

    def fields(self) -> dict[str, Any]:
        """:meth:`read`, or {} with a warning (once per distinct problem) when the file is malformed."""
        try:
            out = self.read()
        except ConfigError as exc:
            if exc.message != self._last_problem:
                log.warning("%s; reporting the real readings", exc.message)
                self._last_problem = exc.message
            return {}
        self._last_problem = ""
        return out


_OVERRIDE_HINTS = {"cpu_temp_c": "°C, e.g. 84.0", "throttled": 'the Pi firmware flags, e.g. "0x50006" or 327686',
                   "cpu_mhz": "MHz, e.g. 600", "cpu_max_mhz": "MHz, e.g. 1500"}


def health_override(path: str | os.PathLike[str] | None) -> HealthOverride | None:
    """The override of ``path``, else of ``$FEDGE_HEALTH_OVERRIDE`` (None: neither), checked now if it exists: a
    malformed file fails the start (:class:`ConfigError`) rather than a heartbeat later."""
    chosen = path or os.environ.get(HEALTH_OVERRIDE_ENV) or None
    if chosen is None:
        return None
    override = HealthOverride(chosen)
    found = override.read()
    log.info("health override %s: %s", chosen, f"overriding {', '.join(sorted(found))}" if found else
             "no such file yet: the real readings until it appears")
    return override


class HealthSampler:
    """Builds one health record per call; CPU % is the agent's share since the previous call; ``override``: the
    readings a :class:`HealthOverride` replaces."""

    def __init__(self, model: str, *, disk_path: str | os.PathLike[str] = "/",
                 clock: Callable[[], float] = time.monotonic, override: HealthOverride | None = None) -> None:
        self.model = model[:MAX_NAME]
        self.disk_path = disk_path
        self.clock = clock
        self.override = override
        self.started = clock()
        self.seq = 0
        self._cpu = (clock(), _cpu_seconds())

    def sample(self, *, last_round: int, model_round: int, last_error: str | None) -> dict[str, Any]:
        """The record (a dict of :data:`fedge.common.health.FIELDS`), every value within its bounds."""
        now, cpu = self.clock(), _cpu_seconds()
        then, cpu_then = self._cpu
        self._cpu = (now, cpu)
        self.seq += 1
        cur, top = cpu_clock()
        rec: dict[str, Any] = {
            "seq": self.seq,
            "sent": time.time(),
            "uptime_s": uptime(),
            "agent_uptime_s": max(0.0, now - self.started),
            **memory(),
            "cpu_percent": 100.0 * (cpu - cpu_then) / (now - then) if now > then else None,
            "cpu_count": os.cpu_count(),
            "cpu_temp_c": cpu_temperature(),
            "cpu_mhz": cur,
            "cpu_max_mhz": top,
            "throttled": pi_throttled(),
            "disk_free_bytes": disk_free(self.disk_path),
            "fedge_version": __version__[:MAX_NAME],
            "model": self.model,
            "model_round": max(0, model_round),
            "last_round": max(0, last_round),
            "last_error": last_error[:MAX_TEXT] if last_error else None,
        }
        if self.override is not None:
            rec.update(self.override.fields())
        return {k: _clamp(k, v) for k, v in rec.items()}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _clamp(name: str, value: Any) -> Any:
    """Keep a reading within the schema's bounds (a broken sensor must not get the record refused)."""
    kind, lo, hi, _ = FIELDS[name]
    if value is None or kind == "text":
        return value
    value = min(max(value, lo), hi)
    return int(value) if kind == "int" else float(value)


class Heartbeat:
    """A daemon thread that publishes the device's health every ``interval_s`` through ``send``.

    ``state`` returns (last round, model round, last error) at each beat. A failure to sample or to
    send is logged once per distinct message and never stops the agent.
    """

    def __init__(self, device_id: str, fleet: str, sampler: HealthSampler, send: Callable[[bytes], None],
                 state: Callable[[], tuple[int, int, str | None]], interval_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.device_id = device_id
        self.fleet = fleet
        self.sampler = sampler
        self.send = send
        self.state = state
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_failure = ""
        self.sent = 0

    def beat(self) -> None:
        """Sample and publish one record now."""
        last_round, model_round, error = self.state()
        rec = self.sampler.sample(last_round=last_round, model_round=model_round, last_error=error)
        msg = Message("health", self.device_id, last_round, self.fleet, info={"health": rec})
        self.send(msg.to_bytes())
        self.sent += 1

    def _run(self) -> None:
        # The first beat a moment after start: the connection is usually up by then (a heartbeat sent
        # while disconnected is dropped, not queued).
        if self._stop.wait(min(1.0, self.interval_s)):
            return
        while True:
            try:
                self.beat()
            except Exception as exc:  # a heartbeat is a courtesy: it never stops the device
                text = f"{type(exc).__name__}: {exc}"
                if text != self._last_failure:
                    log.warning("%s: heartbeat failed: %s", self.device_id, text)
                    self._last_failure = text
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> Heartbeat:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.device_id}", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, last_beat: bool = True) -> None:
        """Stop beating; with ``last_beat`` send one more record first (the device's state as it leaves: its
        last round, and a record at all from a run shorter than one heartbeat)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            if last_beat:
                try:
                    self.beat()
                except Exception as exc:  # the connection may be gone already
                    log.debug("%s: last heartbeat not sent: %s", self.device_id, exc)
