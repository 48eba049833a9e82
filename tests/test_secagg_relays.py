"""Secure aggregation behind relays (fedge.secagg.partial): relays sum their shards' masked inputs.

* In the protocol's state machines: the coordinator's sum over two relays' sums (and over a chain, a relay's sum
  holding a child relay's) equals the plain sum within the fixed-point error, with dropouts after sharing and
  after masking; a relay's sum is as uniform as one masked input; forged and malformed sums — wrong length, wrong
  field, a device counted twice, a device not under that relay, one that shared no keys, a replayed or late sum —
  are refused whole and counted by reason.
* Over three real Mosquittos (root, two shards, a relay each — and as a chain root ← shard 1 ← shard 2): two
  secure FedAvg rounds publish what the one-broker secure run publishes (within 1e-6), no masked input of a device
  crosses the root broker, and forged sums a relay sends are refused and counted in the round's report.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from scipy.stats import chisquare
from test_secagg_protocol import assert_sum, inputs_of, setup_of

from fedge.common.rounds import group_artifact
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.fleet.config import FleetConfig, parse_fleet
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.topics import FleetTopics
from fedge.scaleout.aggregator import PartialAggregator
from fedge.scaleout.relay import Relay
from fedge.secagg import messages as msg
from fedge.secagg.inprocess import run_group
from fedge.secagg.messages import RoundSetup
from fedge.secagg.partial import RelaySums, is_masked
from fedge.secagg.rounds import SecureTask
from fedge.secagg.server import SecAggServer
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet, simulate

# -- the state machines --------------------------------------------------------------------------------------------


def relay_sums(name: str, setup: RoundSetup) -> RelaySums:
    sums = RelaySums(name)
    sums.begin(setup.round, {setup.group: SecureTask(setup, "fedavg", 1.0, 4.0).to_dict()})
    return sums


class RelayedServer(SecAggServer):
    """A coordinator whose devices' masked inputs reach it through relays (``shard_of``: device -> relay; a
    device in none sends its own), each relay's sum flushed into its parent (``parent_of``; absent: this server)
    when the masked stage closes."""

    def __init__(self, setup: RoundSetup, shard_of: dict[str, str], parent_of: dict[str, str] | None = None) -> None:
        super().__init__(setup)
        self.shard_of, self.parent_of = shard_of, parent_of or {}
        self.relays = {r: relay_sums(r, setup) for r in set(shard_of.values())}
        self.allowed = {r: {d for d, s in shard_of.items() if s == r or self.parent_of.get(s) == r}
                        for r in self.relays}
        self.sums: list[tuple[str, bytes]] = []  # every sum that reached this server

    def receive(self, sender: str, data: bytes) -> bool:
        relay = self.shard_of.get(sender)
        if self.stage == "masked" and relay is not None:
            assert self.relays[relay].upward(sender, data) is None  # summed there, not forwarded
            return True
        if relay is not None and self.relays[relay].upward(sender, data) is None:
            return False
        return super().receive(sender, data)

    def close_masked(self) -> dict[str, bytes]:
        for child, parent in self.parent_of.items():
            for data in self.relays[child].flush():
                assert self.relays[parent].child_sum(child, data, self.allowed[child])
        for name, relay in self.relays.items():
            if name in self.parent_of:
                continue
            for data in relay.flush():
                self.sums.append((name, data))
                assert self.receive_sum(name, data, self.allowed[name])
        return super().close_masked()


@pytest.mark.parametrize("topology", ["two-relays", "chain"])
def test_the_sum_over_relays_equals_the_plain_sum_with_dropouts(topology: str) -> None:
    """Twelve devices: four behind r1, four behind r2 (r2 under r1 in the chain), four on the root broker; one
    of r1's vanishes after sharing its keys and one of r2's after its masked input."""
    setup = setup_of(12)
    inputs = inputs_of(setup)
    members = list(setup.members)
    shard_of = {d: "r1" for d in members[:4]} | {d: "r2" for d in members[4:8]}
    server = RelayedServer(setup, shard_of, {"r2": "r1"} if topology == "chain" else None)
    lost = {"masked": {members[1]}, "unmask": {members[5]}}
    result = run_group(setup, inputs, lost=lost, server=server)
    survivors = [d for d in members if d != members[1]]
    assert result.survivors == survivors
    assert_sum(setup, result.sums, inputs, survivors)
    assert server.masked == {d: "r1" if topology == "chain" and d in shard_of else shard_of.get(d, d)
                             for d in survivors}
    assert sorted(name for name, _ in server.sums) == (["r1"] if topology == "chain" else ["r1", "r2"])
    assert not server.refusals and not any(r.refusals for r in server.relays.values())


def test_a_relays_sum_is_as_uniform_as_one_masked_input() -> None:
    """What a relay sends up hides its devices: over 200 rounds, the words of a 3-device sum are uniform on
    Z_{2^32} (chi-square over 16 buckets of the top bits), the same test one masked input passes."""
    tops = []
    for rnd in range(1, 201):
        setup = setup_of(6, rnd=rnd)
        server = RelayedServer(setup, dict.fromkeys(setup.members[:3], "r1"))
        run_group(setup, {m: {"w": np.zeros((40, 5)), "n": np.zeros(3)} for m in setup.members}, server=server)
        _, words = msg.decode_masked_sum(setup, server.sums[0][1], "r1")
        tops.append(words >> np.uint32(28))
    counts = np.bincount(np.concatenate(tops).astype(np.int64), minlength=16)
    assert chisquare(counts).pvalue > 1e-3, counts


def masked_stage(setup: RoundSetup) -> tuple[SecAggServer, dict[str, bytes]]:
    """A server at its masked stage with every member's masked input (none delivered yet)."""
    from fedge.secagg.device import SecAggDevice

    server = SecAggServer(setup)
    devices = {m: SecAggDevice(m, setup) for m in setup.members}
    inputs = inputs_of(setup)
    for m, d in devices.items():
        assert server.receive(m, d.advertise())
    rosters = server.close_keys()
    for m, d in devices.items():
        if m != setup.members[-1]:  # the last one vanishes before sharing
            assert server.receive(m, d.share_keys(rosters[m]))
    inboxes = server.close_shares()
    return server, {m: devices[m].masked_input(inboxes[m], inputs[m]) for m in inboxes}


