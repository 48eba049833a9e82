"""fedge emulate without a Docker engine: profile limits, compose.yaml, payload layout, binfmt error.

The tests that need a running engine are in test_emulate_docker.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fedge.common.archs import arch_by_name
from fedge.emulate import images
from fedge.emulate.compose import CoordinatorArgs, Images, check_subnet, compose_dict, fleet_subnet, to_yaml
from fedge.emulate.limits import (
    MIN_CPU_SLICE_US,
    OS_SHARE_MB,
    cpu_period_us,
    device_plans,
    limits_for,
    oom_message,
)
from fedge.errors import ConfigError, EmulationError
from fedge.fleet.config import parse_fleet
from fedge.profiles.speed import speed_model

FLEET = {
    "run": {"method": "fedproto", "rounds": 2, "dataset": "digits", "fleet": "t"},
    "devices": [{"profile": "x86-gateway"}, {"profile": "rpi4-4gb"}, {"profile": "rpi-zero-2w", "count": 2}],
}


def _plans():
    cfg = parse_fleet(FLEET)
    return device_plans(cfg, {"x86-gateway-1": 300, "rpi4-4gb-1": 300, "rpi-zero-2w-1": 300, "rpi-zero-2w-2": 300})


def test_cpu_quota_follows_the_speed_model() -> None:
    plans = {p.device_id: p for p in _plans()}
    host = 4e9  # training MAC/s of one host core
    gw = limits_for(plans["x86-gateway-1"], host, host_cores=64)
    pi4 = limits_for(plans["rpi4-4gb-1"], host, host_cores=64)
    zero = limits_for(plans["rpi-zero-2w-1"], host, host_cores=64)
    # the speed model's rate on each device's own model and batch, over the host core's rate
    for lim in (gw, pi4, zero):
        dp = plans[lim.device_id]
        rate = speed_model(dp.profile).mac_rate(arch_by_name(dp.arch, embed_dim=64), dp.batch_size)
        assert lim.device_mac_rate == pytest.approx(rate) and lim.cpus == pytest.approx(rate / host, abs=1e-3)
    # issue 27: the quotas follow the published order, Zero 2 W < Pi 4 < N100 (a Pi 4 was once slower than a Zero)
    assert zero.cpus < pi4.cpus < gw.cpus
    assert zero.threads == 1 and pi4.threads == 2  # 0.35 of a core: one thread; 1.7 cores: two
    capped = limits_for(plans["x86-gateway-1"], 1e9, host_cores=2)
    assert capped.cpus == 2.0 and capped.cpus_wanted > 2 and capped.threads == 2


def test_a_small_quota_gets_a_longer_cfs_period_with_slices_of_at_least_20_ms() -> None:
    # At 100 ms a Zero's 0.069 cores were 6.9 ms slices, and a deployed device burnt 2.15x the CPU per round
    # it burnt unthrottled; the period grows so that every slice is at least 20 ms, up to the kernel's 1 s.
    assert cpu_period_us(1.0) == 100_000 and cpu_period_us(0.2) == 100_000  # 20 ms slices already
    assert cpu_period_us(0.069) == 289_856  # ceil(20 ms / 0.069)
    assert cpu_period_us(0.01) == 1_000_000  # 10 ms slices: the kernel allows no longer period
    for k in range(10, 4001):
        cpus = k / 1000
        period = cpu_period_us(cpus)
        assert 100_000 <= period <= 1_000_000, cpus
        assert cpus * period >= MIN_CPU_SLICE_US - 1 or period == 1_000_000, cpus
    with pytest.raises(ValueError, match="cpus must be positive"):
        cpu_period_us(0.0)
    zero = next(p for p in _plans() if p.device_id == "rpi-zero-2w-1")
    lim = limits_for(zero, 12e9, host_cores=2)
    assert lim.cpu_quota_us == round(lim.cpus * lim.cpu_period_us) and lim.cpu_quota_us >= MIN_CPU_SLICE_US - 1
    assert lim.to_dict()["cpu_period_us"] == lim.cpu_period_us


def test_memory_and_link_come_from_the_profile() -> None:
    lim = {p.device_id: limits_for(p, 4e9, host_cores=2, loss_pct=0.5) for p in _plans()}
    assert lim["rpi-zero-2w-2"].mem_limit_mb == 512 - OS_SHARE_MB
    assert lim["x86-gateway-1"].mem_limit_mb == 8192 - OS_SHARE_MB
    z = lim["rpi-zero-2w-1"]
    assert (z.uplink_kbit, z.downlink_kbit, z.delay_ms, z.loss_pct) == (375, 600, 75.0, 0.5)


def test_oom_message_names_the_plan_and_the_profile() -> None:
    cfg = parse_fleet({**FLEET, "devices": [{"profile": "rpi-zero-2w", "arch": "tier-xl"}],
                       "train": {"batch_size": 512}})
    (dp,) = device_plans(cfg, {"rpi-zero-2w-1": 700})
    msg = oom_message(dp)
    assert msg.startswith("rpi-zero-2w-1 ran out of memory: its plan (tier-xl at batch 512) needs ")
    assert f"{dp.train_memory_mb:.0f} MiB for training" in msg and dp.train_memory_mb > 300
    assert "the profile rpi-zero-2w has 512 MiB (432 MiB once the OS has its 80 MiB)" in msg


def _compose(tmp_path: Path) -> Path:
    plans = _plans()
    doc = compose_dict(tmp_path, Images("fedge-device:amd64-x", "fedge-coordinator:x", "fedge-broker:bookworm"),
                       [limits_for(p, 4e9, host_cores=2) for p in plans],
                       CoordinatorArgs(devices=len(plans), min_devices=len(plans)))
    path = tmp_path / "compose.yaml"
    path.write_text(to_yaml(doc, "test"))
    return path


def _zero_cpus() -> float:
    """The quota of rpi-zero-2w-1 in _compose's fleet: its speed-model rate over the host core's 4e9 MAC/s."""
    zero = next(p for p in _plans() if p.device_id == "rpi-zero-2w-1")
    return limits_for(zero, 4e9, host_cores=2).cpus


def test_compose_yaml_carries_the_limits(tmp_path: Path) -> None:
    import yaml

    doc = yaml.safe_load(_compose(tmp_path).read_text())
    zero = doc["services"]["rpi-zero-2w-1"]
    period = cpu_period_us(_zero_cpus())
    assert (zero["cpu_period"], zero["cpu_quota"]) == (period, round(_zero_cpus() * period)) and "cpus" not in zero
    assert zero["mem_limit"] == "432m" and zero["memswap_limit"] == "432m"
    assert zero["cap_add"] == ["NET_ADMIN"] and zero["volumes"] == ["./devices/rpi-zero-2w-1:/boot/firmware:ro"]
    assert zero["environment"]["FEDGE_UPLINK_KBIT"] == "375"
    assert zero["environment"]["OMP_WAIT_POLICY"] == "PASSIVE"  # threads that sleep, not spin, under a quota
    # Mosquitto reads its files by the absolute paths `fedge broker config` wrote: mounted at that path.
    assert doc["services"]["broker"]["volumes"] == [f"./broker:{tmp_path}/broker"]
    cmd = doc["services"]["coordinator"]["command"]
    assert "--min-devices" in cmd and cmd[cmd.index("--wait-for-fleet") + 1] == "120"


def test_compose_yaml_passes_docker_compose_config(tmp_path: Path) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does it as root)")
    path = _compose(tmp_path)
    proc = subprocess.run([exe, "-f", str(path), "config"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    import yaml

    resolved = yaml.safe_load(proc.stdout)
    assert set(resolved["services"]) == {"broker", "coordinator", "x86-gateway-1", "rpi4-4gb-1", "rpi-zero-2w-1",
                                         "rpi-zero-2w-2"}
    zero = resolved["services"]["rpi-zero-2w-1"]
    period = cpu_period_us(_zero_cpus())
    assert (zero["cpu_period"], zero["cpu_quota"]) == (period, round(_zero_cpus() * period))


def test_prepare_flashes_every_device_with_fedge_flash(tmp_path: Path) -> None:
    from fedge.emulate.emulation import project_name
    from fedge.emulate.lifecycle import prepare

    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[run]\nmethod = "fedproto"\nrounds = 1\ndataset = "digits"\nfleet = "t"\n'
                     '[[devices]]\nprofile = "rpi4-4gb"\n[[devices]]\nprofile = "rpi-zero-2w"\n')
    tags = Images(device="d:1", coordinator="c:1", broker="b:1")
    # Host rates given: no calibration (that times torch for seconds).
    rates = {(a, b): 2e9 for a in ("tier-xs", "tier-s", "tier-m", "tier-l", "tier-xl") for b in (8, 16, 32, 64)}
    emu = prepare(fleet, tmp_path / "emu", images=tags, rates=rates)
    assert emu.devices == ["rpi4-4gb-1", "rpi-zero-2w-1"]
    for dev in emu.devices:
        root = tmp_path / "emu" / "devices" / dev / "fedge"
        meta = json.loads((root / "payload.json").read_text())
        # The payload is fedge flash's own (its format and metadata), for this device and its profile.
        assert meta["format"] == "fedge-flash/1" and meta["device_id"] == dev
        assert meta["profile"] == emu.limits[dev]["profile"]
        assert (root / "bundle" / "password").stat().st_mode & 0o077 == 0
        assert (root / "bundle" / "password").read_text().strip() == \
            (tmp_path / "emu" / "broker" / "bundles" / dev / "password").read_text().strip()
        assert "edge run --bundle" in (root / "install.sh").read_text()
    doc = yaml.safe_load((tmp_path / "emu" / "compose.yaml").read_text())
    assert doc["services"]["rpi-zero-2w-1"]["volumes"] == ["./devices/rpi-zero-2w-1:/boot/firmware:ro"]
    # A configured subnet (fault partition reconnects a device with its address), one per emulation directory.
    subnet = doc["networks"]["fleet"]["ipam"]["config"][0]["subnet"]
    assert re.fullmatch(r"10\.2[0-4]\d\.\d{1,3}\.0/24", subnet), subnet
    assert subnet == fleet_subnet(project_name(tmp_path / "emu"))
    assert fleet_subnet("fedge-emu-aaaaaa") != fleet_subnet("fedge-emu-bbbbbb")
    # The dashboard: published on the host's loopback only, with a fresh 0600 token the coordinator must use
    # (it binds all of its container's addresses).
    coord = doc["services"]["coordinator"]
    assert emu.http_port is not None and coord["ports"] == [f"127.0.0.1:{emu.http_port}:8321"]
    assert coord["command"][-4:] == ["--http", "0.0.0.0:8321", "--http-token-file", "/fedge/http/token"]
    assert "./http:/fedge/http:ro" in coord["volumes"]
    token = tmp_path / "emu" / "http" / "token"
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text().strip()) >= 32
    assert token.read_text().strip() not in (tmp_path / "emu" / "compose.yaml").read_text()
    assert type(emu).load(tmp_path / "emu").dashboard == f"http://127.0.0.1:{emu.http_port}/"
    exe = shutil.which("docker-compose")
    if exe is not None:
        proc = subprocess.run([exe, "-f", str(tmp_path / "emu" / "compose.yaml"), "config"], capture_output=True,
                              text=True, check=False)
        assert proc.returncode == 0 and subnet in proc.stdout, proc.stderr
    assert not (root / "bundle" / "fleet.pub").exists()  # unsigned unless asked
    # --subnet overrides the pick (a host whose networks already use it); --sign: a signing fleet whose devices
    # take over-the-air updates (install.sh then gives the agent --state-dir and --model-store)
    prepare(fleet, tmp_path / "emu2", images=tags, rates=rates, subnet="192.168.77.5/26", sign=True)
    doc = yaml.safe_load((tmp_path / "emu2" / "compose.yaml").read_text())
    assert doc["networks"]["fleet"]["ipam"]["config"] == [{"subnet": "192.168.77.0/26"}]
    key = tmp_path / "emu2" / "coordinator" / "signing.key"  # the coordinator's state dir: it signs with it
    assert key.read_bytes() == (tmp_path / "emu2" / "broker" / "coordinator" / "signing.key").read_bytes()
    assert key.stat().st_mode & 0o077 == 0
    for dev in emu.devices:
        bundle = tmp_path / "emu2" / "devices" / dev / "fedge" / "bundle"
        assert (bundle / "fleet.pub").read_bytes() == (tmp_path / "emu2" / "broker/coordinator/fleet.pub").read_bytes()


@pytest.mark.parametrize(("subnet", "message"), [
    ("10.1.2.0/33", "is not a network"),
    ("fleet", "is not a network"),
    ("8.8.8.0/24", "not a private IPv4 network"),
    ("fd00::/64", "not a private IPv4 network"),
    ("10.9.9.0/30", "has 2 host addresses; the emulation needs 7"),
])
def test_a_bad_subnet_is_refused_before_anything_is_written(subnet: str, message: str, tmp_path: Path) -> None:
    from fedge.emulate.lifecycle import prepare

    with pytest.raises(ConfigError, match=message):
        check_subnet(subnet, devices=4)
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[run]\nmethod = "fedproto"\nrounds = 1\ndataset = "digits"\nfleet = "t"\n'
                     '[[devices]]\nprofile = "rpi4-4gb"\n')
    with pytest.raises(ConfigError, match=message.split(";")[0]):
        prepare(fleet, tmp_path / "emu", images=Images(device="d", coordinator="c", broker="b"),
                       subnet=subnet)
    assert not (tmp_path / "emu").exists()


def test_foreign_arch_without_binfmt_says_how_to_enable_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "BINFMT", tmp_path)  # an empty binfmt_misc: no handler registered
    foreign = "arm64" if images.os.uname().machine == "x86_64" else "amd64"
    with pytest.raises(EmulationError) as err:
        images.check_arch(foreign)
    assert "binfmt_misc has no enabled qemu-" in err.value.message
    assert "qemu-user-static" in (err.value.hint or "") and "/register" in (err.value.hint or "")
    with pytest.raises(EmulationError, match="unknown"):
        images.check_arch("mips")


def test_a_partitioned_devices_address_is_kept_for_resume(tmp_path: Path) -> None:
    # `fault partition DEVICE` and `fault resume DEVICE` run in two processes: the address the device had
    # (to reconnect it with, see fedge.emulate.faults._reconnect) goes through the emulation directory.
    from fedge.emulate import faults
    from fedge.emulate.emulation import Emulation

    emu = Emulation(tmp_path, "fedge-t-000000", "amd64", "t", Images("d", "c", "b"), {}, {})
    assert faults._partitions(emu, "rpi4-4gb-1", "10.201.7.3") == "10.201.7.3"
    assert faults._partitions(emu, "x86-gateway-1", "10.201.7.4") == "10.201.7.4"
    assert json.loads((tmp_path / faults.PARTITIONS).read_text()) == {"rpi4-4gb-1": "10.201.7.3",
                                                                       "x86-gateway-1": "10.201.7.4"}
    assert faults._partitions(emu, "rpi4-4gb-1") == "10.201.7.3"  # resumed: forgotten
    assert faults._partitions(emu, "rpi4-4gb-1") is None
    assert json.loads((tmp_path / faults.PARTITIONS).read_text()) == {"x86-gateway-1": "10.201.7.4"}


def test_a_hand_edited_compose_file_without_the_dashboard_port_is_refused(tmp_path: Path) -> None:
    """The dashboard's port was taken meanwhile and compose.yaml no longer publishes it as `up` wrote it: the
    coordinator is not started on a file it cannot fix, and the error says how to get a good one."""
    import socket

    from fedge.emulate.lifecycle import prepare, start_coordinator

    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[run]\nmethod = "fedproto"\nrounds = 1\ndataset = "digits"\nfleet = "t"\n'
                     '[[devices]]\nprofile = "rpi4-4gb"\n')
    rates = {(a, b): 2e9 for a in ("tier-xs", "tier-s", "tier-m", "tier-l", "tier-xl") for b in (8, 16, 32, 64)}
    emu = prepare(fleet, tmp_path / "emu", images=Images(device="d:1", coordinator="c:1", broker="b:1"), rates=rates)
    assert emu.http_port is not None
    compose = tmp_path / "emu" / "compose.yaml"
    compose.write_text(compose.read_text().replace(f"127.0.0.1:{emu.http_port}:8321", "127.0.0.1:1:8321"))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", emu.http_port))
        squatter.listen()
        with pytest.raises(EmulationError, match="does not publish the dashboard") as info:
            start_coordinator(emu)
    assert "fedge emulate up" in (info.value.hint or "")
