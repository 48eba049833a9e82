"""``fedge emulate fault throttle DEVICE [--for S]``: an emulated device that overheats, and ``fault resume`` when it
has cooled.

Throttling does what a Raspberry Pi's firmware does at its soft temperature limit, as far as a container can: the
device computes slower — its CPU quota (``docker update --cpu-quota``) becomes :data:`THROTTLE_SHARE` of what its
profile gave it, the share the thermal model's throttled device keeps (``[thermal] throttle_share``'s default) — and
it says so in its heartbeat: the health override file (:mod:`fedge.edge.health`, ``$FEDGE_HEALTH_OVERRIDE``, which
``fedge emulate up`` points at :data:`fedge.emulate.compose.HEALTH_OVERRIDE_PATH`) is written inside the container
with the firmware's flags :data:`THROTTLED_FLAGS` (frequency capped and throttled now; under-voltage and throttling
occurred) and a temperature above its profile's ``[thermal] limit_c`` (80 °C without a table). ``resume`` (or the
end of ``--for``) restores the quota and writes :data:`RESUMED_FLAGS` (only the "occurred" bits: it throttled since
boot, not now) and a temperature below ``resume_c``. The coordinator's thermal guard reacts to the heartbeats
(:mod:`fedge.common.heat`).

What each throttled device's quota was is kept in ``throttles.json`` in the emulation directory, so ``resume`` in
another process restores it.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from typing import Any

from fedge.common.atomicfile import write_atomic
from fedge.common.heat import HeatLimits
from fedge.emulate.compose import HEALTH_OVERRIDE_PATH
from fedge.emulate.emulation import Emulation
from fedge.errors import EmulationError, ProfileError

log = logging.getLogger(__name__)

THROTTLES = "throttles.json"
"""In the emulation directory: each throttled device's CPU period and quota before it was throttled."""
THROTTLE_SHARE = 0.6
"""The share of its CPU quota a throttled device keeps (the thermal model's default ``throttle_share``)."""
THROTTLED_FLAGS = 0x50006
"""get_throttled while throttling: ARM frequency capped and throttled now (bits 1, 2), under-voltage and throttling
occurred since boot (bits 16, 18), as a Pi 4 under load in a hot case reports them."""
RESUMED_FLAGS = 0x50000
"""get_throttled once cooled: only the "occurred" bits remain."""
OVER_LIMIT_C = 5.0
"""A throttled device reports its limit plus this; a cooled one its ``resume_c`` less this."""
MIN_QUOTA_US = 1000
"""The smallest CFS quota the engine accepts, µs."""


def heat_limits(emu: Emulation, device: str) -> HeatLimits:
    """Where ``device``'s profile says it becomes hot and cools (its ``[thermal]``; the defaults without one or when
    its profile cannot be read here)."""
    from fedge.profiles import load_profile

    ref = str(emu.limits.get(device, {}).get("profile") or "")
    try:
        profile = load_profile(ref if not ref.endswith(".toml") or ref.startswith("/") else emu.out / ref)
    except ProfileError as exc:
        log.info("%s: profile %r not readable here (%s): the default limits", device, ref, exc.message)
        return HeatLimits()
    return profile.thermal.limits if profile.thermal is not None else HeatLimits()


def write_override(c: Any, device: str, fields: dict[str, Any]) -> None:
    """Write the health override inside the running container ``c`` atomically (a temporary file, then rename): the
    agent reads it at its next heartbeat."""
    text = json.dumps(fields, sort_keys=True)
    tmp = f"{HEALTH_OVERRIDE_PATH}.tmp"
    script = f"printf '%s\\n' {shlex.quote(text)} > {tmp} && mv {tmp} {HEALTH_OVERRIDE_PATH}"
    code, out = c.exec_run(["/bin/sh", "-c", script], user="root")
    if code != 0:
        words = out.decode("utf-8", "replace").strip() if isinstance(out, bytes) else str(out)
        raise EmulationError(f"could not write {device}'s health override {HEALTH_OVERRIDE_PATH}: exit {code}: "
                             f"{words[-300:]}")


def _check_env(c: Any, device: str, emu: Emulation) -> None:
    """Refuse a device whose agent does not read the override (an emulation made before ``fault throttle``)."""
    env = c.attrs.get("Config", {}).get("Env") or []
    if f"FEDGE_HEALTH_OVERRIDE={HEALTH_OVERRIDE_PATH}" not in env:
        raise EmulationError(f"{device} does not read a health override (its container has no "
                             f"FEDGE_HEALTH_OVERRIDE={HEALTH_OVERRIDE_PATH}): the emulation predates fault throttle",
                             hint=f"recreate it: fedge emulate down --dir {emu.out}, then fedge emulate up again")


def _book(emu: Emulation) -> dict[str, dict[str, int]]:
    path = emu.out / THROTTLES
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(emu: Emulation, book: dict[str, dict[str, int]]) -> None:
    write_atomic(emu.out / THROTTLES, (json.dumps(book, sort_keys=True) + "\n").encode())


def throttled_devices(emu: Emulation) -> list[str]:
    """The devices throttled now (by ``throttles.json``)."""
    return sorted(_book(emu))


def throttle(emu: Emulation, c: Any, device: str, duration: float | None = None) -> str:
    """Throttle the running device ``device`` (container ``c``); with ``duration``, cool it after that many
    seconds. In words, what was done."""
    book = _book(emu)
    again = f"fedge emulate fault resume {device} --dir {emu.out}"
    if device in book:
        raise EmulationError(f"{device} is already throttled", hint=f"undo it with `{again}`")
    _check_env(c, device, emu)
    c.reload()
    hc = c.attrs["HostConfig"]
    period, quota = int(hc.get("CpuPeriod") or 0), int(hc.get("CpuQuota") or 0)
    base_period = period or 100_000
    base_quota = quota if quota > 0 else base_period * len(os.sched_getaffinity(0))  # no quota: the host's cores
    lowered = max(MIN_QUOTA_US, round(base_quota * THROTTLE_SHARE))
    limits = heat_limits(emu, device)
    hot = limits.limit_c + OVER_LIMIT_C
    book[device] = {"period": period, "quota": quota}
    _save(emu, book)  # first: a resume in another process must find it even if the next steps fail
    c.update(cpu_period=base_period, cpu_quota=lowered)
    write_override(c, device, {"cpu_temp_c": hot, "throttled": f"{THROTTLED_FLAGS:#x}"})
    done = (f"throttled {device}: CPU quota {base_quota / base_period:.3g} -> {lowered / base_period:.3g} cores, "
            f"reporting {hot:g} °C and flags {THROTTLED_FLAGS:#x}")
    if duration is not None:
        time.sleep(duration)
        done += f" for {duration:g} s, then {cool(emu, c, device)}"
    return done


def cool(emu: Emulation, c: Any, device: str) -> str:
    """Undo :func:`throttle`: restore ``device``'s quota and report it cooled. In words, what was done."""
    book = _book(emu)
    saved = book.get(device)
    if saved is None:
        raise EmulationError(f"{device} is not throttled")
    period, quota = saved["period"], saved["quota"]
    c.update(cpu_period=period or 100_000, cpu_quota=quota if quota > 0 else -1)
    cooled = heat_limits(emu, device).resume - OVER_LIMIT_C
    write_override(c, device, {"cpu_temp_c": cooled, "throttled": f"{RESUMED_FLAGS:#x}"})
    del book[device]
    _save(emu, book)
    return f"cooled (CPU quota restored, reporting {cooled:g} °C and flags {RESUMED_FLAGS:#x})"

