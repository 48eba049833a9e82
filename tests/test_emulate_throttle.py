"""``fedge emulate fault throttle DEVICE [--for S]`` and ``fault resume``: an emulated device that overheats — its CPU
quota x0.6 and its heartbeat saying so (the Pi firmware's flags 0x50006, a temperature over its limit) — and cools.

Against a stand-in for the engine (the words, the quota, the file written, the refusals), and once on a real engine
with a running emulated fleet: the quota reaches the container, the coordinator sees the flags in the heartbeats and
its thermal guard holds the device out of selection until it has cooled."""

from __future__ import annotations

import json
import re
import shlex
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from emulate_helpers import Client, Container

from fedge.cli import build_parser
from fedge.common.heat import HeatLimits
from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.emulate import faults, lifecycle, status, throttle
from fedge.emulate.compose import HEALTH_OVERRIDE_PATH, Images
from fedge.emulate.emulation import Emulation
from fedge.errors import ConfigError, EmulationError
from fedge.profiles import load_profile
from fedge.profiles.loader import dump_profile
from fedge.profiles.thermal import Thermal


def stand_in(out: Path, profile: str = "rpi4-4gb") -> Emulation:
    out.mkdir(parents=True, exist_ok=True)
    emu = Emulation(out.resolve(), "p", "amd64", "f", Images("d", "c", "b"), {"dev-1": {}},
                    {"dev-1": {"profile": profile, "mem_limit_mb": 100}})
    emu.save()
    return emu


def written(c: Container) -> list[dict[str, Any]]:
    """The health overrides written into the stand-in container, in order."""
    out = []
    for call in c.calls:
        if call.startswith("exec /bin/sh -c printf"):
            script = call.removeprefix("exec /bin/sh -c ")
            assert script.endswith(f"mv {HEALTH_OVERRIDE_PATH}.tmp {HEALTH_OVERRIDE_PATH}"), script  # atomically
            out.append(json.loads(shlex.split(script)[2]))
    return out


def test_the_fault_words_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["emulate", "fault", "throttle", "dev-1", "--for", "30", "--dir", "runs/x"])
    assert (args.action, args.target, args.duration, args.dir) == ("throttle", "dev-1", 30.0, "runs/x")
    assert parser.parse_args(["emulate", "fault", "resume", "dev-1"]).action == "resume"
    with pytest.raises(SystemExit):
        parser.parse_args(["emulate", "fault", "overheat", "dev-1"])
    assert "throttle" in faults.FAULTS


def test_throttle_lowers_the_quota_reports_hot_and_resume_restores_both(tmp_path: Path) -> None:
    emu = stand_in(tmp_path)
    c = Container("running")
    c.cpu_period, c.cpu_quota = 100_000, 50_000  # half a core, as its profile gave it
    client = Client(c)
    said = faults.fault(emu, client, "throttle", "dev-1")
    assert said == "throttled dev-1: CPU quota 0.5 -> 0.3 cores, reporting 85 °C and flags 0x50006"
    assert (c.cpu_period, c.cpu_quota) == (100_000, 30_000)
    assert written(c) == [{"cpu_temp_c": 85.0, "throttled": "0x50006"}]  # over the Pi's 80 °C
    assert throttle.throttled_devices(emu) == ["dev-1"]
    with pytest.raises(EmulationError, match="dev-1 is already throttled") as err:
        faults.fault(emu, client, "throttle", "dev-1")
    assert err.value.hint is not None and "fedge emulate fault resume dev-1" in err.value.hint
    # resume in another process: the quota comes back from throttles.json
    said = faults.fault(Emulation.load(emu.out), client, "resume", "dev-1")
    assert said == "resumed dev-1: cooled (CPU quota restored, reporting 70 °C and flags 0x50000)"
    assert (c.cpu_period, c.cpu_quota) == (100_000, 50_000)
    assert written(c)[-1] == {"cpu_temp_c": 70.0, "throttled": "0x50000"}  # below the 75 °C it resumes at
    assert throttle.throttled_devices(emu) == []
    assert faults.fault(emu, client, "resume", "dev-1") == "dev-1 is running and connected: nothing to resume"


def test_throttle_for_a_while_uses_the_profiles_limits(tmp_path: Path) -> None:
    profile = tmp_path / "hot-pi.toml"
    box = Thermal(c_per_w=8.0, tau_s=60.0, limit_c=65.0, resume_c=50.0)
    profile.write_text(dump_profile(replace(load_profile("rpi4-4gb"), thermal=box)))
    emu = stand_in(tmp_path / "emu", profile=str(profile))
    assert throttle.heat_limits(emu, "dev-1") == HeatLimits(65.0, 50.0)
    c = Container("running")
    c.cpu_period, c.cpu_quota = 200_000, 10_000
    said = faults.fault(emu, Client(c), "throttle", "dev-1", duration=0.01)
    assert said == ("throttled dev-1: CPU quota 0.05 -> 0.03 cores, reporting 70 °C and flags 0x50006 for 0.01 s, "
                    "then cooled (CPU quota restored, reporting 45 °C and flags 0x50000)")
    assert c.calls[0] == "update 200000 6000" and (c.cpu_period, c.cpu_quota) == (200_000, 10_000)
    assert [w["cpu_temp_c"] for w in written(c)] == [70.0, 45.0]


