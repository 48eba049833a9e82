"""`fedge flash`: the payload contract (NOTES.md) on a boot directory and inside a synthetic disk image, the
first-boot hooks (firstrun chained, cloud-init merged), idempotence, refusals, the systemd unit, and the flashed
install.sh installing an agent that trains on real PNG images with a coordinator on a real Mosquitto."""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from own_data_helpers import own_data_fleet, write_digit_pngs

from fedge.broker.config import BrokerOptions, write_broker_config
from fedge.errors import ConfigError, ExportError, ProfileError
from fedge.flash.boot import CMDLINE_ENTRY, RUNCMD
from fedge.flash.flash import flash, flash_dir
from fedge.flash.image import flash_image
from fedge.flash.payload import prepare
from fedge.fleet.config import device_ids, load_fleet
from fedge.mqtt.broker import MosquittoProcess, free_port

REPO = Path(__file__).resolve().parents[1]
CMDLINE = "console=serial0,115200 console=tty1 root=PARTUUID=4e639091-02 rootfstype=ext4 fsck.repair=yes rootwait\n"
CONFIG_TXT = "dtparam=audio=on\narm_64bit=1\n"
IMAGER_FIRSTRUN = ("#!/bin/bash\nset +e\n/usr/lib/raspberrypi-sys-mods/imager_custom enable_ssh\n"
                   "rm -f /boot/firstrun.sh\nsed -i 's| systemd.run.*||g' /boot/cmdline.txt\nexit 0\n")


def fleet_and_broker(tmp: Path, port: int = 1883) -> tuple[Path, Path]:
    fleet = own_data_fleet(tmp / "fleet.toml")
    cfg = load_fleet(fleet)
    broker = tmp / "broker"
    write_broker_config(cfg.run.fleet, [i for i, _ in device_ids(cfg)], broker,
                        BrokerOptions(port=port, bind="127.0.0.1", hostname="127.0.0.1", run_as=getpass.getuser(),
                                      iterations=10),
                        fleet_config=fleet)
    return fleet, broker


def rpi_boot(path: Path, firstrun: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "cmdline.txt").write_text(CMDLINE)
    (path / "config.txt").write_text(CONFIG_TXT)
    if firstrun:
        (path / "firstrun.sh").write_text(IMAGER_FIRSTRUN)
    return path


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(root.rglob("*")) if p.is_file()}


