"""``fedge emulate`` of a sharded fleet without a Docker engine: the compose project (a broker and a relay per
shard, each device on its shard's broker), the files behind it (the emulated ``[[shards]]``, the brokers'
accounts, each device's flashed bundle), the refusals before anything is written, and the status lines and
faults of the new services against a stand-in for the engine.

The fleet running in Docker is in test_emulate_docker.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from emulate_helpers import Client, Container

from fedge.broker.passwords import verify_password
from fedge.cli import main
from fedge.emulate import faults
from fedge.emulate.cli import format_status
from fedge.emulate.compose import RELAY_CPUS, RELAY_MEM_MB, Images, check_subnet
from fedge.emulate.emulation import Emulation
from fedge.emulate.lifecycle import prepare
from fedge.errors import ConfigError

TAGS = Images(device="d:1", coordinator="c:1", broker="b:1")
# Host rates given: no calibration (that times torch for seconds).
RATES = {(a, b): 2e9 for a in ("tier-xs", "tier-s", "tier-m", "tier-l", "tier-xl") for b in (8, 16, 32, 64)}

HEAD = """# a fleet of five, in three sites
[run]
method = "fedavg"
rounds = 1
dataset = "digits"
fleet = "t"

[[devices]]
profile = "rpi4-4gb"
count = 3

[[devices]]
profile = "rpi-zero-2w"
count = 2
"""



def toml_shards(*tables: dict[str, Any]) -> str:
    """``[[shards]]`` tables in TOML (the values written as JSON, which TOML reads alike)."""
    return "".join("\n[[shards]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items()) for t in tables)


ZEROS = ["rpi-zero-2w-*"]  # a pattern: the emulation lists the ids
# root <- a <- c, root <- b; the addresses are the real sites', which the emulation does not have
TREE = HEAD + toml_shards(
    {"name": "a", "broker": "mqtt://10.0.1.5:1883", "devices": ["rpi4-4gb-1", "rpi4-4gb-2"]},
    {"name": "b", "broker": "10.0.2.5:1883", "devices": ZEROS},
    {"name": "c", "broker": "mqtt://10.0.1.6:1883", "devices": ["rpi4-4gb-3"], "parent": "a"}) + """
