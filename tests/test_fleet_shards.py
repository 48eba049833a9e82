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
    # what each parent lets its relays report (EngineConfig.partial_reporters: the coordinator's, relay-a's)
    assert reporters(cfg.shard_layout) == {"relay-a": frozenset(subtree(cfg.shard_layout, "a")),
                                           "relay-b": frozenset({"x86-gateway-1", "x86-gateway-2"})}
    assert reporters(cfg.shard_layout, "a") == {"relay-c": frozenset({"rpi-zero-2w-1", "rpi-zero-2w-2"})}


def test_the_one_factory_gives_each_parent_the_relays_it_hears(tmp_path: Path) -> None:
    """engine_parts sets EngineConfig.partial_reporters: the root (``fedge coordinator run`` without --workers)
    hears relay-a and relay-b, relay-a hears relay-c, each for its own subtree; with workers, or without
    [[shards]], any account is heard. The engine's and a relay's merger read it from there."""
    import argparse

    from fedge.common.inmemory import InMemoryBus, InMemoryCoordinatorTransport
    from fedge.coordinator.engine import RoundEngine
    from fedge.coordinator.fromfleet import engine_parts
    from fedge.scaleout.aggregator import PartialAggregator

    cfg = load_fleet(fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003)))
    flags = argparse.Namespace()
    root, strat = engine_parts(flags, cfg, any_device=False, relays_report=True)
    assert root.partial_reporters == reporters(cfg.shard_layout) and set(root.partial_reporters) == {"relay-a",
                                                                                                     "relay-b"}
    assert RoundEngine(strat, InMemoryCoordinatorTransport(InMemoryBus()), root).partials.allowed == \
        root.partial_reporters
    relay_a, strat_a = engine_parts(flags, cfg, any_device=False, relays_report=True, shard="a")
    assert relay_a.partial_reporters == {"relay-c": frozenset({"rpi-zero-2w-1", "rpi-zero-2w-2"})}
    assert PartialAggregator(strat_a, relay_a, "relay-a").merger.allowed == relay_a.partial_reporters
    workers, _ = engine_parts(flags, cfg, any_device=False)
    assert workers.partial_reporters is None
    flat, _ = engine_parts(flags, load_fleet(fleet(tmp_path, "")), any_device=False, relays_report=True)
    assert flat.partial_reporters is None


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
    # mutual TLS with shards whose brokers are written plain mqtt:// (no TLS, hence no certificate)
    with pytest.raises(ConfigError, match=r"'a': broker is mqtt://127.0.0.1:2001 but the brokers are written "
                                          r"with TLS") as err:
        write_sharded_config(cfg.run.fleet, ids, tmp_path / "m", BrokerOptions(mtls=True), shards=cfg.shard_layout)
    assert 'broker = "mqtts://127.0.0.1:2001"' in (err.value.hint or "") and "drop --mtls" in (err.value.hint or "")
    assert not (tmp_path / "m").exists()  # refused before anything is written
    with pytest.raises(ConfigError, match=r"broker 127.0.0.1:2001 is the root broker's address") as err:
        write_sharded_config(cfg.run.fleet, ids, tmp_path / "p", BrokerOptions(port=2001, hostname="127.0.0.1"),
                             shards=cfg.shard_layout)
    assert "another port" in (err.value.hint or "")
    tls = load_fleet(fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003).replace("mqtt://", "mqtts://"), "tls"))
    with pytest.raises(ConfigError, match=r"'a': broker is mqtts://127.0.0.1:2001 but the brokers are written "
                                          r"without TLS") as err:
        write_sharded_config(cfg.run.fleet, ids, tmp_path / "t", BrokerOptions(port=2000), shards=tls.shard_layout)
    assert "pass --tls" in (err.value.hint or "")


