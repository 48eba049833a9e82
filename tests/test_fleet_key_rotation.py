"""Rotating the fleet's signing key (fedge.common.keyrotation, `fedge broker rotate-fleet-key`): the key chain,
a device following it and refusing chains it must not follow (counted, logged, nothing changed), over a real
Mosquitto with mutual TLS, and a device restarted after the rotation trusting only the new key."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_helpers import mtls_mosquitto, mtls_settings, wait_until
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.broker.fleetkey import NEXT_KEY, rotate_fleet_key
from fedge.cli import main
from fedge.common.keyrotation import CHAIN_FILE, KEY_STATE_FILE, FleetKeyTrust, KeyChain, Link, chain_for_key
from fedge.common.messages import Message
from fedge.common.signing import ReplayGuard, SignatureError, Signer, generate_key, key_id, load_private_key
from fedge.errors import ConfigError
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.fleetkey import KeyChainFollower
from fedge.mqtt.settings import TransportSettings
from fedge.mqtt.topics import FleetTopics

FLEET = "rot"
T = FleetTopics(FLEET)


def _round(rnd: int, run: str = "r1") -> bytes:
    return Message("round", "coordinator", rnd, FLEET,
                   info={"round": {"round": rnd, "phase": "train"}, "run": run, "globals": {}}).to_bytes()


def _keys(n: int) -> list[Ed25519PrivateKey]:
    return [Ed25519PrivateKey.generate() for _ in range(n)]


def _chain(keys: list[Ed25519PrivateKey]) -> KeyChain:
    chain = KeyChain(FLEET)
    for old, new in itertools.pairwise(keys):
        chain = chain.extend(old, new)
    return chain


def _trust(tmp_path: Path, key: Ed25519PrivateKey, state: str = "state") -> FleetKeyTrust:
    pub = tmp_path / "fleet.pub"
    if not pub.exists():
        from fedge.common.signing import public_pem

        pub.write_bytes(public_pem(key.public_key()))
    return FleetKeyTrust.load(pub, FLEET, state_dir=tmp_path / state)


def _refused(trust: FleetKeyTrust, data: bytes, reason: str) -> str:
    """``data`` refused for ``reason`` and nothing changed: the key trusted, the file kept."""
    before, path = trust.current, trust.path
    kept = path.read_bytes() if path is not None and path.exists() else None
    with pytest.raises(SignatureError) as exc:
        trust.accept(data)
    assert exc.value.reason == reason, exc.value.message
    assert trust.current == before and list(trust.verifier.keys) == [before]
    assert (path.read_bytes() if path is not None and path.exists() else None) == kept
    return exc.value.message


# -- the chain and a device's trust, without a broker --------------------------------------------------------------

def test_a_device_follows_the_chain_and_then_trusts_only_the_new_key(tmp_path: Path) -> None:
    k0, k1, k2 = _keys(3)
    trust = _trust(tmp_path, k0)
    topic = T.round
    old_frame = Signer(k0).seal(topic, _round(1))
    assert trust.verifier.open(topic, old_frame)
    one = _chain([k0, k1])
    assert trust.accept(one.to_bytes()) is True
    assert trust.current == key_id(k1.public_key()) and list(trust.verifier.keys) == [trust.current]
    assert trust.accept(one.to_bytes()) is False  # the same chain again (a retained redelivery): nothing to do
    with pytest.raises(SignatureError, match="not the fleet key") as exc:  # no grace window for the old key
        trust.verifier.open(topic, Signer(k0).seal(topic, _round(2)))
    assert exc.value.reason == "key"
    assert trust.verifier.open(topic, Signer(k1).seal(topic, _round(3)))
    state = json.loads((tmp_path / "state" / KEY_STATE_FILE).read_text())
    assert state["key"] == key_id(k1.public_key()) and state["retired"] == [key_id(k0.public_key())]
    assert (tmp_path / "state" / KEY_STATE_FILE).stat().st_mode & 0o077 == 0
    # two rotations later, the whole chain is published: a device that slept through both follows both
    sleeper = _trust(tmp_path, k0, state="sleeper")
    assert sleeper.accept(_chain([k0, k1, k2]).to_bytes()) is True
    assert sleeper.current == key_id(k2.public_key()) and sleeper.retired == [key_id(k.public_key()) for k in (k0, k1)]
    assert trust.accept(_chain([k0, k1, k2]).to_bytes()) is True  # and one that saw the first follows the second


def test_chains_a_device_must_not_follow_are_refused_and_change_nothing(tmp_path: Path) -> None:
    k0, k1, k2, stranger = _keys(4)
    trust = _trust(tmp_path, k0)
    # not signed by the key the device trusts: a chain starting from someone else's key ...
    assert "none of its links rotates from the key this device trusts" in _refused(
        trust, _chain([stranger, k1]).to_bytes(), "key")
    # ... or one naming the device's key as `old` but signed by another key
    forged = Link.make(stranger, k1, FLEET, 1)
    statement = json.loads(forged.statement)
    statement["old"] = key_id(k0.public_key())
    s = json.dumps(statement, separators=(",", ":"), sort_keys=True).encode()
    from fedge.common.keyrotation import ROTATION_DOMAIN

    bad = Link.parse(s, stranger.sign(ROTATION_DOMAIN + s), k1.sign(ROTATION_DOMAIN + s))
    assert "is not signed by the old key" in _refused(trust, KeyChain(FLEET, (bad,)).to_bytes(), "signature")
    # the cross-signature: the new key did not sign (someone names a key whose private half they do not hold)
    no_cross = Link.parse(s := Link.make(k0, k1, FLEET, 1).statement, k0.sign(ROTATION_DOMAIN + s),
                          k2.sign(ROTATION_DOMAIN + s))
    assert "is not signed by the new key" in _refused(trust, KeyChain(FLEET, (no_cross,)).to_bytes(), "signature")
    # another fleet's chain
    other = KeyChain("elsewhere").extend(k0, k1)
    assert "not 'rot'" in _refused(trust, other.to_bytes(), "key")
    # malformed keys and chains
    good = _chain([k0, k1])
    d = json.loads(good.to_bytes())
    st = json.loads(d["links"][0]["statement"])
    for public, words in ((base64.b64encode(b"\x01" * 31).decode(), "is 31 bytes, not 32"),
                          ("not base64!", "is not base64"),
                          (base64.b64encode(k2.public_key().public_bytes_raw()).decode(), "the statement says")):
        bad_d = json.loads(json.dumps(d))
        bad_d["links"][0]["statement"] = json.dumps({**st, "public": public}, separators=(",", ":"), sort_keys=True)
        assert words in _refused(trust, json.dumps(bad_d).encode(), "malformed")
    for junk in (b"{", b"[]", json.dumps({**d, "links": []}).encode(), json.dumps({**d, "v": 2}).encode(),
                 json.dumps({**d, "links": [{"statement": 1, "old_sig": "", "new_sig": ""}]}).encode()):
        _refused(trust, junk, "malformed")
    # a chain going back to a key retired earlier in it
    back = KeyChain(FLEET, (*_chain([k0, k1]).links, Link.make(k1, k0, FLEET, 2)))
    assert "retired before" in _refused(trust, back.to_bytes(), "malformed")
    # after two rotations, the older chain replayed
    assert trust.accept(_chain([k0, k1, k2]).to_bytes())
    assert "an older rotation shown again" in _refused(trust, good.to_bytes(), "replay")


def test_a_restarted_device_trusts_the_key_it_rotated_to_and_a_reflashed_one_its_bundle(tmp_path: Path) -> None:
    k0, k1, k2 = _keys(3)
    first = _trust(tmp_path, k0)
    guard_file = tmp_path / "state" / "signed-seen.json"
    first.verifier.guard = ReplayGuard(guard_file)
    first.accept(_chain([k0, k1]).to_bytes())
    again = FleetKeyTrust.load(tmp_path / "fleet.pub", FLEET, state_dir=tmp_path / "state",
                               guard=ReplayGuard(guard_file))  # the bundle still holds key 0
    assert again.current == key_id(k1.public_key()) and again.retired == [key_id(k0.public_key())]
    with pytest.raises(SignatureError) as exc:
        again.verifier.open(T.round, Signer(k0).seal(T.round, _round(5)))
    assert exc.value.reason == "key"
    # the chain it followed, seen again, changes nothing; the next rotation is followed
    assert again.accept(_chain([k0, k1]).to_bytes()) is False
    assert again.accept(_chain([k0, k1, k2]).to_bytes()) is True
    # a card flashed again with a key the state never heard of: the bundle wins
    from fedge.common.signing import public_pem

    k9 = Ed25519PrivateKey.generate()
    (tmp_path / "new.pub").write_bytes(public_pem(k9.public_key()))
    flashed = FleetKeyTrust.load(tmp_path / "new.pub", FLEET, state_dir=tmp_path / "state")
    assert flashed.current == key_id(k9.public_key())


def test_rotate_fleet_key_hands_over_and_updates_every_fleet_pub(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                  ) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[run]\nfleet = "{FLEET}"\nmethod = "fedproto"\nrounds = 1\n\n'
                     '[[devices]]\nprofile = "rpi4-2gb"\ncount = 2\n')
    out = tmp_path / "broker"
    with pytest.raises(ConfigError, match="has no fleet signing key"):
        rotate_fleet_key(tmp_path / "nothing", FLEET)
    assert main(["broker", "config", "--fleet", str(fleet), "--out", str(out), "--sign"]) == 0
    assert f"topic read {T.fleet_keys}" in (out / "acl").read_text()
    k0 = load_private_key(out / "coordinator/signing.key")
    assert main(["broker", "rotate-fleet-key", "--fleet", str(fleet), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    k1 = load_private_key(out / "coordinator/signing.key")
    assert key_id(k1.public_key()) != key_id(k0.public_key())
    assert f"{key_id(k0.public_key())} -> {key_id(k1.public_key())}" in printed and "restart the coordinator" in printed
    assert (out / "coordinator/signing.key").stat().st_mode & 0o077 == 0
    assert not (out / "coordinator" / NEXT_KEY).exists()
    pubs = sorted(out.rglob("fleet.pub"))
    assert len(pubs) == 4  # coordinator, deploy, two bundles
    from fedge.common.signing import load_public_key

    assert {key_id(load_public_key(p)) for p in pubs} == {key_id(k1.public_key())}
    chain = chain_for_key(out / "coordinator/signing.key", k1)
    assert chain is not None and chain.last == key_id(k1.public_key()) and len(chain.links) == 1
    # a device flashed before the rotation follows the chain the command wrote
    device = tmp_path / "dev"
    device.mkdir()
    from fedge.common.signing import public_pem

    (device / "fleet.pub").write_bytes(public_pem(k0.public_key()))
    trust = FleetKeyTrust.load(device / "fleet.pub", FLEET, state_dir=device / "state")
    assert trust.accept((out / "coordinator" / CHAIN_FILE).read_bytes())
    assert trust.current == key_id(k1.public_key())
    # an interrupted rotation (the new key written, the chain naming it, the switch not made) is finished
    k2 = generate_key(out / "coordinator" / NEXT_KEY)
    (out / "coordinator" / CHAIN_FILE).write_bytes(chain.extend(k1, k2).to_bytes())
    r = rotate_fleet_key(out, FLEET)
    assert r.new == key_id(k2.public_key()) and r.old == key_id(k1.public_key())
    assert key_id(load_private_key(out / "coordinator/signing.key").public_key()) == r.new
    # a signing key that does not end the chain is refused in words
    stray = generate_key(out / "coordinator/signing.key")
    with pytest.raises(ConfigError, match="do not belong together"):
        rotate_fleet_key(out, FLEET)
    with pytest.raises(ConfigError, match="a rotation was interrupted"):  # what the coordinator and deploy say
        chain_for_key(out / "coordinator/signing.key", stray)


# -- over Mosquitto with mutual TLS ------------------------------------------------------------------------------

@pytest.fixture
def mtls_broker(mosquitto_bin: str) -> Iterator[tuple[MosquittoProcess, Path]]:
    with mtls_mosquitto(FLEET, ["cam-1", "cam-2"]) as running:
        yield running


class Device:
    """A device as `fedge edge run` wires it: the bundle's fleet.pub (or the key it rotated to), the transport,
    the key chain follower."""

    def __init__(self, broker: MosquittoProcess, out: Path, name: str, flashed_pub: Path, state: Path) -> None:
        wire = TransportSettings(chunk_bytes=4096, global_timeout_s=5)
        self.trust = FleetKeyTrust.load(flashed_pub, FLEET, state_dir=state,
                                        guard=ReplayGuard(state / "signed-seen.json"))
        self.transport = MqttDeviceTransport(mtls_settings(broker, out, name), FLEET, name, wire,
                                             verifier=self.trust.verifier)
        self.follower = KeyChainFollower(self.transport.client, self.transport.topics, self.trust, name,
                                         self.transport.stats)
        self.transport.start()

    def close(self) -> None:
        self.transport.close()


def test_rotation_over_mosquitto_bad_chains_refused_and_a_restarted_device_trusts_only_the_new_key(
        mtls_broker: tuple[MosquittoProcess, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broker, out = mtls_broker
    flashed = tmp_path / "flashed.pub"  # what the devices' cards hold: the fleet key before any rotation
    shutil.copyfile(out / "bundles/cam-1/fleet.pub", flashed)
    wire = TransportSettings(chunk_bytes=4096)
    k0 = load_private_key(out / "coordinator/signing.key")
    coord = MqttCoordinatorTransport(mtls_settings(broker, out, "coordinator"), FLEET, wire, signer=Signer(k0)).start()
    cam1 = Device(broker, out, "cam-1", flashed, tmp_path / "cam-1")
    cam2: Device | None = None
    try:
        r1 = _round(1)
        coord.announce_round(r1)
        assert wait_until(lambda: cam1.transport.current_round() == r1)
        coord.close()
        # the operator rotates, twice, and restarts the coordinator: it publishes the chain, then signs with key 2
        rotate_fleet_key(out, FLEET)
        k1 = load_private_key(out / "coordinator/signing.key")
        chain_1 = (out / "coordinator" / CHAIN_FILE).read_bytes()
        rotate_fleet_key(out, FLEET)
        k2 = load_private_key(out / "coordinator/signing.key")
        chain = chain_for_key(out / "coordinator/signing.key", k2)
        assert chain is not None
        coord = MqttCoordinatorTransport(mtls_settings(broker, out, "coordinator"), FLEET, wire, signer=Signer(k2),
                                         key_chain=chain.to_bytes()).start()
        r2 = _round(2)
        coord.announce_round(r2)
        assert wait_until(lambda: cam1.transport.current_round() == r2), cam1.transport.stats.rejected
        assert cam1.trust.current == key_id(k2.public_key()) and cam1.follower.rotations == 1
        assert json.loads((tmp_path / "cam-1" / KEY_STATE_FILE).read_text())["key"] == key_id(k2.public_key())
        # a device that was off during the rotation comes online: it meets the round signed with key 2 (refused:
        # it trusts key 0) and the chain, follows the chain, gets every retained message again, takes the round
        cam2 = Device(broker, out, "cam-2", flashed, tmp_path / "cam-2")
        assert wait_until(lambda: cam2.transport.current_round() == r2, 10), cam2.transport.stats.rejected
        assert cam2.trust.current == key_id(k2.public_key())
        cam2.close()
        coord.close()
        time.sleep(0.2)
        # the attacker holds the coordinator's broker credential and the retired keys 0 and 1, not key 2
        attacker = MqttClient(mtls_settings(broker, out, "coordinator"), "fedge-coordinator").start(5)
        stranger = Ed25519PrivateKey.generate()
        forged_chain = KeyChain(FLEET).extend(stranger, Ed25519PrivateKey.generate())  # not from any fleet key
        d = json.loads(chain.to_bytes())
        st = json.loads(d["links"][-1]["statement"])
        d["links"][-1]["statement"] = json.dumps({**st, "public": base64.b64encode(b"\0" * 31).decode()},
                                                 separators=(",", ":"), sort_keys=True)
        rejected = cam1.transport.stats.rejected
        # counted so far: at most the retained round of key 0, delivered again when cam-1's re-subscription (after
        # it followed the chain) reached the broker before the restarted coordinator's round 2 had replaced it
        before = dict(rejected)
        assert set(before) <= {"key"}, before

        def delta() -> dict[str, int]:
            return {k: v - before.get(k, 0) for k, v in rejected.items() if v != before.get(k, 0)}

        caplog.clear()
        for payload in (forged_chain.to_bytes(), chain_1, json.dumps(d).encode(), b"not json"):
            attacker.require_published([attacker.publish(T.fleet_keys, payload, retain=True)], 5, "attack")
        attacker.require_published([attacker.publish(T.round, Signer(k1).seal(T.round, _round(9)), retain=True)],
                                   5, "attack")
        assert wait_until(lambda: sum(delta().values()) >= 5), rejected
        assert delta() == {"key-chain:key": 1, "key-chain:replay": 1, "key-chain:malformed": 2, "key": 1}, rejected
        assert cam1.trust.current == key_id(k2.public_key()) and cam1.transport.current_round() == r2
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "cam-1: refused the key chain on fedge/rot/keys/fleet: replay: a key chain ending at key" in logged
        assert "is 31 bytes, not 32" in logged and "still trusting key " + key_id(k2.public_key()) in logged
        # the device restarts (its card still holds key 0): it trusts key 2 only, from its state directory
        cam1.close()
        cam1 = Device(broker, out, "cam-1", flashed, tmp_path / "cam-1")
        assert list(cam1.trust.verifier.keys) == [key_id(k2.public_key())]
        retained_old = Signer(k0).seal(T.round, _round(10))
        attacker.require_published([attacker.publish(T.round, retained_old, retain=True)], 5, "attack")
        assert wait_until(lambda: cam1.transport.stats.rejected.get("key", 0) >= 1)
        assert cam1.transport.current_round() is None  # neither key 1's nor key 0's round was taken
        fresh = _round(11)
        attacker.require_published([attacker.publish(T.round, Signer(k2).seal(T.round, fresh), retain=True)], 5, "r")
        assert wait_until(lambda: cam1.transport.current_round() == fresh)
        attacker.stop()
    finally:
        cam1.close()
        if cam2 is not None:
            cam2.close()
        coord.close()