def check_payload(boot: Path, device: str) -> dict[str, object]:
    """payload.json names every other payload file with its true size and sha256."""
    meta = json.loads((boot / "fedge" / "payload.json").read_text())
    on_disk = {str(p.relative_to(boot / "fedge")) for p in (boot / "fedge").rglob("*") if p.is_file()}
    assert set(meta["files"]) == on_disk - {"payload.json"}
    for rel, entry in meta["files"].items():
        data = (boot / "fedge" / rel).read_bytes()
        assert (entry["bytes"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), rel
    assert (meta["device_id"], meta["fleet"], meta["profile"], meta["cpu_arch"]) == (device, "own", "rpi4-2gb",
                                                                                      "aarch64")
    # FAT keeps no modes: payload.json carries them (install.sh applies them on the device).
    modes = {rel: e["mode"] for rel, e in meta["files"].items()}
    assert (modes["bundle/password"], modes["install.sh"], modes["bundle/bundle.toml"]) == ("0600", "0755", "0644")
    return meta


def test_flash_to_writes_the_contract_payload_chains_firstrun_and_is_idempotent(tmp_path: Path) -> None:
    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot")
    plan = prepare("rpi4-2gb-2", fleet, broker)
    dry = flash_dir(boot, plan, dry_run=True)
    assert not (boot / "fedge").exists() and (boot / "cmdline.txt").read_text() == CMDLINE
    listing = flash_dir(boot, plan)
    files = tree(boot)
    assert dry.files == listing.files == sorted((k, len(v[0]), v[1]) for k, v in files.items() if k != "config.txt")
    meta = check_payload(boot, "rpi4-2gb-2")
    assert meta["init"] == "firstrun" and meta["own_data"] is True
    bundle = broker / "bundles" / "rpi4-2gb-2"
    for name in ("bundle.toml", "fleet.toml", "password"):
        assert files[f"fedge/bundle/{name}"][0] == (bundle / name).read_bytes()
    assert files["fedge/bundle/password"][1] == 0o600 and files["fedge/install.sh"][1] == 0o755
    assert "\nEXTRA=device\n" in files["fedge/install.sh"][0].decode()  # own data: the device set only
    assert not any("rpi4-2gb-1" in k for k in files)  # its own credentials only
    # The kernel command line gets the hook once, everything else untouched.
    assert (boot / "cmdline.txt").read_text() == CMDLINE.strip() + " " + CMDLINE_ENTRY + "\n"
    # Imager's firstrun.sh is kept and run first by fedge's hook.
    assert files["fedge/firstrun.previous.sh"][0].decode() == IMAGER_FIRSTRUN
    hook = (boot / "firstrun.sh").read_text()
    assert "fedge/firstrun.previous.sh" in hook and "fedge-install.service" in hook
    unit = files["fedge/fedge-edge.service"][0].decode()
    assert "ExecStart=/opt/fedge/bin/fedge-edge\n" in unit and "NoNewPrivileges=yes" in unit
    assert "ProtectSystem=strict" in unit and "StateDirectory=fedge" in unit and "Restart=always" in unit
    # Flashing again: the same bytes, one cmdline entry, the original firstrun.sh still the chained one.
    flash_dir(boot, prepare("rpi4-2gb-2", fleet, broker))
    assert tree(boot) == files
    assert (boot / "cmdline.txt").read_text().count("systemd.run=") == 1


def test_cloud_init_user_data_is_merged_not_overwritten(tmp_path: Path) -> None:
    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot", firstrun=False)
    user_data = ("#cloud-config\nhostname: cam-07\nusers:\n  - name: pi\n    groups: sudo\n"
                 "runcmd:\n  - [systemctl, enable, ssh]\n")
    (boot / "user-data").write_text(user_data)
    (boot / "meta-data").write_text("instance-id: rpi-imager-1700000000\n")
    plan = prepare("rpi4-2gb-1", fleet, broker)
    assert flash_dir(boot, plan).init == "cloud-init"
    flash_dir(boot, plan)
    text = (boot / "user-data").read_text()
    merged = yaml.safe_load(text)
    assert text.startswith("#cloud-config\n")
    assert merged["hostname"] == "cam-07" and merged["users"] == [{"name": "pi", "groups": "sudo"}]
    assert merged["runcmd"] == [["systemctl", "enable", "ssh"], RUNCMD]  # appended once, after the user's
    assert (boot / "meta-data").read_text() == "instance-id: rpi-imager-1700000000\n"
    assert (boot / "cmdline.txt").read_text() == CMDLINE and not (boot / "firstrun.sh").exists()
    assert json.loads((boot / "fedge" / "payload.json").read_text())["init"] == "cloud-init"


def test_the_hook_is_detected_from_the_partition_and_init_forces_it(tmp_path: Path) -> None:
    fleet, broker = fleet_and_broker(tmp_path)
    plan = prepare("rpi4-2gb-1", fleet, broker)
    user_data = "#cloud-config\nhostname: cam-07\n"

    def boot(name: str, cloud: bool) -> Path:
        b = rpi_boot(tmp_path / name, firstrun=False)
        if cloud:
            (b / "user-data").write_text(user_data)
        return b

    # Detected: cloud-init's seed files win over cmdline.txt.
    auto = boot("auto", cloud=True)
    assert flash_dir(auto, plan).init == "cloud-init"
    assert (auto / "cmdline.txt").read_text() == CMDLINE and RUNCMD in (auto / "user-data").read_text()
    # --init firstrun on the same kind of partition: the firstrun hook, user-data left as it was.
    forced = boot("forced", cloud=True)
    assert flash_dir(forced, plan, init="firstrun").init == "firstrun"
    assert (forced / "cmdline.txt").read_text().count(CMDLINE_ENTRY) == 1 and (forced / "firstrun.sh").is_file()
    assert (forced / "user-data").read_text() == user_data
    # --init cloud-init where there is no user-data yet: written, with meta-data; cmdline.txt untouched.
    seeded = boot("seeded", cloud=False)
    assert flash_dir(seeded, plan, init="cloud-init").init == "cloud-init"
    assert yaml.safe_load((seeded / "user-data").read_text())["runcmd"] == [RUNCMD]
    assert (seeded / "meta-data").read_text() == "instance-id: fedge-rpi4-2gb-1\n"
    assert (seeded / "cmdline.txt").read_text() == CMDLINE
    # --init none: the payload only.
    bare = boot("bare", cloud=False)
    assert flash_dir(bare, plan, init="none").init == "none"
    assert sorted(p.name for p in bare.iterdir()) == ["cmdline.txt", "config.txt", "fedge"]
    assert (bare / "cmdline.txt").read_text() == CMDLINE
    # Another first-boot program on the kernel command line is not replaced silently.
    other = boot("other", cloud=False)
    (other / "cmdline.txt").write_text(CMDLINE.strip() + " systemd.run=/boot/firmware/setup.sh\n")
    with pytest.raises(ConfigError, match="already runs another first-boot program") as err:
        flash_dir(other, plan)
    assert "--init none" in (err.value.hint or "") and not (other / "fedge").exists()
    with pytest.raises(ConfigError, match="--init 'grub'"):
        flash_dir(bare, plan, init="grub")


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: apt-get install fdisk dosfstools mtools (.ci/run installs them)")


def make_image(path: Path, *, fat: bool = True) -> int:
    """A 40 MiB disk image: an MBR, a FAT boot partition at sector 8192 holding cmdline.txt and config.txt,
    and a Linux root partition. Returns the boot partition's byte offset."""
    with path.open("wb") as f:
        f.truncate(40 << 20)
    table = f"label: dos\nstart=8192, size=40960, type={'c' if fat else '83'}\nstart=49152, type=83\n"
    subprocess.run(["sfdisk", "-q", str(path)], input=table.encode(), check=True)
    offset = 8192 * 512
    if fat:
        subprocess.run(["mkfs.vfat", "--offset", "8192", "-n", "BOOTFS", str(path), "20480"],
                       check=True, capture_output=True)
        for name, text in (("cmdline.txt", CMDLINE), ("config.txt", CONFIG_TXT)):
            src = path.with_name(name)
            src.write_text(text)
            subprocess.run(["mcopy", "-i", f"{path}@@{offset}", str(src), f"::/{name}"], check=True,
                           env={**os.environ, "MTOOLS_SKIP_CHECK": "1"})
    return offset


def read_back(image: Path, offset: int, out: Path) -> Path:
    out.mkdir()
    env = {**os.environ, "MTOOLS_SKIP_CHECK": "1"}
    listing = subprocess.run(["mdir", "-b", "-i", f"{image}@@{offset}", "::/"], capture_output=True, text=True,
                             check=True, env=env).stdout.split()
    for entry in listing:
        subprocess.run(["mcopy", "-s", "-n", "-i", f"{image}@@{offset}", entry, str(out)], check=True, env=env)
    return out


def test_flash_image_edits_the_fat_partition_without_mounting(tmp_path: Path) -> None:
    _need("sfdisk", "mkfs.vfat", "mcopy")
    fleet, broker = fleet_and_broker(tmp_path)
    image = tmp_path / "rpios.img"
    offset = make_image(image)
    root_part = image.read_bytes()[49152 * 512:]
    plan = prepare("rpi4-2gb-1", fleet, broker)
    flash_image(image, plan)
    first = read_back(image, offset, tmp_path / "first")
    meta = check_payload(first, "rpi4-2gb-1")
    assert meta["init"] == "firstrun"
    assert (first / "cmdline.txt").read_text() == CMDLINE.strip() + " " + CMDLINE_ENTRY + "\n"
    assert (first / "config.txt").read_text() == CONFIG_TXT
    # The same payload bytes as a flash to a mounted boot partition.
    ref = rpi_boot(tmp_path / "ref", firstrun=False)
    flash_dir(ref, plan)
    got = {k: v[0] for k, v in tree(first).items()}
    assert got == {k: v[0] for k, v in tree(ref).items()}
    flash_image(image, prepare("rpi4-2gb-1", fleet, broker))
    second = read_back(image, offset, tmp_path / "second")
    assert {k: v[0] for k, v in tree(second).items()} == got
    assert (second / "cmdline.txt").read_text().count("systemd.run=") == 1
    assert image.read_bytes()[49152 * 512:] == root_part  # the root partition is untouched


def write_model(out: Path, **change: object) -> Path:
    """An exported model directory as `fedge export` writes it for rpi4-2gb-1 of the test fleet (tier-xs, the
    ten digit classes), with ``change`` applied to its manifest; the graph file is a stand-in of the size the
    manifest states (flash checks sizes; the runtime checks hashes when it loads the model)."""
    from fedge.common.preprocess import NORMALIZATION
    from fedge.runtime.manifest import FORMAT

    out.mkdir(parents=True, exist_ok=True)
    (out / "model.onnx").write_bytes(b"\x08\x07")
    manifest: dict[str, object] = {
        "format": FORMAT, "arch": "tier-xs", "quant": "fp32", "opset": 17, "input_shape": ["batch", 1, 32, 32],
        "normalization": {"dataset": "digits", **NORMALIZATION["digits"].to_dict()},
        "classes": [str(i) for i in range(10)], "files": {"model.onnx": {"sha256": "0" * 64, "bytes": 2}},
        "graphs": {"model": {"file": "model.onnx", "input": "x", "output": "y"}}, "profile": "rpi4-2gb"}
    manifest.update(change)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize(("change", "error"), [
    ({"profile": "rpi5-8gb"}, "was exported for profile 'rpi5-8gb', but rpi4-2gb-1 is a 'rpi4-2gb'"),
    ({"arch": "tier-s"}, "holds a tier-s model, but the fleet config gives rpi4-2gb-1 tier-xs"),
    ({"classes": ["cat", "dog"] + [str(i) for i in range(2, 10)]}, r"classifies \['cat', 'dog'"),
    ({"files": {"model.onnx": {"sha256": "0" * 64, "bytes": 3}}}, "model.onnx is missing or not 3 bytes"),
])
def test_a_model_exported_for_another_device_is_refused(tmp_path: Path, change: dict[str, object],
                                                        error: str) -> None:
    fleet, broker = fleet_and_broker(tmp_path)
    model = write_model(tmp_path / "m", **change)
    with pytest.raises(ExportError, match=error) as err:
        prepare("rpi4-2gb-1", fleet, broker, export_dir=model)
    assert str(model) in err.value.message and err.value.hint


def test_refusals_name_what_is_wrong(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fleet, broker = fleet_and_broker(tmp_path)
    with pytest.raises(ConfigError, match="has no device 'rpi4-2gb-9'"):
        prepare("rpi4-2gb-9", fleet, broker)
    with pytest.raises(ConfigError, match="does not exist") as err:
        prepare("rpi4-2gb-1", fleet, tmp_path / "nowhere")
    assert "fedge broker config" in (err.value.hint or "")
    # A profile whose training memory fits no model.
    tiny = tmp_path / "tiny.toml"
    tiny.write_text((REPO / "fedge/profiles/builtin/rpi4-2gb.toml").read_text()
                    .replace('name = "rpi4-2gb"', 'name = "tiny"').replace("train_memory_mb = 384",
                                                                          "train_memory_mb = 0.5"))
    small_fleet = tmp_path / "small.toml"
    small_fleet.write_text(fleet.read_text().replace('profile = "rpi4-2gb"', 'profile = "tiny.toml"'))
    with pytest.raises(ProfileError, match=r"tiny-1: profile 'tiny': no model tier fits") as err:
        prepare("tiny-1", small_fleet, broker)
    assert "budgets.train_memory_mb" in (err.value.hint or "")
    # A fleet config that pins a bigger model than the profile's memory holds (a simulation may; a board cannot).
    big = tmp_path / "big.toml"
    big.write_text(fleet.read_text().replace('arch = "tier-xs"', 'arch = "tier-xl"')
                   .replace('profile = "rpi4-2gb"', 'profile = "rpi-zero-2w"'))
    with pytest.raises(ProfileError, match=r"rpi-zero-2w-1: the fleet config has it train tier-xl at batch \d+, "
                                           r"which needs \d+ MiB .* grants 48 MiB"):
        prepare("rpi-zero-2w-1", big, broker)
    # fedge emulate lets it past the memory check (the twin shows the OOM kill) with a warning; the next
    # check stops it here (this broker has no bundle for the big fleet's device).
    with caplog.at_level(logging.WARNING, logger="fedge.flash.payload"), \
            pytest.raises(ConfigError, match="has no bundle for rpi-zero-2w-1"):
        prepare("rpi-zero-2w-1", big, broker, check_memory=False)
    assert "tier-xl at batch" in caplog.text and "flashed anyway" in caplog.text
    # A model exported for another profile; an export without this device.
    export = tmp_path / "export"
    write_model(export / "rpi4-2gb-1", profile="rpi5-8gb")
    with pytest.raises(ExportError, match="exported for profile 'rpi5-8gb'"):
        prepare("rpi4-2gb-1", fleet, broker, export_dir=export)
    with pytest.raises(ExportError, match=r"no exported model for rpi4-2gb-2 \(it has rpi4-2gb-1\)"):
        prepare("rpi4-2gb-2", fleet, broker, export_dir=export)
    write_model(export / "rpi4-2gb-1")
    plan = prepare("rpi4-2gb-1", fleet, broker, export_dir=export)
    assert [s.rel for s in plan.files if s.rel.startswith("model/")] == ["model/manifest.json", "model/model.onnx"]
    # Not a boot partition without --force; an image without a FAT partition.
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ConfigError, match="does not look like a boot partition"):
        flash_dir(plain, plan)
    assert flash_dir(plain, plan, force=True).init == "none" and (plain / "fedge" / "install.sh").is_file()
    # The Python entry point (what `fedge emulate` calls) writes the same payload as the command's path.
    again = tmp_path / "again"
    again.mkdir()
    assert flash("rpi4-2gb-1", fleet, broker, again, export=export, force=True).init == "none"
    assert tree(again / "fedge") == tree(plain / "fedge")
    _need("sfdisk")
    image = tmp_path / "linux.img"
    make_image(image, fat=False)
    with pytest.raises(ConfigError, match="no FAT partition") as err:
        flash_image(image, plan)
    assert "83" in err.value.message


def test_cli_dry_run_lists_every_file_and_writes_nothing(tmp_path: Path) -> None:
    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot")
    cmd = [sys.executable, "-m", "fedge", "flash", "rpi4-2gb-1", "--fleet", str(fleet), "--broker-dir", str(broker),
           "--to", str(boot)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert not (boot / "fedge").exists()
    real = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert real.returncode == 0 and real.stdout == dry.stdout
    rows = [line.split() for line in dry.stdout.splitlines()]
    assert {r[2]: int(r[1]) for r in rows} == {k: len(v[0]) for k, v in tree(boot).items() if k != "config.txt"}
    bad = subprocess.run([*cmd[:4], "nope-1", *cmd[5:]], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "has no device 'nope-1'" in bad.stderr
    # --init forces the hook the partition does not suggest (cmdline.txt alone means firstrun).
    cloud = subprocess.run([*cmd, "--init", "cloud-init", "--dry-run"], capture_output=True, text=True, env=env,
                           timeout=60)
    assert cloud.returncode == 0 and "first-boot hook: cloud-init" in cloud.stderr, cloud.stderr
    assert {r.split()[2] for r in cloud.stdout.splitlines()} >= {"user-data", "meta-data"}


def install(boot: Path, prefix: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["sh", str(boot / "fedge" / "install.sh"), "--prefix", str(prefix), "--venv",
                           str(Path(sys.executable).parent.parent), *extra], capture_output=True, text=True, env=env,
                          timeout=120)


def test_systemd_analyze_verifies_the_installed_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd)")
    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot")
    flash_dir(boot, prepare("rpi4-2gb-1", fleet, broker))
    prefix = tmp_path / "root"
    done = install(boot, prefix)
    assert done.returncode == 0, done.stderr
    unit = (prefix / "etc/systemd/system/fedge-edge.service").read_text()
    # Verify the unit as installed, with ExecStart pointing at the launcher under the scratch prefix.
    check = tmp_path / "verify" / "fedge-edge.service"
    check.parent.mkdir()
    launcher = f"ExecStart={prefix}/opt/fedge/bin/fedge-edge"
    check.write_text(unit.replace("ExecStart=/opt/fedge/bin/fedge-edge", launcher))
    proc = subprocess.run([analyze, "verify", str(check)], capture_output=True, text=True, timeout=60)
    version = int(re.search(r"systemd (\d+)", subprocess.run([analyze, "--version"], capture_output=True,
                                                             text=True).stdout).group(1))  # type: ignore[union-attr]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    if version < 254:  # the growing restart delay is newer than this systemd, which ignores those two keys
        lines = [ln for ln in lines if not re.search(r"Unknown key '?(RestartSteps|RestartMaxDelaySec)", ln)]
    assert proc.returncode == 0 and lines == [], proc.stderr


@pytest.mark.slow
def test_flashed_install_runs_an_agent_on_real_images_that_is_aggregated(tmp_path: Path, mosquitto_bin: str) -> None:
    """The proof: flash an image, read the payload back, install it into a scratch prefix, put real digit PNGs
    into its data folder, start the installed launcher; with a coordinator on a Mosquitto configured by
    `fedge broker config` (accounts, ACL) the device is aggregated in both training rounds."""
    _need("sfdisk", "mkfs.vfat", "mcopy")
    port = free_port()
    fleet, broker_dir = fleet_and_broker(tmp_path, port)
    image = tmp_path / "card.img"
    offset = make_image(image)
    flash_image(image, prepare("rpi4-2gb-2", fleet, broker_dir))
    boot = read_back(image, offset, tmp_path / "boot")
    prefix = tmp_path / "root"
    done = install(boot, prefix, "--no-systemd")
    assert done.returncode == 0, done.stderr
    assert "not reinstalling" in done.stdout
    first = tree(prefix)
    again = install(boot, prefix, "--no-systemd")  # idempotent: the same files, modes and bytes
    assert again.returncode == 0, again.stderr
    assert tree(prefix) == first
    pw = prefix / "etc/fedge/bundle/password"
    assert stat.S_IMODE(pw.stat().st_mode) == 0o600 and pw.read_bytes() == (boot / "fedge/bundle/password").read_bytes()
    assert not (prefix / "etc/systemd").exists()
    launcher = prefix / "opt/fedge/bin/fedge-edge"
    assert f'--data "{prefix}/var/lib/fedge/data"' in launcher.read_text()
    write_digit_pngs(prefix / "var/lib/fedge/data", 15)
    conf = (broker_dir / "mosquitto.conf").read_text()
    (tmp_path / "mosq").mkdir()
    broker = MosquittoProcess(conf, port=port, workdir=tmp_path / "mosq").start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    state = tmp_path / "state"
    coord = subprocess.Popen([sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(fleet), "--broker",
                              f"mqtt://127.0.0.1:{port}", "--username", "fedge-coordinator", "--password-file",
                              str(broker_dir / "coordinator" / "password"), "--state-dir", str(state),
                              "--min-devices", "1", "--quorum", "0.5", "--round-timeout", "0", "--deadline-slack", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    agent = None
    try:
        agent = subprocess.run([str(launcher)], capture_output=True, text=True, env=env, timeout=240)
        assert agent.returncode == 0, agent.stderr
        out, _ = coord.communicate(timeout=120)
        assert coord.returncode == 0, out.decode()
    finally:
        for p in (coord,):
            if p.poll() is None:
                p.kill()
        broker.close()
    assert "own data" in agent.stderr and "120 training and 30 local test images" in agent.stderr
    reports = [json.loads(line) for line in (state / "reports.jsonl").read_text().splitlines()]
    trained = [r for r in reports if r["round"] <= 2]
    assert [r["round"] for r in trained] == [1, 2]
    assert all(r["accepted"] == ["rpi4-2gb-2"] for r in trained)
    status = json.loads((prefix / "var/lib/fedge/status.json").read_text())
    assert (status["train"], status["test"], status["skipped"], status["error"]) == (120, 30, 0, None)


def test_flash_ssh_installs_on_a_running_device_over_a_real_sshd(tmp_path: Path, sshd: str) -> None:
    """--ssh against Debian's OpenSSH server on 127.0.0.1 (key auth, a free port): the payload is copied and
    install.sh runs there (into a scratch prefix, as the remote user)."""
    fleet, broker = fleet_and_broker(tmp_path)
    keys = tmp_path / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    port = free_port()
    (keys / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\n"
        f"PidFile {keys / 'sshd.pid'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    server = subprocess.Popen([sshd, "-D", "-e", "-f", str(keys / "sshd_config")], stderr=subprocess.PIPE)
    try:
        from fedge.mqtt.broker import wait_for_port

        wait_for_port("127.0.0.1", port, 10)
        prefix = tmp_path / "remote-root"
        from fedge.flash.remote import flash_ssh

        opts = [f"Port={port}", f"IdentityFile={keys / 'client'}", "StrictHostKeyChecking=no",
                "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]
        flash_ssh(f"{getpass.getuser()}@127.0.0.1", prepare("rpi4-2gb-1", fleet, broker), options=opts,
                  remote_dir=str(tmp_path / "remote-payload"),
                  install_args=["--prefix", str(prefix), "--no-systemd", "--venv",
                                str(Path(sys.executable).parents[1])])
    finally:
        server.terminate()
        server.wait(10)
    copied = tmp_path / "remote-payload" / "fedge"
    assert json.loads((copied / "payload.json").read_text())["init"] == "none"
    pw = prefix / "etc/fedge/bundle/password"
    assert pw.read_bytes() == (broker / "bundles/rpi4-2gb-1/password").read_bytes()
    assert stat.S_IMODE(pw.stat().st_mode) == 0o600
    assert (prefix / "opt/fedge/bin/fedge-edge").is_file()
    with pytest.raises(ConfigError, match="USER@HOST"):
        flash_ssh("no-user-here", prepare("rpi4-2gb-1", fleet, broker))


def test_wheelhouse_command_targets_the_profiles_cpu_and_python(tmp_path: Path) -> None:
    """--wheels is not run here (it downloads from PyPI); its pip command is checked instead."""
    from fedge.flash.wheels import device_requirements, download_command

    fleet, broker = fleet_and_broker(tmp_path)
    plan = prepare("rpi4-2gb-1", fleet, broker, python="3.13")
    cmd = download_command(plan.cpu_arch, plan.python, tmp_path / "w", device_requirements())
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms and all(p.endswith("_aarch64") for p in platforms)
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--python-version") + 1] == "3.13"
    assert cmd[cmd.index("--abi") + 1] == "cp313"
    assert {r.split(">")[0] for r in cmd[-7:]} == {"numpy", "safetensors", "paho-mqtt", "cryptography", "torch",
                                                   "onnxruntime", "pillow"}
    with pytest.raises(ConfigError, match=r"MAJOR\.MINOR"):
        download_command("aarch64", "311", tmp_path, [])


def test_a_benchmark_data_fleet_installs_what_rebuilding_its_share_needs(tmp_path: Path) -> None:
    """Without [data] classes a device rebuilds its share of the benchmark data set (digits: scikit-learn), so
    its payload installs fedge[sim], not fedge[device] (on which such a device could not start)."""
    from fedge.flash.wheels import device_requirements

    fleet, broker = fleet_and_broker(tmp_path)
    own = prepare("rpi4-2gb-1", fleet, broker)
    bench = tmp_path / "bench.toml"
    bench.write_text(re.sub(r"\[data\]\nclasses = \[[^]]*\]\n", "", fleet.read_text()))
    (broker / "bundles" / "rpi4-2gb-1" / "fleet.toml").write_bytes(bench.read_bytes())
    plan = prepare("rpi4-2gb-1", bench, broker)
    assert (own.install_extra, plan.install_extra) == ("device", "sim")
    boot = rpi_boot(tmp_path / "boot")
    flash_dir(boot, plan)
    assert json.loads((boot / "fedge" / "payload.json").read_text())["install_extra"] == "sim"
    script = (boot / "fedge" / "install.sh").read_text()
    assert "\nEXTRA=sim\n" in script and "\nOWN_DATA=0\n" in script and '"fedge[$EXTRA]==$VERSION"' in script
    assert "scikit-learn" in " ".join(device_requirements(plan.install_extra))
    cli = subprocess.run([sys.executable, "-m", "fedge", "flash", "rpi4-2gb-1", "--fleet", str(bench), "--broker-dir",
                          str(broker), "--to", str(boot), "--dry-run", "--wheels"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "has no [data] classes" in cli.stderr and "installs fedge[sim]" in cli.stderr
    assert "'scikit-learn>=" in cli.stderr  # the wheelhouse a dry run would download


def test_the_firstrun_hook_runs_the_previous_script_enables_the_install_and_removes_itself(tmp_path: Path) -> None:
    """The hook as the kernel command line starts it, against a scratch root (FEDGE_FIRSTRUN_ROOT)."""
    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot", firstrun=False)
    (boot / "firstrun.sh").write_text('#!/bin/bash\necho "$0" > "$(dirname "$0")/../previous-ran"\nexit 3\n')
    flash_dir(boot, prepare("rpi4-2gb-1", fleet, broker))
    root = tmp_path / "root"
    proc = subprocess.run(["sh", str(boot / "firstrun.sh")], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "FEDGE_FIRSTRUN_ROOT": str(root)})
    assert proc.returncode == 0, proc.stderr  # a failing earlier script must not stop the boot
    assert "exited with 3" in proc.stderr
    assert (boot / "previous-ran").read_text().strip() == str(boot / "fedge" / "firstrun.previous.sh")
    unit = root / "etc/systemd/system/fedge-install.service"
    assert f"ExecStart=/bin/sh {boot}/fedge/install.sh" in unit.read_text() and "@BOOT@" not in unit.read_text()
    link = root / "etc/systemd/system/multi-user.target.wants/fedge-install.service"
    assert link.resolve() == unit.resolve()
    assert not (boot / "firstrun.sh").exists()
    assert (boot / "cmdline.txt").read_text() == CMDLINE  # back to what Imager wrote