def test_forged_and_malformed_sums_are_refused_whole_and_counted() -> None:
    setup = setup_of(8)
    server, masked = masked_stage(setup)
    a, b, c, d, e, _, _, gone = setup.members
    r1 = relay_sums("r1", setup)
    for dev in (a, b, c):
        assert r1.upward(dev, masked[dev]) is None
    (good,) = r1.flush()
    _, words = msg.decode_masked_sum(setup, good, "r1")
    other = setup_of(8, bits=64)  # the same members in another field
    forged = {
        "shape": [msg.encode_masked_sum(setup, "r1", [a, b, c], words[:-1]),  # wrong length
                  msg.encode_masked_sum(other, "r1", [a, b, c], words.astype(np.uint64))],  # wrong field
        "foreign": [msg.encode_masked_sum(setup, "r1", [a, b, c, e], words)],  # e is not under r1
        "unknown-sender": [msg.encode_masked_sum(setup, "r1", [a, gone], words)],  # gone shared no keys
        "spoofed": [msg.encode_masked_sum(setup, "r2", [a, b, c], words)],  # r2's, on r1's topic
        "round": [msg.encode_masked_sum(setup_of(8, rnd=2), "r1", [a, b, c], words)],  # replayed across rounds
        "malformed": [good[:-5], good.replace(b'"secagg.devices":"[', b'"secagg.devices":"{')],
    }
    shard = {a, b, c, d, gone}
    for reason, payloads in forged.items():
        for data in payloads:
            assert server.receive_sum("r1", data, shard) == [], reason
    assert server.receive(d, masked[d])  # d sends its own
    assert server.receive_sum("r1", msg.encode_masked_sum(setup, "r1", [a, d], words), shard) == []  # d counted
    assert server.receive_sum("r1", good, shard) == [a, b, c]
    assert server.receive_sum("r1", good, shard) == []  # the same sum again: a, b and c are counted
    assert server.refusals == Counter({"shape": 2, "foreign": 1, "unknown-sender": 1, "spoofed": 1, "round": 1,
                                       "malformed": 2, "duplicate": 2})
    assert sorted(server.masked) == [a, b, c, d]
    assert server.receive(e, masked[e])
    server.close_masked()
    assert server.receive_sum("r1", good, shard) == [] and server.refusals["late"] == 1


