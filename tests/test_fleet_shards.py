"""``[[shards]]`` in the fleet config: parsed and checked at load, written by ``fedge broker config``, flashed.

Each malformed layout is refused when the fleet config loads, with an error naming the key and a hint with
the fix: overlapping devices, a shard without a broker, a cycle of relays, an unknown parent, a device of
the fleet in no shard (refused: a sharded fleet's root broker has no device accounts), a pattern matching
no device, two shards on one broker. A good layout (a tree of depth 2) is written as one broker per shard
whose passwd and ACL hold the right accounts and lines, and ``fedge flash`` puts each device's shard
address in its payload. (Over real Mosquittos: ``tests/test_scaleout_shards.py``.)
"""

from __future__ import annotations

import getpass
import re
import tomllib
from pathlib import Path

import pytest

from fedge.broker.config import BrokerOptions
from fedge.broker.shards import write_sharded_config
from fedge.errors import ConfigError
from fedge.fleet.config import device_ids, load_fleet
from fedge.fleet.shards import depth, even_shards, reporters, subtree

HEAD = """
[run]
method = "fedproto"
rounds = 2
dataset = "digits"
fleet = "tree"

[[devices]]
profile = "rpi-zero-2w"
count = 2

[[devices]]
profile = "rpi4-4gb"
count = 2

[[devices]]
profile = "x86-gateway"
count = 2
"""

# a tree of depth 2: root <- a <- c, root <- b
TREE = """
[[shards]]
name = "a"
broker = "mqtt://127.0.0.1:{pa}"
devices = ["rpi4-4gb-*"]

[[shards]]
name = "b"
broker = "127.0.0.1:{pb}"
devices = ["x86-gateway-1", "x86-gateway-2"]

[[shards]]
name = "c"
broker = "mqtt://127.0.0.1:{pc}"
devices = ["rpi-zero-2w-*"]
parent = "a"
"""


def fleet(tmp: Path, shards: str, name: str = "fleet") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(HEAD + shards)
    return path


def refused(tmp: Path, shards: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_fleet(fleet(tmp, shards))
    return err.value


def test_a_tree_loads_in_fleet_order_with_its_parents(tmp_path: Path) -> None:
    cfg = load_fleet(fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003)))
    a, b, c = cfg.shard_layout
    assert (a.name, a.host, a.port, a.devices, a.parent) == ("a", "127.0.0.1", 2001, ("rpi4-4gb-1", "rpi4-4gb-2"), None)
    assert (b.scheme, b.port, b.devices) == (None, 2002, ("x86-gateway-1", "x86-gateway-2"))
    assert (c.parent, c.relay, c.dirname) == ("a", "relay-c", "shard-c")
    assert subtree(cfg.shard_layout, "a") == ["rpi4-4gb-1", "rpi4-4gb-2", "rpi-zero-2w-1", "rpi-zero-2w-2"]
    assert depth(cfg.shard_layout) == 2
    assert load_fleet(fleet(tmp_path, "")).shard_layout == []
    # what each parent lets its relays report (PartialMerger.allowed: the coordinator's, relay-a's)
    assert reporters(cfg.shard_layout) == {"relay-a": frozenset(subtree(cfg.shard_layout, "a")),
                                           "relay-b": frozenset({"x86-gateway-1", "x86-gateway-2"})}
    assert reporters(cfg.shard_layout, "a") == {"relay-c": frozenset({"rpi-zero-2w-1", "rpi-zero-2w-2"})}


def test_overlapping_devices_are_refused_naming_the_device_and_both_shards(tmp_path: Path) -> None:
    err = refused(tmp_path, TREE.format(pa=1, pb=2, pc=3).replace('["x86-gateway-1", "x86-gateway-2"]',
                                                                  '["x86-gateway-*", "rpi4-4gb-2"]'))
    assert "[[shards]] #2 ('b')" in err.message and "'rpi4-4gb-2'" in err.message and "shard 'a'" in err.message
    assert "remove it from one of the two shards' devices" in (err.hint or "")


def test_a_shard_without_a_broker_is_refused(tmp_path: Path) -> None:
    err = refused(tmp_path, TREE.format(pa=1, pb=2, pc=3).replace('broker = "127.0.0.1:2"\n', ""))
    assert "[[shards]] #2 ('b') has no broker" in err.message
    assert 'add broker = "mqtt://HOST:PORT"' in (err.hint or "")
    err = refused(tmp_path, TREE.format(pa=1, pb=2, pc=3).replace('"127.0.0.1:2"', '"amqp://h:5"'))
    assert "scheme 'amqp'" in err.message and "mqtt://HOST:PORT" in (err.hint or "")