[coordinator]
min_devices = 4
"""
CYCLE = HEAD + toml_shards({"name": "a", "broker": "10.0.1.5:1883", "devices": ["rpi4-4gb-*"], "parent": "b"},
                           {"name": "b", "broker": "10.0.1.6:1883", "devices": ZEROS, "parent": "a"})
STRANGER = HEAD + toml_shards({"name": "a", "broker": "10.0.1.5:1883", "devices": ["rpi4-4gb-*", "rpi4-4gb-9"]},
                              {"name": "b", "broker": "10.0.1.6:1883", "devices": ZEROS})
EVEN = HEAD + toml_shards({"broker": "10.0.1.5:1883", "devices": ["rpi4-4gb-*"]},
                          {"broker": "10.0.1.6:1883", "devices": ZEROS})


def _fleet(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return p


def _users(passwd: Path) -> set[str]:
    return {line.split(":", 1)[0] for line in passwd.read_text().splitlines() if line}


def _password_ok(passwd: Path, user: str, password: str) -> bool:
    line = next(x for x in passwd.read_text().splitlines() if x.startswith(f"{user}:"))
    return verify_password(password, line.split(":", 1)[1])


def test_a_shards_tree_becomes_a_broker_and_a_relay_per_shard_with_each_device_on_its_own(tmp_path: Path) -> None:
    emu = prepare(_fleet(tmp_path, TREE), tmp_path / "emu", images=TAGS, rates=RATES)
    out = tmp_path / "emu"
    doc = yaml.safe_load((out / "compose.yaml").read_text())
    services = doc["services"]
    assert list(services) == ["broker", "coordinator", "broker-a", "relay-a", "broker-b", "relay-b", "broker-c",
                              "relay-c", "rpi4-4gb-1", "rpi4-4gb-2", "rpi4-4gb-3", "rpi-zero-2w-1", "rpi-zero-2w-2"]
    assert all(s["networks"] == ["fleet"] for s in services.values()) and list(doc["networks"]) == ["fleet"]
    # every shard broker: Mosquitto on its own directory, mounted at the absolute path its config names
    for name in "abc":
        b = services[f"broker-{name}"]
        d = f"{out}/broker/shards/shard-{name}"
        assert b["image"] == "b:1" and b["command"] == ["-c", f"{d}/mosquitto.conf"]
        assert b["volumes"] == [f"./broker/shards/shard-{name}:{d}"]
        assert b["labels"] == {"io.fedge.role": "shard-broker", "io.fedge.shard": name}
        assert "listener 1883 0.0.0.0" in (out / "broker" / "shards" / f"shard-{name}" / "mosquitto.conf").read_text()
    # relays: fedge relay in the coordinator's image, between their shard's broker and their parent's
    for name, parent in (("a", "broker"), ("b", "broker"), ("c", "broker-a")):
        r = services[f"relay-{name}"]
        assert r["image"] == "c:1" and r["entrypoint"] == ["/opt/fedge/venv/bin/fedge", "relay"]
        assert r["command"] == ["--config", "/fedge/fleet.toml", "--name", f"relay-{name}", "--username",
                                f"relay-{name}", "--password-file", "/fedge/relay/password", "--broker",
                                f"mqtt://{parent}:1883", "--shard", f"mqtt://broker-{name}:1883", "--state-dir",
                                "/fedge/state", "--detail"]
        assert r["volumes"] == ["./fleet.toml:/fedge/fleet.toml:ro",
                                f"./broker/relays/relay-{name}:/fedge/relay:ro", f"./relays/relay-{name}:/fedge/state"]
        assert r["depends_on"] == [f"broker-{name}", parent]
        assert (r["cpus"], r["mem_limit"], r["memswap_limit"]) == (RELAY_CPUS, f"{RELAY_MEM_MB}m", f"{RELAY_MEM_MB}m")
        assert (out / "relays" / f"relay-{name}").is_dir()  # its state directory, mounted
    # the coordinator on the root broker, as in a flat emulation
    coord = services["coordinator"]
    assert coord["command"][coord["command"].index("--broker") + 1] == "mqtt://broker:1883"
    assert coord["depends_on"] == ["broker"]
    home = {"rpi4-4gb-1": "a", "rpi4-4gb-2": "a", "rpi4-4gb-3": "c", "rpi-zero-2w-1": "b", "rpi-zero-2w-2": "b"}
    root_users = _users(out / "broker" / "passwd")
    assert root_users == {"fedge-coordinator", "fedge-deploy", "relay-a", "relay-b"}  # no device, no relay-c
    for dev, shard in home.items():
        svc = services[dev]
        assert svc["depends_on"] == [f"broker-{shard}"]
        lim = emu.limits[dev]
        assert (svc["cpu_period"], svc["cpu_quota"]) == (lim["cpu_period_us"], lim["cpu_quota_us"])
        assert svc["mem_limit"] == f"{emu.limits[dev]['mem_limit_mb']}m"
        # the flashed bundle names its shard's container, and its password is good there and nowhere else
        bundle = out / "devices" / dev / "fedge" / "bundle"
        assert tomllib.loads((bundle / "bundle.toml").read_text())["broker"] == f"mqtt://broker-{shard}:1883"
        password = (bundle / "password").read_text().strip()
        for other in "abc":
            passwd = out / "broker" / "shards" / f"shard-{other}" / "passwd"
            assert (dev in _users(passwd)) == (other == shard), (dev, other)
        assert _password_ok(out / "broker" / "shards" / f"shard-{shard}" / "passwd", dev, password)
    # each relay's one password: its account on its shard and on its parent's broker
    for name, parent_passwd in (("a", "passwd"), ("b", "passwd"), ("c", "shards/shard-a/passwd")):
        password = (out / "broker" / "relays" / f"relay-{name}" / "password").read_text().strip()
        assert _password_ok(out / "broker" / "shards" / f"shard-{name}" / "passwd", f"relay-{name}", password)
        assert _password_ok(out / "broker" / parent_passwd, f"relay-{name}", password)
    # the emulation's fleet.toml: the same config, the shards at their containers, every device by id
    text = (out / "fleet.toml").read_text()
    assert text.startswith("# a fleet of five, in three sites\n")
    written, original = tomllib.loads(text), tomllib.loads(TREE)
    assert written.pop("shards") == [
        {"name": "a", "broker": "mqtt://broker-a:1883", "devices": ["rpi4-4gb-1", "rpi4-4gb-2"]},
        {"name": "b", "broker": "mqtt://broker-b:1883", "devices": ["rpi-zero-2w-1", "rpi-zero-2w-2"]},
        {"name": "c", "broker": "mqtt://broker-c:1883", "devices": ["rpi4-4gb-3"], "parent": "a"}]
    original.pop("shards")
    assert written == original
    # ... and the bundles carry that file (fedge flash checked each bundle's broker against its shard there)
    assert (out / "devices" / "rpi4-4gb-3" / "fedge" / "bundle" / "fleet.toml").read_text() == text
    saved = json.loads((out / "emulation.json").read_text())["shards"]
    assert saved == Emulation.load(out).shards == [
        {"name": "a", "parent": None, "broker": "broker-a", "relay": "relay-a", "up": "broker",
         "devices": ["rpi4-4gb-1", "rpi4-4gb-2"]},
        {"name": "b", "parent": None, "broker": "broker-b", "relay": "relay-b", "up": "broker",
         "devices": ["rpi-zero-2w-1", "rpi-zero-2w-2"]},
        {"name": "c", "parent": "a", "broker": "broker-c", "relay": "relay-c", "up": "broker-a",
         "devices": ["rpi4-4gb-3"]}]
    assert emu.services == ["broker", "coordinator", "broker-a", "relay-a", "broker-b", "relay-b", "broker-c",
                            "relay-c", *home]
    exe = shutil.which("docker-compose")
    if exe is not None:  # the file is one compose accepts, with every service
        proc = subprocess.run([exe, "-f", str(out / "compose.yaml"), "config"], capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        assert set(yaml.safe_load(proc.stdout)["services"]) == set(services)


def test_shards_n_splits_a_flat_fleet_and_a_second_up_starts_afresh(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, HEAD)
    emu = prepare(fleet, tmp_path / "emu", images=TAGS, rates=RATES, shards=2)
    out = tmp_path / "emu"
    assert [(s["name"], s["devices"], s["up"]) for s in emu.shards] == [
        ("1", ["rpi4-4gb-1", "rpi4-4gb-2", "rpi4-4gb-3"], "broker"),
        ("2", ["rpi-zero-2w-1", "rpi-zero-2w-2"], "broker")]
    services = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    assert services["rpi-zero-2w-2"]["depends_on"] == ["broker-2"]
    assert services["relay-2"]["command"][services["relay-2"]["command"].index("--broker") + 1] == "mqtt://broker:1883"
    assert tomllib.loads((out / "fleet.toml").read_text())["shards"][1] == {
        "name": "2", "broker": "mqtt://broker-2:1883", "devices": ["rpi-zero-2w-1", "rpi-zero-2w-2"]}
    # a previous run's retained messages and relay state would resume it: gone on the next `up`
    (out / "broker" / "shards" / "shard-1" / "data" / "mosquitto.db").write_text("old")
    (out / "relays" / "relay-1" / "rounds.jsonl").write_text("old\n")
    password = (out / "broker" / "relays" / "relay-1" / "password").read_text()
    prepare(fleet, tmp_path / "emu", images=TAGS, rates=RATES, shards=2)
    assert not (out / "broker" / "shards" / "shard-1" / "data" / "mosquitto.db").exists()
    assert list((out / "relays" / "relay-1").iterdir()) == []
    assert (out / "broker" / "relays" / "relay-1" / "password").read_text() == password  # accounts are kept
    # a signing fleet: the root's key signs (the coordinator's copy), every device verifies with its public half
    prepare(fleet, tmp_path / "emu", images=TAGS, rates=RATES, shards=2, sign=True)
    pub = (out / "broker" / "coordinator" / "fleet.pub").read_bytes()
    assert (out / "coordinator" / "signing.key").read_bytes() == \
        (out / "broker" / "coordinator" / "signing.key").read_bytes()
    assert all((out / "devices" / d / "fedge" / "bundle" / "fleet.pub").read_bytes() == pub for d in emu.devices)
    # and without --shards the same directory is a flat emulation again
    flat = prepare(fleet, tmp_path / "emu", images=TAGS, rates=RATES)
    assert flat.shards == [] and "shards" not in tomllib.loads((out / "fleet.toml").read_text())
    assert set(yaml.safe_load((out / "compose.yaml").read_text())["services"]) == {"broker", "coordinator",
                                                                                  *flat.devices}


@pytest.mark.parametrize(("text", "shards", "message", "hint"), [
    (HEAD, 6, "--shards 6 is more than the fleet's 5 devices", "at most one shard per device"),
    (HEAD, 0, "--shards 0 must be at least 1", "leave --shards out"),
    (EVEN, 2, "--shards 2 and the [[shards]] tables of", "drop --shards"),
    (CYCLE, None, "[[shards]] parents form a cycle of relays: a -> b -> a", "remove parent from one of these shards"),
    (STRANGER, None, "[[shards]] #1 ('a'): devices entry 'rpi4-4gb-9' matches no device of the fleet",
     "did you mean 'rpi4-4gb-3'?"),
    (HEAD.replace('"fedavg"', '"fedvtc"'), 2, "--shards 2: method 'fedvtc' cannot aggregate in parts",
     "emulate it without shards"),
    (HEAD + '\n[coordinator]\nmode = "async"\n', 2, '[coordinator] mode = "async" cannot run with --shards 2',
     "drop mode"),
    # shard "1"'s broker runs as the container broker-1: a device of that name would be its twin
    (HEAD.replace('profile = "rpi-zero-2w"', 'profile = "rpi-zero-2w"\nid_prefix = "broker"'), 1,
     "--shards 1: shard '1''s broker runs as the container 'broker-1', the name of device 'broker-1'",
     "rename the shard"),
    (HEAD.replace('profile = "rpi-zero-2w"', 'profile = "rpi-zero-2w"\nid_prefix = "relay"'), 2,
     "--shards 2: shard '1''s relay runs as the container 'relay-1', the name of device 'relay-1'", "id_prefix"),
])
def test_a_shard_layout_that_does_not_fit_is_refused_before_anything_is_written(
        tmp_path: Path, text: str, shards: int | None, message: str, hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        prepare(_fleet(tmp_path, text), tmp_path / "emu", images=TAGS, rates=RATES, shards=shards)
    assert message in err.value.message and hint in (err.value.hint or ""), (err.value.message, err.value.hint)
    assert not (tmp_path / "emu").exists()


def test_up_refuses_a_bad_layout_before_building_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.emulate import discovery, images

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the engine was asked for before the shards were checked")

    monkeypatch.setattr(discovery, "docker_client", no_engine)
    monkeypatch.setattr(images, "ensure_images", no_engine)
    code = main(["emulate", "up", str(_fleet(tmp_path, HEAD)), "--out", str(tmp_path / "emu"), "--shards", "9"])
    err = capsys.readouterr().err
    assert code == ConfigError.exit_code
    assert "--shards 9 is more than the fleet's 5 devices" in err and "at most one shard per device" in err
    assert not (tmp_path / "emu").exists()


def test_the_subnet_must_hold_the_shards_brokers_and_relays_too() -> None:
    assert check_subnet("10.9.9.0/29", devices=2) == "10.9.9.0/29"  # 6 addresses: 2 devices + 3
    with pytest.raises(ConfigError, match=r"has 6 host addresses; the emulation needs 7 \(2 devices, broker, "
                                          r"coordinator, 1 shard brokers and relays, gateway\)"):
        check_subnet("10.9.9.0/29", devices=2, shards=1)


def test_status_and_faults_address_the_shards_brokers_and_relays(tmp_path: Path) -> None:
    emu = prepare(_fleet(tmp_path, HEAD), tmp_path / "emu", images=TAGS, rates=RATES, shards=2)
    cs = {svc: Container("exited" if svc == "relay-2" else "running", 137, project=emu.project, service=svc)
          for svc in emu.services}
    client = Client(*cs.values(), project=emu.project)
    text = format_status([], emu, client)
    assert text.splitlines()[1:3] == [
        "shard 1: broker-1: running   relay-1: running (up to broker)   devices: rpi4-4gb-1, rpi4-4gb-2, rpi4-4gb-3",
        "shard 2: broker-2: running   relay-2: exited (137) (up to broker)   devices: rpi-zero-2w-1, rpi-zero-2w-2"]
    assert faults.fault(emu, client, "kill", "relay-1") == "killed relay-1"
    assert faults.fault(emu, client, "resume", "relay-1") == "started relay-1 again"
    assert faults.fault(emu, client, "restart", "broker-2") == "restarted broker-2"
    assert faults.fault(emu, client, "restart", "relay-2") == "restarted relay-2"
    # a partitioned relay comes back under its service name (its brokers' clients find it by it), unshaped:
    # only devices have a shaped link
    assert faults.fault(emu, client, "partition", "relay-1") == "cut relay-1 off the fleet network"
    assert faults.fault(emu, client, "resume", "relay-1") == "resumed relay-1: reconnected to the fleet network"
    assert client.net.aliases == [["relay-1"]]
    assert cs["relay-1"].calls == ["kill", "start"] and cs["broker-2"].calls == ["restart"]
    assert cs["relay-2"].calls == ["restart"]
    faults.fault(emu, client, "partition", "rpi4-4gb-1", duration=0)  # a device is shaped again
    assert cs["rpi4-4gb-1"].calls == ["exec /bin/sh /usr/local/bin/fedge-shape-link"]
    with pytest.raises(ConfigError) as err:
        faults.fault(emu, client, "restart", "relay-3")
    assert err.value.message == "fault restart takes broker, coordinator, a shard broker or a relay, not 'relay-3'"
    assert "shard brokers and relays: broker-1, relay-1, broker-2, relay-2" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="'broker-9' is not a device, shard broker or relay of this emulation"):
        faults.fault(emu, client, "kill", "broker-9")
    assert "relay-2" in emu.services and emu.container(client, "relay-2") is cs["relay-2"]