@pytest.mark.parametrize(("status", "words"), [
    ("exited", "dev-1 is not running, so there is nothing to throttle"),
    ("paused", "dev-1 is paused: a frozen device cannot report its heat"),
])
def test_a_throttle_the_state_rules_out_says_why(tmp_path: Path, status: str, words: str) -> None:
    c = Container(status, 137)
    with pytest.raises(EmulationError) as err:
        faults.fault(stand_in(tmp_path), Client(c), "throttle", "dev-1")
    assert err.value.message.startswith(words) and c.calls == []


def test_throttle_refuses_a_service_and_an_emulation_made_before_it(tmp_path: Path) -> None:
    emu = stand_in(tmp_path)
    with pytest.raises(ConfigError, match="fault throttle takes a device, not 'broker'"):
        faults.fault(emu, Client(Container("running")), "throttle", "broker")
    old = Container("running")
    old.env = []  # its agent does not read an override
    with pytest.raises(EmulationError, match="the emulation predates fault throttle") as err:
        faults.fault(emu, Client(old), "throttle", "dev-1")
    assert err.value.hint is not None and "fedge emulate up" in err.value.hint
    assert old.calls == [] and throttle.throttled_devices(emu) == []


# -- on a real engine ------------------------------------------------------------------------------

HOT_FLEET = """
[run]
name = "hot"
fleet = "hot"
method = "fedavg"
rounds = 200
dataset = "digits"

[partition]
fraction = 0.2

[train]
local_epochs = 1

[coordinator]
sample = 1
selection = "oort"
explore = 0.0
thermal_guard = true

[[devices]]
profile = "x86-gateway"
count = 2
arch = "tier-xs"
"""


def _metric(emu: Emulation, name: str, device: str) -> float | None:
    """``name{device=...}`` from the coordinator's /metrics (None: not there yet)."""
    token = (emu.out / "http" / "token").read_text().strip()
    req = urllib.request.Request(f"{emu.dashboard}metrics", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf'^{name}\{{device="{re.escape(device)}"[^}}]*\}} (\S+)$', text, re.M)
    return None if m is None else float(m.group(1))


def _until(what: str, ok: Callable[[], Any], emu: Emulation, client: Any, timeout_s: float = 120) -> Any:
    end = time.monotonic() + timeout_s
    while not (got := ok()):
        assert status.service_state(emu, client, "coordinator") == "running", \
            f"the run ended before {what}: " + status.logs(emu, client, "coordinator", tail=20)
        assert time.monotonic() < end, f"not {what} after {timeout_s:.0f} s"
        time.sleep(0.5)
    return got


def _quota(c: Any) -> int:
    c.reload()
    return int(c.attrs["HostConfig"]["CpuQuota"])


def test_a_throttled_device_in_docker_is_held_by_the_coordinator_until_resumed(
        docker_env: tuple[Any, Images], emulation: list[Emulation], tmp_path: Path) -> None:
    """Two gateways, one device a round by Oort with the thermal guard. ``fault throttle`` lowers one's CPU quota to
    0.6x and its heartbeats say 0x50006 and 85 °C; the coordinator's /metrics shows them and its rounds hold the
    device (the report's ``hot``); ``fault resume`` restores the quota, the heartbeats say 0x50000, and the device is
    no longer held."""
    client, tags = docker_env
    (tmp_path / "fleet.toml").write_text(HOT_FLEET)
    emu = lifecycle.prepare(tmp_path / "fleet.toml", tmp_path / "emu", images=tags, device_args=("--heartbeat", "1"))
    emulation.append(emu)
    lifecycle.start(emu, client, online_timeout=300)
    reports = emu.out / "coordinator" / REPORTS_FILE
    _until("round 1 done", lambda: reports.is_file() and read_reports(reports), emu, client, 300)
    victim = emu.devices[0]
    c = emu.container(client, victim)
    before = _quota(c)
    assert before > 0
    said = faults.fault(emu, client, "throttle", victim)
    assert said.startswith(f"throttled {victim}: CPU quota ") and "reporting 85 °C and flags 0x50006" in said
    assert _quota(c) == max(throttle.MIN_QUOTA_US, round(before * 0.6))
    _until("the coordinator sees the flags", lambda: _metric(emu, "fedge_device_throttled_flags", victim) == 0x50006,
           emu, client)
    assert _metric(emu, "fedge_device_cpu_temperature_celsius", victim) == 85.0

    def held() -> Any:
        return next((r for r in read_reports(reports) if victim in r.hot), None)

    rep = _until(f"a round holding {victim}", held, emu, client)
    assert rep.sampled == [d for d in emu.devices if d != victim], rep
    assert rep.selection[victim].startswith("hot: its firmware throttles (flags 0x50006) at 85.0 °C"), rep.selection
    assert faults.fault(emu, client, "resume", victim) == (
        f"resumed {victim}: cooled (CPU quota restored, reporting 70 °C and flags 0x50000)")
    assert _quota(c) == before
    _until("the coordinator sees it cooled", lambda: _metric(emu, "fedge_device_throttled_flags", victim) == 0x50000,
           emu, client)
    cooled_at = max(r.round for r in read_reports(reports))

    def free() -> Any:
        return next((r for r in read_reports(reports) if r.round > cooled_at + 1 and r.sampled), None)

    rep = _until(f"a round after {victim} cooled", free, emu, client)
    assert victim not in rep.hot and not rep.selection[victim].startswith("hot"), rep.selection
    lifecycle.down(emu)