def test_a_cycle_of_relays_is_refused_naming_the_cycle(tmp_path: Path) -> None:
    text = TREE.format(pa=1, pb=2, pc=3).replace('devices = ["rpi4-4gb-*"]', 'devices = ["rpi4-4gb-*"]\nparent = "c"')
    err = refused(tmp_path, text)
    assert "cycle of relays: a -> c -> a" in err.message
    assert "remove parent from one of these shards (a, c)" in (err.hint or "")
    err = refused(tmp_path, TREE.format(pa=1, pb=2, pc=3).replace('parent = "a"', 'parent = "c"'))
    assert "parent = 'c' is the shard itself" in err.message


def test_an_unknown_parent_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    err = refused(tmp_path, TREE.format(pa=1, pb=2, pc=3).replace('parent = "a"', 'parent = "b2"'))
    assert "#3 ('c'): parent = 'b2' names no shard" in err.message and "did you mean 'b'?" in (err.hint or "")


def test_a_device_in_no_shard_is_refused(tmp_path: Path) -> None:
    err = refused(tmp_path, TREE.format(pa=1, pb=2, pc=3).replace('"x86-gateway-1", ', ""))
    assert "1 device(s) of the fleet are in no shard (x86-gateway-1)" in err.message
    assert "add them to a shard's devices" in (err.hint or "")


def test_other_mistakes_are_refused_at_load(tmp_path: Path) -> None:
    base = TREE.format(pa=1, pb=2, pc=3)
    err = refused(tmp_path, base.replace('"x86-gateway-1"', '"x86-gateway-9"'))
    assert "devices entry 'x86-gateway-9' matches no device" in err.message and "x86-gateway-" in (err.hint or "")
    err = refused(tmp_path, base.replace(":2", ":1"))  # shards a and b on one broker
    assert "is also [[shards]] #1's" in err.message and "a broker of its own" in (err.hint or "")
    err = refused(tmp_path, base.replace('name = "b"', 'name = "a"'))
    assert "name = 'a' is used by [[shards]] #1 too" in err.message
    err = refused(tmp_path, base.replace('name = "b"', 'name = "b/../x"'))
    assert "may hold only letters" in err.message
    err = refused(tmp_path, base.replace('"127.0.0.1:2"', '"mqtt://u:pw@h:2"'))
    assert "only a scheme, a host and a port" in err.message
    err = refused(tmp_path, base.replace('devices = ["x86-gateway-1", "x86-gateway-2"]', "devices = []")
                  .replace('devices = ["rpi-zero-2w-*"]', 'devices = ["rpi-zero-2w-*", "x86-gateway-*"]'))
    assert "#2 ('b') has no devices and no child shards" in err.message
    # a shard without devices of its own that is a parent: a regional level of relays
    regional = load_fleet(fleet(tmp_path, base.replace('devices = ["rpi4-4gb-*"]', "devices = []").replace(
        'devices = ["rpi-zero-2w-*"]', 'devices = ["rpi-zero-2w-*", "rpi4-4gb-*"]'), "regional"))
    assert regional.shard_layout[0].devices == () and depth(regional.shard_layout) == 2
    err = refused(tmp_path, base.replace("parent =", "parnet ="))
    assert "unknown key 'parnet'" in err.message and "did you mean 'parent'?" in (err.hint or "")


def test_shards_n_is_the_even_shorthand(tmp_path: Path) -> None:
    ids = [f"d{i}" for i in range(5)]
    layout = even_shards(ids, 2, "h", 1883)
    assert [(s.name, s.port, s.devices, s.parent) for s in layout] == [
        ("1", 1884, ("d0", "d1", "d2"), None), ("2", 1885, ("d3", "d4"), None)]
    assert [s.relay for s in layout] == ["relay-1", "relay-2"]
    with pytest.raises(ConfigError, match="runs past port 65535"):
        even_shards(ids, 2, "h", 65534)


def _acl_users(text: str) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("user "):
            cur = line.split()[1]
            users.setdefault(cur, [])
        elif line.startswith("topic ") and cur is not None:
            users[cur].append(line)
    return users