def test_a_relay_refuses_what_it_cannot_sum_and_forwards_every_other_stage() -> None:
    setup = setup_of(6)
    server, masked = masked_stage(setup)
    a, b, c = setup.members[:3]
    r1, r2 = relay_sums("r1", setup), relay_sums("r2", setup)
    keys = msg.encode(setup, "keys", a, {"c_pk": "x", "s_pk": "y"})
    assert r1.upward(a, keys) == keys  # forwarded untouched: the coordinator checks it
    assert r1.upward("stranger", masked[a]) == masked[a]  # in no group here: the coordinator refuses it
    assert r1.upward(a, masked[a]) is None
    assert r1.upward(a, masked[a]) is None  # twice: refused
    assert r1.upward(b, masked[a]) is None  # a's input on b's topic: spoofed
    assert r1.upward(b, masked[b][:-3]) is None  # truncated
    assert r2.upward(c, masked[c]) is None
    (child,) = r2.flush()
    assert not r1.child_sum("r2", child, {a, b})  # c is not under r2 by the layout given
    assert r1.child_sum("r2", child, {c})
    assert not r1.child_sum("r2", child, {c})  # c is counted already
    assert r1.refusals == Counter({"duplicate": 2, "spoofed": 1, "malformed": 1, "foreign": 1})
    (up,) = r1.flush()
    assert r1.flush() == []  # nothing new
    assert server.receive_sum("r1", up, None) == [a, c]


# -- over three real Mosquittos -------------------------------------------------------------------------------------

STAGE_S = 15.0
ARTIFACT = group_artifact("tier-xs")


def fleet(name: str, count: int, rounds: int = 2) -> FleetConfig:
    return parse_fleet({"run": {"method": "fedavg", "rounds": rounds, "dataset": "digits", "seed": 3, "fleet": name},
                        "partition": {"kind": "iid", "fraction": 0.15}, "train": {"local_epochs": 1},
                        "privacy": {"secure_aggregation": True},
                        "devices": [{"profile": "rpi4-2gb", "count": count, "arch": "tier-xs"}]})


@pytest.fixture
def brokers(mosquitto_bin: str) -> Iterator[list[MosquittoProcess]]:
    """Three Mosquittos on loopback: the root and two shards."""
    out = [MosquittoProcess().start() for _ in range(3)]
    yield out
    for b in out:
        b.close()


class MaskedSpy:
    """A client of the root broker that records every device stage message crossing it."""

    def __init__(self, broker: MosquittoProcess, fleet_name: str) -> None:
        self.got: list[Received] = []
        self.lock = threading.Lock()
        self.client = MqttClient(broker.settings(), "spy", on_message=self._on).start(10)
        self.client.subscribe(FleetTopics(fleet_name).device_filter("secagg"))

    def _on(self, m: Received) -> None:
        with self.lock:
            self.got.append(m)


