"""The device half of secure aggregation: a pure state machine, bytes in, bytes out.

A :class:`SecAggDevice` is made per round from the group's :class:`~fedge.secagg.messages.RoundSetup` and is
driven through the four stages by whatever carries its messages (the in-process round, MQTT):

1. :meth:`advertise` — two fresh X25519 key pairs: ``c`` encrypts shares, ``s`` seeds the pairwise masks;
2. :meth:`share_keys` (the coordinator's ``roster``) — a fresh self-mask seed b; Shamir shares of b and of the
   ``s`` private key for every neighbour (and itself), each sealed with the key agreed with that neighbour;
3. :meth:`masked_input` (its ``inbox``) — y = x + PRG(b) + Σ ±PRG(s_ij) over the neighbours j that shared keys,
   mod 2^k (+ when this device's id sorts first, − otherwise: each pair's masks cancel in the sum);
4. :meth:`unmask` (the ``unmask-request``) — for each neighbour that survived, its share of b; for each that
   dropped after sharing, its share of the ``s`` key. Never both for one device: the request's two lists must
   be disjoint, and a device answers once.

Whatever a message from the coordinator gets wrong raises :class:`~fedge.secagg.messages.Refusal` (counted in
:attr:`refusals`): the device then stops, which the coordinator sees as a dropout.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedge.secagg import crypto, graph, shamir
from fedge.secagg import messages as msg
from fedge.secagg.messages import Refusal, RoundSetup

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"  # the sender a device expects the coordinator's stage messages from


def pairwise_mask(setup: RoundSetup, private: X25519PrivateKey, me: str, peer: str, peer_public: bytes) -> np.ndarray:
    """The mask the pair (``me``, ``peer``) shares: PRG of their agreed seed, as ``me`` adds it (its sign
    applied: + when ``me`` sorts before ``peer``; the words' two's complement otherwise)."""
    seed = crypto.agree(private, peer_public, "mask", crypto.pair_context(setup.round, setup.group, me, peer))
    mask = crypto.expand(seed, setup.plan.length, setup.plan.bits)
    return mask if me < peer else setup.plan.reduce(np.negative(mask))


class SecAggDevice:
    """One device's part of one group's secure sum in one round (see the module docstring)."""

    def __init__(self, device_id: str, setup: RoundSetup) -> None:
        if device_id not in setup.members:
            raise Refusal("unknown-sender", f"{device_id!r} is not a member of group {setup.group!r}")
        self.id = device_id
        self.setup = setup
        self.neighbours = set(graph.neighbours(setup.members, setup.degree, setup.seed)[device_id])
        self.stage = "keys"
        self.refusals: Counter[str] = Counter()
        self.peers: dict[str, tuple[bytes, bytes]] = {}  # neighbour -> (c public key, s public key)
        self.received: dict[str, tuple[int, int]] = {}  # neighbour -> (its s-key share, its seed share) for me
        self.own: tuple[int, int] = (0, 0)  # my shares of my own s key and seed

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            self._refuse(Refusal("stage", f"{stage!r} asked of a device at stage {self.stage!r}"))

    def _refuse(self, refusal: Refusal) -> None:
        self.refusals[refusal.reason] += 1
        self.stage = "stopped"
        log.warning("device %s: %s", self.id, refusal.message)
        raise refusal

    def advertise(self) -> bytes:
        """Stage 1: the ``keys`` message (fresh key pairs, kept for this round only)."""
        self._expect("keys")
        self.s_raw = crypto.new_private_key()  # raw: it is Shamir-shared
        self.c_sk, self.s_sk = crypto.private_key(crypto.new_private_key()), crypto.private_key(self.s_raw)
        self.stage = "roster"
        return msg.encode(self.setup, "keys", self.id, {"c_pk": msg.b64(crypto.public_bytes(self.c_sk)),
                                                        "s_pk": msg.b64(crypto.public_bytes(self.s_sk))})

    def share_keys(self, roster: bytes) -> bytes:
        """Stage 2: the ``shares`` message, given the coordinator's ``roster`` of this device's neighbours."""
        self._expect("roster")
        try:
            doc = msg.decode(self.setup, roster, "roster", COORDINATOR)
            for peer, pair in msg.str_map(doc, "keys").items():
                if peer not in self.neighbours:
                    raise Refusal("unknown-sender", f"roster names {peer[:64]!r}, not a neighbour of {self.id}")
                if not isinstance(pair, list) or len(pair) != 2:
                    raise Refusal("malformed", f"roster entry of {peer!r} must be [c_pk, s_pk]")
                self.peers[peer] = (msg.unb64(pair[0], "c_pk", 32), msg.unb64(pair[1], "s_pk", 32))
            if len(self.peers) + 1 < self.setup.threshold:
                raise Refusal("inconsistent", f"{len(self.peers)} neighbours advertised keys; "
                                              f"{self.setup.threshold - 1} are needed")
        except Refusal as r:
            self._refuse(r)
        self.b = os.urandom(shamir.SECRET_BYTES)
        holders = [*sorted(self.peers), self.id]
        xs = [self.setup.number(h) for h in holders]
        s_shares = shamir.split(self.s_raw, self.setup.threshold, xs)
        b_shares = shamir.split(self.b, self.setup.threshold, xs)
        sealed = {}
        for holder, (_, s_y), (_, b_y) in zip(holders, s_shares, b_shares, strict=True):
            if holder == self.id:
                self.own = (s_y, b_y)
                continue
            key = crypto.agree(self.c_sk, self.peers[holder][0], "share",
                               crypto.pair_context(self.setup.round, self.setup.group, self.id, holder))
            plain = shamir.value_bytes(s_y) + shamir.value_bytes(b_y)
            sealed[holder] = msg.b64(crypto.seal(key, plain, crypto.share_context(
                self.setup.round, self.setup.group, self.id, holder)))
        self.stage = "inbox"
        return msg.encode(self.setup, "shares", self.id, {"shares": sealed})

    def masked_input(self, inbox: bytes, arrays: Mapping[str, np.ndarray]) -> bytes:
        """Stage 3: the ``masked`` payload of ``arrays`` (by segment name), given this device's ``inbox``."""
        self._expect("inbox")
        try:
            doc = msg.decode(self.setup, inbox, "inbox", COORDINATOR)
            for peer, text in msg.str_map(doc, "shares").items():
                if peer not in self.peers:
                    raise Refusal("unknown-sender", f"a share from {peer[:64]!r}, no neighbour with keys")
                self.received[peer] = self._open(peer, msg.unb64(text, f"share from {peer}"))
            if len(self.received) + 1 < self.setup.threshold:
                raise Refusal("inconsistent", f"{len(self.received)} neighbours shared keys; "
                                              f"{self.setup.threshold - 1} are needed")
        except Refusal as r:
            self._refuse(r)
        plan = self.setup.plan
        y = plan.encode(arrays) + crypto.expand(self.b, plan.length, plan.bits)
        for peer in self.received:  # exactly the neighbours that shared keys: the coordinator removes the same
            y += pairwise_mask(self.setup, self.s_sk, self.id, peer, self.peers[peer][1])
        self.stage = "unmask-request"
        return msg.encode_masked(self.setup, self.id, plan.reduce(y))

    def _open(self, peer: str, sealed: bytes) -> tuple[int, int]:
        """(s-key share, seed share) that ``peer`` sealed for this device; ``forged`` if it fails to open."""
        key = crypto.agree(self.c_sk, self.peers[peer][0], "share",
                           crypto.pair_context(self.setup.round, self.setup.group, self.id, peer))
        try:
            plain = crypto.open_sealed(key, sealed, crypto.share_context(self.setup.round, self.setup.group, peer,
                                                                         self.id))
        except crypto.DecryptError as exc:
            raise Refusal("forged", f"share from {peer!r}: {exc.message}") from exc
        n = shamir.VALUE_BYTES
        if len(plain) != 2 * n:
            raise Refusal("malformed", f"share from {peer!r} holds {len(plain)} bytes")
        return shamir.value_from(plain[:n]), shamir.value_from(plain[n:])

    def unmask(self, request: bytes) -> bytes:
        """Stage 4: the ``unmask`` message: seed shares of surviving neighbours, key shares of dropped ones."""
        self._expect("unmask-request")
        try:
            doc = msg.decode(self.setup, request, "unmask-request", COORDINATOR)
            survivors, dropped = set(msg.str_list(doc, "survivors")), set(msg.str_list(doc, "dropped"))
            if survivors & dropped:
                raise Refusal("inconsistent", f"devices both survived and dropped: {sorted(survivors & dropped)[:5]}")
            if self.id not in survivors or len(survivors) < self.setup.threshold:
                raise Refusal("inconsistent", f"{len(survivors)} survivors (this device among them: "
                                              f"{self.id in survivors}); at least {self.setup.threshold} are needed")
            if not dropped <= set(self.setup.members) or not survivors <= set(self.setup.members):
                raise Refusal("unknown-sender", "the request names devices outside the group")
        except Refusal as r:
            self._refuse(r)
        seeds = {p: shamir.value_bytes(b) for p, (_, b) in self.received.items() if p in survivors}
        seeds[self.id] = shamir.value_bytes(self.own[1])
        keys = {p: shamir.value_bytes(s) for p, (s, _) in self.received.items() if p in dropped}
        self.stage = "done"
        return msg.encode(self.setup, "unmask", self.id, {"seeds": {p: msg.b64(v) for p, v in seeds.items()},
                                                           "keys": {p: msg.b64(v) for p, v in keys.items()}})
