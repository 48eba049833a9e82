"""Secure aggregation's four stages (fedge.secagg.device / server): exact sums, dropouts, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chisquare

from fedge.secagg import graph
from fedge.secagg import messages as msg
from fedge.secagg.device import SecAggDevice
from fedge.secagg.fixedpoint import Segment, plan_field
from fedge.secagg.inprocess import run_group
from fedge.secagg.messages import Refusal, RoundSetup
from fedge.secagg.server import Abandoned, SecAggServer

SEGS = (Segment("w", (40, 5), 4.0), Segment("n", (3,), 1000.0))


def setup_of(n: int, *, degree: int = 0, threshold: int = 0, rnd: int = 1, bits: int = 0) -> RoundSetup:
    members = tuple(f"dev-{i:02d}" for i in range(n))
    k = degree or graph.default_degree(n)
    return RoundSetup(rnd, "tier-s", members, k, threshold or graph.default_threshold(k),
                      plan_field(n, SEGS, bits), b"seed-%d" % rnd)


def inputs_of(setup: RoundSetup, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {m: {"w": rng.normal(0, 1.5, (40, 5)), "n": rng.integers(0, 500, 3).astype(np.float64)}
            for m in setup.members}


def assert_sum(setup: RoundSetup, got: dict[str, np.ndarray], inputs: dict, who: list[str]) -> None:
    for seg in setup.plan.segments:
        plain = sum(np.clip(inputs[m][seg.name], -seg.clip, seg.clip) for m in who)
        assert np.abs(got[seg.name] - plain).max() <= setup.plan.max_error(seg, len(who))
    assert np.array_equal(np.rint(got["n"]), sum(inputs[m]["n"] for m in who))  # counts come back exact


@pytest.mark.parametrize(("n", "degree", "bits"), [(6, 0, 0), (30, 8, 0), (12, 4, 64), (9, 0, 24)])
def test_the_secure_sum_equals_the_plain_sum(n: int, degree: int, bits: int) -> None:
    setup = setup_of(n, degree=degree, bits=bits)
    inputs = inputs_of(setup)
    result = run_group(setup, inputs)
    assert result.survivors == list(setup.members)
    assert_sum(setup, result.sums, inputs, result.survivors)


class RecordingServer(SecAggServer):
    """Keeps every masked upload as it arrived (what a curious coordinator holds)."""

    uploads: dict[str, bytes]

    def receive(self, sender: str, data: bytes) -> bool:
        if self.stage == "masked":
            self.uploads = {**getattr(self, "uploads", {}), sender: data}
        return super().receive(sender, data)


def test_a_masked_upload_is_uniform_in_the_field() -> None:
    """A device's masked vector over many rounds is indistinguishable from uniform words (chi-square over the
    top 4 bits of 40 uploads × 500 words), while its unmasked encoding is nowhere near uniform."""
    seen, encoded = [], []
    for rnd in range(1, 41):
        setup = RoundSetup(rnd, "g", ("a", "b", "c"), 2, 2, plan_field(3, [Segment("w", (500,), 1.0)], 32), b"s")
        x = {"w": np.full(500, 0.25)}  # the same, highly structured input every round
        server = RecordingServer(setup)
        run_group(setup, {"a": x, "b": x, "c": x}, server=server)
        seen.append(msg.decode_masked(setup, server.uploads["a"], "a"))
        encoded.append(setup.plan.encode(x))
    top = np.concatenate(seen) >> np.uint32(28)
    assert chisquare(np.bincount(top, minlength=16)).pvalue > 1e-3
    plain_top = np.concatenate(encoded) >> np.uint32(28)
    assert chisquare(np.bincount(plain_top, minlength=16)).pvalue < 1e-12


@pytest.mark.parametrize("stage", ["shares", "masked", "unmask"])
def test_dropouts_at_each_stage_give_the_exact_sum_of_the_survivors(stage: str) -> None:
    """Lost after advertising keys ("shares"), after sharing them ("masked": its pairwise masks are removed with
    its neighbours' key shares), after sending its masked input ("unmask": its input counts, its seed comes from
    its neighbours)."""
    setup = setup_of(30, degree=12)
    inputs = inputs_of(setup, seed=3)
    lost = set(setup.members[::5])  # 6 of 30
    result = run_group(setup, inputs, lost={stage: lost})
    expected = sorted(set(setup.members) - lost) if stage != "unmask" else list(setup.members)
    assert result.survivors == expected
    assert_sum(setup, result.sums, inputs, expected)


def test_mixed_dropouts_and_missing_devices() -> None:
    setup = setup_of(20, degree=10, threshold=4)
    inputs = inputs_of(setup, seed=4)
    absent = setup.members[0]  # never started
    present = {m: v for m, v in inputs.items() if m != absent}
    result = run_group(setup, present, lost={"shares": {setup.members[1]}, "masked": {setup.members[2]},
                                             "unmask": {setup.members[3], setup.members[4]}})
    assert result.survivors == sorted(set(setup.members) - set(setup.members[:3]))
    assert_sum(setup, result.sums, inputs, result.survivors)


@pytest.mark.parametrize("stage", ["keys", "shares", "masked", "unmask"])
def test_fewer_survivors_than_the_threshold_abandon_the_round(stage: str) -> None:
    setup = setup_of(8, threshold=5)
    server = SecAggServer(setup)
    with pytest.raises(Abandoned, match=r"fewer than the threshold 5; the round's sum is abandoned"):
        run_group(setup, inputs_of(setup), lost={stage: set(setup.members[:4])}, server=server)
    assert server.stage == "abandoned"
    with pytest.raises(Abandoned):  # nothing can be summed afterwards
        server.close_unmask()


def test_a_secret_out_of_reach_abandons_even_with_enough_devices() -> None:
    """On a sparse ring, a device whose neighbours all stop answering cannot be unmasked: abandoned, not wrong."""
    setup = setup_of(16, degree=4, threshold=3)
    ring = graph.neighbours(setup.members, 4, setup.seed)
    victim = setup.members[0]
    with pytest.raises(Abandoned, match=rf"0 shares of the seed of '{victim}', fewer than the threshold 3"):
        run_group(setup, inputs_of(setup), lost={"unmask": {victim, *ring[victim]}})


def _stage_keys(setup: RoundSetup) -> tuple[SecAggServer, dict[str, SecAggDevice], dict[str, bytes]]:
    server = SecAggServer(setup)
    devices = {m: SecAggDevice(m, setup) for m in setup.members}
    adverts = {m: d.advertise() for m, d in devices.items()}
    return server, devices, adverts


def _through_shares(setup: RoundSetup) -> tuple[SecAggServer, dict[str, SecAggDevice], dict[str, bytes]]:
    """Every device through stages 1 and 2: (server, devices, each device's inbox)."""
    server, devices, adverts = _stage_keys(setup)
    for m, data in adverts.items():
        server.receive(m, data)
    rosters = server.close_keys()
    for m in rosters:
        server.receive(m, devices[m].share_keys(rosters[m]))
    return server, devices, server.close_shares()


def test_forged_replayed_oversized_and_malformed_messages_are_refused_and_counted() -> None:
    setup = setup_of(6, threshold=3)
    old = setup_of(6, threshold=3, rnd=0)
    server, devices, adverts = _stage_keys(setup)
    a, b = setup.members[:2]
    assert server.receive(a, adverts[a])
    refused = [
        server.receive(a, adverts[a]),  # duplicate (a replay within the round)
        server.receive(b, adverts[a]),  # spoofed: b sends a's message
        server.receive("mallory", adverts[a]),  # not in the group
        server.receive(b, SecAggDevice(b, old).advertise()),  # replayed from another round
        server.receive(b, b"{" * 10),  # malformed
        server.receive(b, b" " * 100_000),  # oversized
        server.receive(b, json.dumps({**json.loads(adverts[b]), "s_pk": "AAAA"}).encode()),  # malformed key
        server.receive(b, json.dumps({**json.loads(adverts[b]), "c_pk": json.loads(adverts[a])["c_pk"]}).encode()),
    ]
    assert not any(refused)
    assert dict(server.refusals) == {"duplicate": 1, "spoofed": 1, "unknown-sender": 1, "round": 1, "malformed": 2,
                                     "oversize": 1, "forged": 1}
    for m in setup.members[1:]:  # the round goes on and sums exactly
        assert server.receive(m, adverts[m])
    rosters = server.close_keys()
    shares = {m: devices[m].share_keys(rosters[m]) for m in rosters}
    assert not server.receive(a, adverts[a])  # a keys message in the shares stage
    doc = json.loads(shares[a])
    doc["shares"].pop(sorted(doc["shares"])[0])
    assert not server.receive(a, json.dumps(doc).encode())  # shares for fewer neighbours than it has
    assert server.refusals["stage"] == 1 and server.refusals["inconsistent"] == 1
    for m, data in shares.items():
        assert server.receive(m, data)
    inputs = inputs_of(setup)
    inboxes = server.close_shares()
    masked = {m: devices[m].masked_input(inboxes[m], inputs[m]) for m in inboxes}
    bad = msg.encode_masked(setup, a, np.zeros(setup.plan.length + 1, dtype=np.uint32))
    assert not server.receive(a, bad)
    assert server.refusals["shape"] == 1
    for m, data in masked.items():
        assert server.receive(m, data)
    requests = server.close_masked()
    for m, r in requests.items():
        assert server.receive(m, devices[m].unmask(r))
    assert not server.receive(a, masked[a])  # after the sum is closed to new stage-3 input
    got = server.close_unmask()
    assert_sum(setup, got, inputs, list(setup.members))


def test_a_device_cannot_open_shares_meant_for_another() -> None:
    """Shares are sealed per pair: a coordinator that hands one device's inbox to another gets a refusal."""
    setup = setup_of(5, threshold=3)
    _server, devices, inboxes = _through_shares(setup)
    a, b, c = setup.members[:3]
    sealed_for_b = json.loads(inboxes[b])["shares"][c]  # what c sealed for b
    forged_inbox = json.loads(inboxes[a])
    forged_inbox["shares"][c] = sealed_for_b  # presented to a as c's share for a
    with pytest.raises(Refusal, match="failed authentication") as err:
        devices[a].masked_input(json.dumps(forged_inbox).encode(), inputs_of(setup)[a])
    assert err.value.reason == "forged" and devices[a].refusals["forged"] == 1
    assert devices[a].stage == "stopped"  # it sends nothing more: to the coordinator, a dropout


def test_a_device_refuses_to_reveal_both_secrets_of_one_neighbour() -> None:
    setup = setup_of(5, threshold=3)
    _server, devices, inboxes = _through_shares(setup)
    inputs = inputs_of(setup)
    a, b = setup.members[:2]
    devices[a].masked_input(inboxes[a], inputs[a])
    both = msg.encode(setup, "unmask-request", "coordinator", {"survivors": list(setup.members), "dropped": [b]})
    with pytest.raises(Refusal, match="both survived and dropped") as err:
        devices[a].unmask(both)
    assert err.value.reason == "inconsistent"


def test_forged_key_shares_abandon_the_round() -> None:
    setup = setup_of(6, threshold=3)
    server, devices, inboxes = _through_shares(setup)
    inputs = inputs_of(setup)
    gone = setup.members[0]
    for m in setup.members[1:]:
        server.receive(m, devices[m].masked_input(inboxes[m], inputs[m]))
    requests = server.close_masked()
    for m, r in requests.items():
        doc = json.loads(devices[m].unmask(r))
        if gone in doc["keys"]:
            doc["keys"][gone] = msg.b64(bytes(65) + b"\x07")  # a well-formed but wrong share
        server.receive(m, json.dumps(doc).encode())
    with pytest.raises(Abandoned, match=f"key shares of '{gone}' do not recover the key it advertised"):
        server.close_unmask()
