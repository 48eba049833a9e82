"""Secure aggregation's building blocks (fedge.secagg): fixed point, Shamir, the primitives, the graph, messages."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from fedge.errors import ConfigError, PayloadError
from fedge.secagg import crypto, graph, shamir
from fedge.secagg import messages as msg
from fedge.secagg.fixedpoint import Segment, plan_field
from fedge.secagg.messages import Refusal, RoundSetup


# -- fixed point ----------------------------------------------------------------------------------------------
def test_field_is_chosen_from_the_group_size_and_sums_never_wrap() -> None:
    seg = Segment("w", (1000,), 8.0)
    assert plan_field(100, [seg]).bits == 32  # 2^32 / 100 levels: step 2^-25.6 of the range
    assert plan_field(5000, [seg]).bits == 64  # 2^32 / 5000 is coarser than 2^-20
    plan = plan_field(100, [seg])
    # every device at the top of the range: the worst case for overflow
    top = plan.encode({"w": np.full(1000, 1e9)})
    total = np.zeros(1000, dtype=np.uint64)
    for _ in range(100):
        total += top
    assert int(total.max()) < 2**32  # the sum fits the field: mod 2^32 is the integer sum
    sums = plan.decode_sum(total.astype(np.uint32), 100)
    assert np.allclose(sums["w"], 800.0, atol=plan.max_error(seg))  # clipped to 8 each


def test_fixed_point_sum_is_within_the_stated_error() -> None:
    rng = np.random.default_rng(1)
    segs = [Segment("a", (50, 3), 2.0), Segment("b", (7,), 100.0)]
    plan = plan_field(30, segs, 32)
    xs = [{"a": rng.uniform(-2, 2, (50, 3)), "b": rng.uniform(-100, 100, 7)} for _ in range(30)]
    total = np.zeros(plan.length, dtype=plan.dtype)
    for x in xs:
        total += plan.encode(x)
    got = plan.decode_sum(total, 30)
    for seg in segs:
        err = np.abs(got[seg.name] - sum(x[seg.name] for x in xs)).max()
        assert err <= plan.max_error(seg) and plan.max_error(seg) < 1e-4 * seg.clip
    # values outside the range are clipped on the device, non-finite ones count as 0
    one = plan.decode_sum(plan.encode({"a": np.full((50, 3), np.inf), "b": np.full(7, -1e6)}), 1)
    assert np.allclose(one["a"], 0.0, atol=1e-6) and np.allclose(one["b"], -100.0, atol=1e-5)


def test_a_field_too_small_for_the_group_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"group 'tier-m'.*16-bit field summing 100 devices") as err:
        plan_field(100, [Segment("w", (3,), 1.0)], 16, group="tier-m")
    assert "field_bits >= 19" in str(err.value)
    assert plan_field(100, [Segment("w", (3,), 1.0)], 19).bits == 19  # the hint is the smallest that works
    with pytest.raises(ConfigError, match="field_bits must be 0"):
        plan_field(10, [Segment("w", (3,), 1.0)], 70)
    with pytest.raises(ConfigError, match="finite number > 0"):
        plan_field(10, [Segment("w", (3,), 0.0)])
    narrow = plan_field(3, [Segment("w", (4,), 1.0)], 20)  # not a word size: reduced mod 2^20 explicitly
    assert narrow.reduce(np.array([2**20 + 5], dtype=np.uint32))[0] == 5


# -- Shamir -----------------------------------------------------------------------------------------------------
def test_any_threshold_shares_recover_the_secret_and_fewer_do_not() -> None:
    secret = os.urandom(32)
    shares = shamir.split(secret, 4, [3, 5, 8, 9, 11, 12])
    assert shamir.combine(shares[:4], 4) == secret
    assert shamir.combine(shares[2:], 4) == secret
    with pytest.raises(PayloadError, match="3 shares cannot recover"):
        shamir.combine(shares[:3], 4)
    # an altered share gives another secret (the coordinator checks a recovered key against its public key);
    # a random one almost surely gives no 32-byte value at all
    altered = [*shares[:3], (shares[3][0], (shares[3][1] + 1) % shamir.PRIME)]
    assert shamir.combine(altered, 4) != secret
    forged = [*shares[:3], (shares[3][0], int.from_bytes(os.urandom(65), "big"))]
    with pytest.raises(PayloadError, match="do not recover a 32-byte secret"):
        shamir.combine(forged, 4)
    y = shares[0][1]
    assert shamir.value_from(shamir.value_bytes(y)) == y
    with pytest.raises(PayloadError, match="below the field's prime"):
        shamir.value_from(b"\xff" * shamir.VALUE_BYTES)


# -- primitives ---------------------------------------------------------------------------------------------------
def test_both_ends_agree_and_no_third_party_opens_a_share() -> None:
    a, b, c = (crypto.new_private_key() for _ in range(3))
    ka, kb, kc = (crypto.private_key(k) for k in (a, b, c))
    ab = crypto.agree(ka, crypto.public_key(b), "share", "1|g|a|b")
    assert ab == crypto.agree(kb, crypto.public_bytes(ka), "share", "1|g|a|b")
    assert ab != crypto.agree(ka, crypto.public_key(b), "mask", "1|g|a|b")  # purposes never share a key
    sealed = crypto.seal(ab, b"share", crypto.share_context(1, "g", "a", "b"))
    assert crypto.open_sealed(ab, sealed, crypto.share_context(1, "g", "a", "b")) == b"share"
    ac = crypto.agree(kc, crypto.public_key(a), "share", "1|g|a|b")  # c tries with its own key
    for key, ctx in ((ac, crypto.share_context(1, "g", "a", "b")), (ab, crypto.share_context(2, "g", "a", "b")),
                     (ab, crypto.share_context(1, "g", "b", "a"))):
        with pytest.raises(crypto.DecryptError):
            crypto.open_sealed(key, sealed, ctx)
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(crypto.DecryptError):
        crypto.open_sealed(ab, tampered, crypto.share_context(1, "g", "a", "b"))


def test_mask_stream_is_deterministic_per_seed_and_sized_to_the_field() -> None:
    seed = os.urandom(32)
    m = crypto.expand(seed, 1000, 32)
    assert m.dtype == np.uint32 and np.array_equal(m, crypto.expand(seed, 1000, 32))
    assert not np.array_equal(m, crypto.expand(os.urandom(32), 1000, 32))
    assert crypto.expand(seed, 10, 64).dtype == np.uint64
    assert int(crypto.expand(seed, 5000, 20).max()) < 2**20


# -- graph --------------------------------------------------------------------------------------------------------
def test_neighbour_ring_is_symmetric_logarithmic_and_follows_the_seed() -> None:
    members = [f"d{i:03d}" for i in range(200)]
    k = graph.default_degree(200)
    assert k == 8 * math.ceil(math.log2(200)) == 64
    ns = graph.neighbours(members, k, b"round-1")
    assert all(len(v) == k for v in ns.values())
    assert all(m in ns[p] for m, v in ns.items() for p in v)  # symmetric
    assert ns == graph.neighbours(list(reversed(members)), k, b"round-1")  # from the setup alone
    assert ns != graph.neighbours(members, k, b"round-2")  # a fresh ring each round
    small = graph.neighbours(members[:5], graph.default_degree(5), b"x")
    assert all(len(v) == 4 for v in small.values())  # a small group is complete
    assert graph.default_threshold(k) == 33


# -- messages -----------------------------------------------------------------------------------------------------
def _setup(members: tuple[str, ...] = ("a", "b", "c")) -> RoundSetup:
    plan = plan_field(len(members), [Segment("w", (10,), 1.0)])
    return RoundSetup(3, "tier-s", members, 2, 2, plan, b"seed")


def test_setup_round_trips_and_malformed_setups_are_refused() -> None:
    s = _setup()
    assert RoundSetup.from_dict(s.to_dict()) == s
    bad = {**s.to_dict(), "members": ["b", "a", "c"]}
    with pytest.raises(Refusal, match="malformed") as err:
        RoundSetup.from_dict(bad)
    assert err.value.reason == "malformed"
    with pytest.raises(Refusal) as err:
        RoundSetup.from_dict({**s.to_dict(), "v": 99})
    assert err.value.reason == "version"


@pytest.mark.parametrize(("data", "reason"), [
    (b"x" * 5000, "oversize"),
    (b'{"v": 1, "stage": ', "malformed"),
    (b"[1, 2]", "malformed"),
    (b'{"v": 2, "stage": "keys", "round": 3, "group": "tier-s", "sender": "a"}', "version"),
    (b'{"v": 1, "stage": "unmask", "round": 3, "group": "tier-s", "sender": "a"}', "stage"),
    (b'{"v": 1, "stage": "keys", "round": 2, "group": "tier-s", "sender": "a"}', "round"),
    # the same round and group, another sum of it: from before the coordinator restarted (b"seed" is 73656564)
    (b'{"v": 1, "stage": "keys", "round": 3, "group": "tier-s", "sum": "0011223344556677", "sender": "a"}', "round"),
    (b'{"v": 1, "stage": "keys", "round": 3, "group": "tier-s", "sum": "73656564", "sender": "b"}', "spoofed"),
])
def test_a_bad_stage_message_is_refused_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(Refusal) as err:
        msg.decode(_setup(), data, "keys", "a")
    assert err.value.reason == reason


def test_masked_input_must_be_exactly_the_fields_vector() -> None:
    s = _setup()
    words = np.arange(10, dtype=np.uint32)
    data = msg.encode_masked(s, "a", words)
    assert np.array_equal(msg.decode_masked(s, data, "a"), words)
    with pytest.raises(Refusal) as err:
        msg.decode_masked(s, msg.encode_masked(s, "a", np.arange(11, dtype=np.uint32)), "a")
    assert err.value.reason == "shape"
    with pytest.raises(Refusal) as err:
        msg.decode_masked(s, data, "b")
    assert err.value.reason == "spoofed"
    with pytest.raises(Refusal) as err:
        msg.decode_masked(s, data[:-3], "a")
    assert err.value.reason == "malformed"
    with pytest.raises(Refusal) as err:
        msg.decode_masked(s, msg.encode_masked(s, "a", np.arange(10, dtype=np.uint64)), "a")
    assert err.value.reason == "shape"