def test_broker_config_writes_each_shard_its_accounts_and_acls(tmp_path: Path) -> None:
    path = fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003))
    cfg = load_fleet(path)
    ids = [i for i, _ in device_ids(cfg)]
    out = tmp_path / "broker"
    files = write_sharded_config(cfg.run.fleet, ids, out, BrokerOptions(port=2000, bind="127.0.0.1",
                                                                        hostname="127.0.0.1", iterations=10),
                                 shards=cfg.shard_layout, workers=1, fleet_config=path)
    accounts = {p: {ln.split(":")[0] for ln in (out / p / "passwd").read_text().splitlines()}
                for p in (".", "shards/shard-a", "shards/shard-b", "shards/shard-c")}
    # the root: the coordinator, deploy, the relays whose parent is the root, the worker; no device
    assert accounts["."] == {"fedge-coordinator", "fedge-deploy", "relay-a", "relay-b", "worker-1"}
    # shard a: its relay (the shard's coordinator), its devices, and its child shard c's relay
    assert accounts["shards/shard-a"] == {"relay-a", "fedge-deploy", "rpi4-4gb-1", "rpi4-4gb-2", "relay-c"}
    assert accounts["shards/shard-c"] == {"relay-c", "fedge-deploy", "rpi-zero-2w-1", "rpi-zero-2w-2"}
    root_acl = _acl_users((out / "acl").read_text())
    # relay-a forwards the hellos of its own devices and of shard c's; relay-b only its own
    hellos = {u: sorted(re.findall(r"topic write fedge/tree/devices/([^/]+)/hello", "\n".join(lines)))
              for u, lines in root_acl.items()}
    assert hellos["relay-a"] == ["rpi-zero-2w-1", "rpi-zero-2w-2", "rpi4-4gb-1", "rpi4-4gb-2"]
    assert hellos["relay-b"] == ["x86-gateway-1", "x86-gateway-2"]
    a_acl = _acl_users((out / "shards/shard-a/acl").read_text())
    assert "topic write fedge/tree/partials/relay-c" in a_acl["relay-c"]
    assert "topic write fedge/tree/devices/rpi-zero-2w-1/hello" in a_acl["relay-c"]
    assert not any("rpi4-4gb" in line for line in a_acl["relay-c"])
    # every broker listens where [[shards]] says; every bundle names its shard's broker
    for name, port in (("a", 2001), ("b", 2002), ("c", 2003)):
        assert f"listener {port} 127.0.0.1" in (out / f"shards/shard-{name}/mosquitto.conf").read_text()
    brokers = {d: tomllib.loads((out / "bundles" / d / "bundle.toml").read_text())["broker"] for d in ids}
    assert brokers["rpi4-4gb-1"] == "mqtt://127.0.0.1:2001" and brokers["x86-gateway-2"] == "mqtt://127.0.0.1:2002"
    assert brokers["rpi-zero-2w-1"] == "mqtt://127.0.0.1:2003"
    assert [s.name for s in files.layout] == ["a", "b", "c"] and files.relays == ["relay-a", "relay-b", "relay-c"]
    # a relay's password is the same on its shard and its parent (one account)
    pw = (out / "relays/relay-c/password").read_text()
    assert (out / "shards/shard-c/coordinator/password").read_text() == pw


def test_broker_config_refusals(tmp_path: Path) -> None:
    path = fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003))
    cfg = load_fleet(path)
    ids = [i for i, _ in device_ids(cfg)]
    with pytest.raises(ConfigError, match=r"--mtls cannot be combined with --shards, \[\[shards\]\] or --workers"):
        write_sharded_config(cfg.run.fleet, ids, tmp_path / "m", BrokerOptions(mtls=True), shards=cfg.shard_layout)
    with pytest.raises(ConfigError, match=r"broker 127.0.0.1:2001 is the root broker's address") as err:
        write_sharded_config(cfg.run.fleet, ids, tmp_path / "p", BrokerOptions(port=2001, hostname="127.0.0.1"),
                             shards=cfg.shard_layout)
    assert "another port" in (err.value.hint or "")
    tls = load_fleet(fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003).replace("mqtt://", "mqtts://"), "tls"))
    with pytest.raises(ConfigError, match=r"'a': broker is mqtts://127.0.0.1:2001 but the brokers are written "
                                          r"without TLS") as err:
        write_sharded_config(cfg.run.fleet, ids, tmp_path / "t", BrokerOptions(port=2000), shards=tls.shard_layout)
    assert "pass --tls" in (err.value.hint or "")