def test_the_command_refuses_shards_twice_and_mtls_on_plain_shards(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    path = fleet(tmp_path, TREE.format(pa=2001, pb=2002, pc=2003))
    assert main(["broker", "config", "--fleet", str(path), "--out", str(tmp_path / "x"), "--shards", "2"]) != 0
    err = capsys.readouterr().err
    assert "--shards 2 and the [[shards]] tables" in err and "drop --shards" in err
    assert main(["broker", "config", "--fleet", str(path), "--out", str(tmp_path / "y"), "--mtls"]) != 0
    assert "'a': broker is mqtt://127.0.0.1:2001 but the brokers are written with TLS" in capsys.readouterr().err
    asynchronous = fleet(tmp_path, '[coordinator]\nmode = "async"\n' + TREE.format(pa=2001, pb=2002, pc=2003), "async")
    assert main(["broker", "config", "--fleet", str(asynchronous), "--out", str(tmp_path / "a")]) != 0
    assert 'mode = "async" cannot run with [[shards]]' in capsys.readouterr().err
    assert main(["broker", "config", "--fleet", str(path), "--out", str(tmp_path / "ok"), "--port", "2000",
                 "--hostname", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert "shard c: mosquitto -c" in out and "under shard a" in out
    assert re.search(r"--name relay-c .* --broker mqtt://127.0.0.1:2001 --shard mqtt://127.0.0.1:2003", out), out


def test_the_command_writes_mtls_workers_and_prints_certificates_for_every_account(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    flat = fleet(tmp_path, "", "flat")
    out = tmp_path / "w"
    assert main(["broker", "config", "--fleet", str(flat), "--out", str(out), "--mtls", "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    w2 = out / "workers" / "worker-2"
    assert f"fedge coordinator worker --config {flat} --name worker-2 --cert {w2 / 'client.crt'} " \
           f"--key {w2 / 'client.key'} --ca {w2 / 'ca.crt'} --broker mqtts://localhost:8883" in printed
    assert f"--cert {out / 'relays/relay-1/client.crt'} --key {out / 'relays/relay-1/client.key'}" in printed
    coord = out / "coordinator"
    assert f"--broker mqtts://localhost:8883 --cert {coord / 'client.crt'} --key {coord / 'client.key'}" in printed
    assert "--password-file" not in printed and "--username" not in printed
    assert f"fedge broker revoke|rotate ID --out {out}" in printed
    assert not list(out.rglob("password")) and not list(out.rglob("passwd"))


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

    from fedge.mqtt.connection import parse_broker_url
    from fedge.scaleout.cli import shard_url

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


def _tree(tmp: Path, name: str, **options: object) -> tuple[Path, Path, list[str]]:
    """(fleet config, broker tree, device ids) of TREE on mqtts:// brokers, written with ``options``."""
    path = fleet(tmp, TREE.format(pa=2001, pb=2002, pc=2003).replace("mqtt://", "mqtts://"), name)
    cfg = load_fleet(path)
    ids = [i for i, _ in device_ids(cfg)]
    out = tmp / name / "broker"
    write_sharded_config(cfg.run.fleet, ids, out, BrokerOptions(port=2000, bind="127.0.0.1", hostname="127.0.0.1",
                                                                iterations=10, **options),  # type: ignore[arg-type]
                         shards=cfg.shard_layout, workers=1, fleet_config=path)
    return path, out, ids


BROKERS = (".", "shards/shard-a", "shards/shard-b", "shards/shard-c")


def _cn(crt: Path) -> str:
    from fedge.broker.pki import load_cert

    return str(load_cert(crt).subject.rfc4514_string()).removeprefix("CN=")


def test_mtls_tree_one_certificate_per_account_one_index_and_the_crl_in_every_broker(tmp_path: Path) -> None:
    from fedge.broker.pki import CertIndex, load_cert

    _, out, ids = _tree(tmp_path, "m", mtls=True)
    ca = load_cert(out / "tls/ca.crt")
    # every broker requires a certificate of the one CA and reads its own copy of the one CRL; no passwords anywhere
    for b in BROKERS:
        conf = (out / b / "mosquitto.conf").read_text()
        assert "require_certificate true" in conf and "use_identity_as_username true" in conf
        assert f"crlfile {(out / b / 'tls/crl.pem').resolve()}" in conf and "password_file" not in conf
        assert (out / b / "tls/ca.crt").read_bytes() == (out / "tls/ca.crt").read_bytes()
    crls = {(out / b / "tls/crl.pem").read_bytes() for b in BROKERS}
    assert len(crls) == 1 and b"BEGIN X509 CRL" in crls.pop()
    assert not list(out.rglob("passwd")) and not list(out.rglob("password"))
    # one index and one CA key, at the root: no shard keeps a copy of the key that signs for the whole tree
    assert (out / "ca/index.json").is_file() and (out / "ca/ca.key").is_file()
    assert not list((out / "shards").rglob("index.json")) and not list((out / "shards").rglob("ca.key"))
    # each account's certificate: issued by the CA, CN = the account; a relay's one certificate is also its
    # shard's coordinator certificate, the deploy account's the same on every broker, a device's bundle copied
    accounts = {"fedge-coordinator": out / "coordinator/client.crt", "fedge-deploy": out / "deploy/client.crt",
                "worker-1": out / "workers/worker-1/client.crt"}
    accounts.update({f"relay-{s}": out / f"relays/relay-{s}/client.crt" for s in "abc"})
    shard_of = {d: "a" if d.startswith("rpi4") else "b" if d.startswith("x86") else "c" for d in ids}
    accounts.update({d: out / f"shards/shard-{shard_of[d]}/bundles/{d}/device.crt" for d in ids})
    for who, crt in accounts.items():
        assert _cn(crt) == who
        load_cert(crt).verify_directly_issued_by(ca)
        assert (crt.parent / crt.name.replace(".crt", ".key")).stat().st_mode & 0o077 == 0
    for s in "abc":
        shard = out / f"shards/shard-{s}"
        assert (shard / "coordinator/client.crt").read_bytes() == accounts[f"relay-{s}"].read_bytes()
        assert (shard / "coordinator/client.key").read_bytes() == (out / f"relays/relay-{s}/client.key").read_bytes()
        assert (shard / "deploy/client.crt").read_bytes() == accounts["fedge-deploy"].read_bytes()
    for d in ids:
        assert (out / "bundles" / d / "device.crt").read_bytes() == accounts[d].read_bytes()
        bundle = tomllib.loads((out / "bundles" / d / "bundle.toml").read_text())
        assert bundle["broker"] == f"mqtts://127.0.0.1:{ {'a': 2001, 'b': 2002, 'c': 2003}[shard_of[d]] }"
        assert (bundle["cert_file"], bundle["key_file"], bundle["ca_file"]) == ("device.crt", "device.key", "ca.crt")
    # the index: exactly one valid certificate per account, the one in its files, none revoked
    index = CertIndex(out / "ca/index.json")
    assert sorted(c.cn for c in index.certs) == sorted(accounts) and not index.revoked()
    assert {c.cn: int(c.serial, 16) for c in index.certs} == {w: load_cert(p).serial_number
                                                               for w, p in accounts.items()}
    issued = {w: p.read_bytes() for w, p in accounts.items()}
    assert (out / "relays/relay-a/ca.crt").read_bytes() == (out / "tls/ca.crt").read_bytes()
    # the ACLs are the password tree's: the certificate's CN is the user name they name
    _, pw_out, _ = _tree(tmp_path, "p", tls=True)
    for b in BROKERS:
        assert (out / b / "acl").read_text() == (pw_out / b / "acl").read_text(), b
    # a second run keeps every certificate; --rotate replaces each once (the old ones revoked, the new ones not)
    _tree(tmp_path, "m", mtls=True)
    assert {w: p.read_bytes() for w, p in accounts.items()} == issued
    _tree(tmp_path, "m", mtls=True, rotate=True)
    index = CertIndex(out / "ca/index.json")
    valid = {c.cn: int(c.serial, 16) for c in index.certs if c.revoked is None}
    assert valid == {w: load_cert(p).serial_number for w, p in accounts.items()}
    assert len(index.revoked()) == len(accounts) and all(p.read_bytes() != issued[w] for w, p in accounts.items())
    assert len({(out / b / "tls/crl.pem").read_bytes() for b in BROKERS}) == 1


def test_revoke_and_rotate_act_on_every_broker_of_an_mtls_tree(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    from fedge.broker.fleetkey import rotate_fleet_key
    from fedge.cli import main
    from fedge.flash.payload import prepare

    path, out, _ = _tree(tmp_path, "m", mtls=True)
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # an unknown id is refused naming it, and so is a shard's directory (the tree's index is at its root)
    assert main(["broker", "revoke", "rpi4-4gb-9", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the sharded broker tree {out} has no device, relay or worker 'rpi4-4gb-9'" in err
    assert "rpi4-4gb-1" in err and "relay-c" in err and "worker-1" in err
    assert main(["broker", "rotate", "rpi-zero-2w-1", "--out", str(out / "shards/shard-c")]) == 2
    err = capsys.readouterr().err
    assert f"is a shard's broker directory of the tree at {out}" in err and f"pass --out {out}" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    # revoking a device of shard c (under shard a): the CRL of every broker lists it, its certificate is gone from
    # both copies of its bundle, and the command names the broker to restart (its shard's) and those to reload
    serial = x509.load_pem_x509_certificate(files[out / "bundles/rpi-zero-2w-1/device.crt"]).serial_number
    assert main(["broker", "revoke", "rpi-zero-2w-1", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"restart `mosquitto -c {out / 'shards/shard-c/mosquitto.conf'}` to cut it now" in said
    assert all(f"`mosquitto -c {out / b / 'mosquitto.conf'}`" in said for b in BROKERS)
    crls = [x509.load_pem_x509_crl((out / b / "tls/crl.pem").read_bytes()) for b in BROKERS]
    assert len({c.public_bytes(Encoding.PEM) for c in crls}) == 1
    assert crls[0].get_revoked_certificate_by_serial_number(serial) is not None
    for d in (out / "bundles/rpi-zero-2w-1", out / "shards/shard-c/bundles/rpi-zero-2w-1"):
        assert not (d / "device.crt").exists() and not (d / "device.key").exists()
    with pytest.raises(ConfigError, match="has no certificate and key for rpi-zero-2w-1"):
        prepare("rpi-zero-2w-1", path, out)
    # a copy of the revoked certificate put back into the shard's bundle is refused from the shard's directory too:
    # it has no index of its own, the tree's (at its root) says revoked, and the fix names the root
    shard_c = out / "shards/shard-c"
    for name in ("device.crt", "device.key"):
        (shard_c / "bundles/rpi-zero-2w-1" / name).write_bytes(files[out / "bundles/rpi-zero-2w-1" / name])
    with pytest.raises(ConfigError, match=r"the certificate of rpi-zero-2w-1 cannot connect: .*revoked") as exc:
        prepare("rpi-zero-2w-1", path, shard_c)
    assert exc.value.hint == f"issue a new one: fedge broker rotate rpi-zero-2w-1 --out {out}"
    # rotated, it has a new certificate in both copies and flashes again
    assert main(["broker", "rotate", "rpi-zero-2w-1", "--out", str(out)]) == 0
    capsys.readouterr()
    new = out / "shards/shard-c/bundles/rpi-zero-2w-1/device.crt"
    assert new.read_bytes() == (out / "bundles/rpi-zero-2w-1/device.crt").read_bytes() and _cn(new) == "rpi-zero-2w-1"
    assert prepare("rpi-zero-2w-1", path, out).broker == "mqtts://127.0.0.1:2003"
    # a relay's certificate: rotated in relays/ and in its shard's coordinator/, the old one in every CRL; it
    # has rights on its parent (shard a) and its shard (c): those two are named to restart
    old = x509.load_pem_x509_certificate((out / "relays/relay-c/client.crt").read_bytes()).serial_number
    assert main(["broker", "rotate", "relay-c", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert (f"restart `mosquitto -c {out / 'shards/shard-a/mosquitto.conf'}`, "
            f"`mosquitto -c {out / 'shards/shard-c/mosquitto.conf'}` to cut it now") in said
    relay_c = (out / "relays/relay-c/client.crt").read_bytes()
    assert relay_c == (out / "shards/shard-c/coordinator/client.crt").read_bytes()
    for b in BROKERS:
        crl = x509.load_pem_x509_crl((out / b / "tls/crl.pem").read_bytes())
        assert crl.get_revoked_certificate_by_serial_number(old) is not None
    # the fleet key's rotation reaches every fleet.pub of the tree (root and shard copies of bundles, deploy)
    old_pub = (out / "coordinator/fleet.pub").read_bytes()
    pubs = list(out.rglob("fleet.pub"))
    assert len(pubs) > 10
    rotate_fleet_key(out, "tree")
    assert all(p.read_bytes() != old_pub for p in pubs)


def test_revoke_and_rotate_of_a_password_tree_change_the_brokers_that_hold_the_account(tmp_path: Path) -> None:
    """Before, ``revoke`` on a sharded tree edited the root's passwd, where a device has no line: its shard's
    broker kept accepting it. Now the lines go where the ACLs name the account."""
    from fedge.cli import main

    _, out, _ = _tree(tmp_path, "p", tls=True)

    def users(b: str) -> set[str]:
        return {ln.split(":")[0] for ln in (out / b / "passwd").read_text().splitlines()}

    before = {b: (out / b / "passwd").read_bytes() for b in BROKERS}
    assert main(["broker", "revoke", "x86-gateway-1", "--out", str(out)]) == 0
    assert "x86-gateway-1" not in users("shards/shard-b") and "x86-gateway-2" in users("shards/shard-b")
    assert all((out / b / "passwd").read_bytes() == before[b] for b in BROKERS if b != "shards/shard-b")
    assert not (out / "bundles/x86-gateway-1/password").exists()
    assert not (out / "shards/shard-b/bundles/x86-gateway-1/password").exists()
    assert main(["broker", "rotate", "x86-gateway-1", "--out", str(out)]) == 0
    assert "x86-gateway-1" in users("shards/shard-b")
    pw = (out / "bundles/x86-gateway-1/password").read_text()
    assert (out / "shards/shard-b/bundles/x86-gateway-1/password").read_text() == pw
    # relay-c's one password: its line on its parent (shard a) and on its shard (c) replaced, both copies written
    old = (out / "relays/relay-c/password").read_text()
    assert main(["broker", "rotate", "relay-c", "--out", str(out)]) == 0
    new = (out / "relays/relay-c/password").read_text()
    assert new != old and (out / "shards/shard-c/coordinator/password").read_text() == new
    changed = {b for b in BROKERS if (out / b / "passwd").read_bytes() != before[b]}
    assert changed == {"shards/shard-a", "shards/shard-b", "shards/shard-c"}