def forging(relay: Relay, victim: str) -> None:
    """Make ``relay`` send, before each real sum, two forged ones: the sum claiming ``victim`` (a device of
    another shard) too, and the sum in a field of other bits."""
    flush = relay.secure.flush

    def with_forgeries() -> list[bytes]:
        out = []
        for data in flush():
            setup = relay.secure.groups[msg.masked_group(data)].setup
            devices, words = msg.decode_masked_sum(setup, data, relay.name)
            other = RoundSetup(setup.round, setup.group, setup.members, setup.degree, setup.threshold,
                               type(setup.plan)(64, setup.plan.group_size, setup.plan.segments), setup.seed)
            out += [msg.encode_masked_sum(setup, relay.name, [*devices, victim], words),
                    msg.encode_masked_sum(other, relay.name, devices, words.astype(np.uint64)), data]
        return out

    relay.secure.flush = with_forgeries  # type: ignore[method-assign]


@pytest.mark.parametrize("topology", ["two-shards", "chain"])
def test_a_sharded_secure_fleet_equals_the_one_broker_secure_run(brokers: list[MosquittoProcess],
                                                                 topology: str) -> None:
    """Six devices, three per shard. The in-process secure run is the one-broker reference (the one-broker
    Mosquitto run publishes it within 1e-6: tests/test_secagg_mqtt.py)."""
    root, s1, s2 = brokers
    ref = simulate(fleet(f"ref-relayed-{topology}", 6))
    cfg = fleet(f"relayed-{topology}", 6)
    devices, strat = build_fleet(cfg)
    ids = sorted(d.info.device_id for d in devices)
    shard1, shard2 = ids[:3], ids[3:]

    def relay(shard: MosquittoProcess, parent: MosquittoProcess, name: str) -> Relay:
        agg = PartialAggregator(copy.deepcopy(strat), EngineConfig(fleet=cfg.run.fleet, method="fedavg"), name)
        return Relay(shard.settings(), parent.settings(), cfg.run.fleet, agg, hold_s=5.0)

    r1 = relay(s1, root, "r1")
    r2 = relay(s2, root if topology == "two-shards" else s1, "r2")
    if topology == "chain":
        r1.aggregator.merger.allowed = {"r2": frozenset(shard2)}
        allowed = {"r1": frozenset(ids)}
    else:
        allowed = {"r1": frozenset(shard1), "r2": frozenset(shard2)}
        forging(r2, shard1[0])
    spy = MaskedSpy(root, cfg.run.fleet)
    coord = MqttCoordinatorTransport(root.settings(), cfg.run.fleet).start()
    r1.start()
    r2.start()
    _, _, stop = start_fleet(cfg, devices, lambda d: (s1 if d in shard1 else s2).settings(), coordinator=False)
    try:
        coord.wait_for_hellos(ids, 60)
        engine = RoundEngine(strat, coord, EngineConfig(fleet=cfg.run.fleet, method="fedavg", secure=cfg.privacy,
                                                        secure_stage_s=STAGE_S))
        engine.partials.allowed = allowed
        reports = engine.run()
    finally:
        stop()
        r1.stop()
        r2.stop()
        coord.close()
        spy.client.stop()
    for k, want in ref.globals[ARTIFACT].items():
        np.testing.assert_allclose(engine.globals[ARTIFACT][k], want, rtol=1e-6, atol=1e-7, err_msg=k)
    *training, final = reports
    for rep in training:
        assert rep.secure == {"tier-xs": {"survivors": ids, "dropped": [], "abandoned": ""}}, rep.secure
        assert sorted(rep.accepted) == ids and not rep.missing
        if topology == "two-shards":  # each forged sum refused whole, counted under the relay that sent it
            assert rep.rejected == {"secagg-foreign": 1, "secagg-shape": 1}, rep.rejected
            assert rep.rejected_by_device == {"r2": {"secagg-foreign": 1, "secagg-shape": 1}}
        else:
            assert not rep.rejected, rep.rejected
    assert not final.rejected
    # the devices' keys, shares and unmask answers crossed the root; not one masked input did
    stages = [m.payload for m in spy.got]
    assert len(stages) == 3 * len(ids) * len(training), len(stages)
    assert not any(is_masked(p) for p in stages)
    assert r1.sums_sent == len(training)  # one sum per round: in the chain, r2's devices inside it
    assert r2.sums_sent == len(training) * (3 if topology == "two-shards" else 1)  # with the two forgeries