def test_the_command_refuses_shards_twice_and_mtls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    path = fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003))
    assert main(["broker", "config", "--fleet", str(path), "--out", str(tmp_path / "x"), "--shards", "2"]) != 0
    err = capsys.readouterr().err
    assert "--shards 2 and the [[shards]] tables" in err and "drop --shards" in err
    assert main(["broker", "config", "--fleet", str(path), "--out", str(tmp_path / "y"), "--mtls"]) != 0
    assert "--mtls cannot be combined" in capsys.readouterr().err
    flat = fleet(tmp_path, "", "flat")
    assert main(["broker", "config", "--fleet", str(flat), "--out", str(tmp_path / "z"), "--mtls", "--workers",
                 "2"]) != 0
    assert "--mtls cannot be combined" in capsys.readouterr().err
    asynchronous = fleet(tmp_path, '[coordinator]\nmode = "async"\n' + TREE.format(pa=2001, pb=2002, pc=2003), "async")
    assert main(["broker", "config", "--fleet", str(asynchronous), "--out", str(tmp_path / "a")]) != 0
    assert 'mode = "async" cannot run with [[shards]]' in capsys.readouterr().err
    assert main(["broker", "config", "--fleet", str(path), "--out", str(tmp_path / "ok"), "--port", "2000",
                 "--hostname", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert "shard c: mosquitto -c" in out and "under shard a" in out
    assert re.search(r"--name relay-c .* --broker mqtt://127.0.0.1:2001 --shard mqtt://127.0.0.1:2003", out), out


def test_flash_puts_the_shard_address_in_the_payload_and_refuses_a_stale_bundle(tmp_path: Path) -> None:
    from fedge.flash.payload import prepare

    path = fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003))
    cfg = load_fleet(path)
    out = tmp_path / "broker"
    write_sharded_config(cfg.run.fleet, [i for i, _ in device_ids(cfg)], out,
                         BrokerOptions(port=2000, hostname="127.0.0.1", run_as=getpass.getuser(), iterations=10),
                         shards=cfg.shard_layout, fleet_config=path)
    plan = prepare("rpi-zero-2w-2", path, out)
    assert plan.broker == "mqtt://127.0.0.1:2003"
    bundle = next(f for f in plan.files if f.rel == "bundle/bundle.toml")
    assert 'broker = "mqtt://127.0.0.1:2003"' in bundle.data().decode()
    # a bundle whose broker is not its shard's (written by hand, or before the shard moved) is refused
    btoml = out / "bundles" / "rpi-zero-2w-2" / "bundle.toml"
    btoml.write_text(btoml.read_text().replace(":2003", ":2001"))
    with pytest.raises(ConfigError, match=r"names broker 'mqtt://127.0.0.1:2001', but \[\[shards\]\] puts "
                                          r"rpi-zero-2w-2 on shard 'c' at 127.0.0.1:2003"):
        prepare("rpi-zero-2w-2", path, out)


def test_fedge_relay_finds_its_shard_in_the_fleet_config(tmp_path: Path) -> None:
    import argparse

    from fedge.coordinator.cli import shard_url
    from fedge.mqtt.client import parse_broker_url

    cfg = load_fleet(fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003)))

    def url(name: str, broker: str, shard: str | None = None) -> str:
        return shard_url(argparse.Namespace(shard=shard), cfg, name, parse_broker_url(broker))

    assert url("relay-c", "mqtt://127.0.0.1:2001") == "mqtt://127.0.0.1:2003"  # under shard a
    assert url("relay-b", "mqtt://127.0.0.1:2000") == "mqtt://127.0.0.1:2002"  # under the root
    assert url("relay-b", "mqtts://127.0.0.1:2000") == "mqtts://127.0.0.1:2002"  # HOST:PORT takes the TLS
    assert url("relay-b", "mqtt://127.0.0.1:2000", shard="mqtt://h:9") == "mqtt://h:9"  # --shard wins
    with pytest.raises(ConfigError, match=r"'c' reports to shard 'a' at 127.0.0.1:2001, but --broker is "
                                          r"mqtt://127.0.0.1:2000") as err:
        url("relay-c", "mqtt://127.0.0.1:2000")
    assert "pass --broker mqtt://127.0.0.1:2001" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="relay 'relay-x' needs --shard") as err:
        url("relay-x", "mqtt://127.0.0.1:2000")
    assert "--name relay-NAME" in (err.value.hint or "")
