"""The coordinator half of secure aggregation: a pure state machine that learns only the survivors' sum.

A :class:`SecAggServer` runs one group's secure sum in one round. The carrier (the round loop, a transport)
hands it every stage message with :meth:`receive` and, at each stage's deadline (or when all arrived), calls the
stage's ``close_*``, which returns what to send to each device:

* :meth:`close_keys` → each device's ``roster`` (U1: the devices that advertised keys);
* :meth:`close_shares` → each device's ``inbox`` (U2: the devices that sent their shares);
* :meth:`close_masked` → the ``unmask-request`` (U3: the devices whose masked input arrived — the survivors —
  and U2 \\ U3, the dropped);
* :meth:`close_unmask` → the survivors' sum: Σ y over U3, minus each survivor's self-mask PRG(b_i) (b_i from
  its neighbours' seed shares), minus the pairwise masks survivors still hold with each dropped device (its
  ``s`` key from its neighbours' key shares, checked against the public key it advertised).

At any stage, fewer than ``threshold`` devices, or a secret that fewer than ``threshold`` shares reach, abandons
the round: :class:`Abandoned` is raised, nothing is summed, and the caller's state is left as it was.
Refused messages are counted by reason in :attr:`refusals` and never change the state.

Behind relays (:mod:`fedge.secagg.partial`) the masked inputs of a shard's devices arrive as one sum:
:meth:`receive_sum` adds a relay's ``masked-sum`` to the running total and counts its devices as survivors, as
if each had sent its masked input here; what it cannot be — another field or length, a device counted already or
listed twice, one that sent no shares, one outside the relay's shard — is refused whole (a sum cannot be taken
apart). Neither the relay nor this state machine ever holds one device's unmasked input.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from fedge.errors import FedgeError
from fedge.secagg import crypto, graph, shamir
from fedge.secagg import messages as msg
from fedge.secagg.device import COORDINATOR, pairwise_mask
from fedge.secagg.messages import Refusal, RoundSetup

log = logging.getLogger(__name__)


class Abandoned(FedgeError):
    """A group's secure sum could not complete (too few devices or shares); nothing of it was aggregated."""


class SecAggServer:
    """One group's secure sum in one round (see the module docstring)."""

    def __init__(self, setup: RoundSetup) -> None:
        self.setup = setup
        self.graph = {m: set(ns) for m, ns in graph.neighbours(setup.members, setup.degree, setup.seed).items()}
        self.stage = "keys"
        self.refusals: Counter[str] = Counter()
        self.keys: dict[str, tuple[bytes, bytes]] = {}  # U1: device -> (c public key, s public key)
        self.shares: dict[str, dict[str, str]] = {}  # U2: sender -> receiver -> sealed share (base64, opaque)
        self.masked: dict[str, str] = {}  # U3: device -> who delivered its masked input (itself, or a relay)
        self.total: np.ndarray | None = None  # Σ y over U3, kept running instead of every upload
        self.unmasks: dict[str, tuple[dict[str, int], dict[str, int]]] = {}  # responder -> (seed, key shares)
        self.last_refusal: Refusal | None = None  # why the latest refused message was (a carrier reports it)

    # -- receiving -------------------------------------------------------------------------------------------
    def receive(self, sender: str, data: bytes) -> bool:
        """Take one stage message from ``sender`` (the transport's word for who sent it); False if refused."""
        try:
            if sender not in self.graph:
                raise Refusal("unknown-sender", f"{sender[:64]!r} is not a member of group {self.setup.group!r}")
            if self.stage == "keys":
                self._keys(sender, msg.decode(self.setup, data, "keys", sender))
            elif self.stage == "shares":
                self._shares(sender, msg.decode(self.setup, data, "shares", sender))
            elif self.stage == "masked":
                self._masked(sender, data)
            elif self.stage == "unmask":
                self._unmask(sender, msg.decode(self.setup, data, "unmask", sender))
            else:
                raise Refusal("late", f"a message from {sender!r} after the round's sum was {self.stage}")
        except Refusal as r:
            self._refused(r)
            return False
        return True

    def receive_sum(self, relay: str, data: bytes, allowed: Collection[str] | None = None) -> list[str]:
        """Take relay ``relay``'s sum of its devices' masked inputs; ``allowed``: the devices it may speak for
        (its shard's, None: any member). Returns the devices it sums; none if refused (counted; nothing of it
        is kept)."""
        try:
            if self.stage != "masked":
                reason = "stage" if self.stage in ("keys", "shares") else "late"
                raise Refusal(reason, f"a masked sum from {relay[:64]!r} while the round's sum is at {self.stage}")
            devices, words = msg.decode_masked_sum(self.setup, data, relay)
            outside = sorted(d for d in devices if allowed is not None and d not in allowed)
            if outside:
                raise Refusal("foreign", f"{relay!r} sums {outside[0]!r}, a device outside its shard")
            twice = sorted(d for d in devices if d in self.masked)
            if twice:
                raise Refusal("duplicate", f"{relay!r} sums {twice[0]!r}, whose masked input was counted already "
                                           f"(from {self.masked[twice[0]]!r})")
            absent = sorted(d for d in devices if d not in self.shares)
            if absent:
                raise Refusal("unknown-sender", f"{relay!r} sums {absent[0]!r}, which shared no keys this round")
        except Refusal as r:
            self._refused(r)
            return []
        for d in devices:
            self.masked[d] = relay
        self._add(words)
        return devices

    def _refused(self, r: Refusal) -> None:
        self.refusals[r.reason] += 1
        self.last_refusal = r
        log.warning("group %s round %d: refused %s", self.setup.group, self.setup.round, r.message)

    def _add(self, words: np.ndarray) -> None:
        self.total = words.copy() if self.total is None else self.setup.plan.reduce(self.total + words)

    def _once(self, sender: str, seen: Mapping[str, Any], allowed: Collection[str], stage: str) -> None:
        if sender in seen:
            raise Refusal("duplicate", f"a second {stage} message from {sender!r} (replayed?)")
        if sender not in allowed:
            raise Refusal("unknown-sender", f"{sender!r} sends {stage} but took no part in the previous stage")

    def _keys(self, sender: str, doc: dict[str, Any]) -> None:
        self._once(sender, self.keys, self.graph, "keys")
        c_pk, s_pk = msg.unb64(doc.get("c_pk"), "c_pk", 32), msg.unb64(doc.get("s_pk"), "s_pk", 32)
        if c_pk == s_pk or any(s_pk in pair or c_pk in pair for pair in self.keys.values()):
            raise Refusal("forged", f"{sender!r} advertises a key already in use this round")
        self.keys[sender] = (c_pk, s_pk)

    def _shares(self, sender: str, doc: dict[str, Any]) -> None:
        self._once(sender, self.shares, self.keys, "shares")
        sealed = msg.str_map(doc, "shares")
        want = self.graph[sender] & set(self.keys)
        if set(sealed) != want:
            raise Refusal("inconsistent", f"{sender!r} sends shares to {len(sealed)} devices, its neighbours that "
                                          f"advertised keys are {len(want)}")
        size = crypto.NONCE_BYTES + 16 + 2 * shamir.VALUE_BYTES
        for receiver, text in sealed.items():
            msg.unb64(text, f"share for {receiver}", size)  # well-formed; only the receiver can open it
        self.shares[sender] = sealed

    def _masked(self, sender: str, data: bytes) -> None:
        self._once(sender, self.masked, self.shares, "masked")
        words = msg.decode_masked(self.setup, data, sender)
        self.masked[sender] = sender
        self._add(words)

    def _unmask(self, sender: str, doc: dict[str, Any]) -> None:
        self._once(sender, self.unmasks, self.masked, "unmask")
        survivors, dropped = set(self.masked), set(self.shares) - set(self.masked)
        holds = self.graph[sender] & set(self.shares)  # the neighbours whose shares it received
        seeds, keys = msg.str_map(doc, "seeds"), msg.str_map(doc, "keys")
        if not set(seeds) <= (holds | {sender}) & survivors or not set(keys) <= holds & dropped:
            raise Refusal("inconsistent", f"{sender!r} returns shares it holds none of, or of the wrong kind")
        self.unmasks[sender] = ({p: shamir.value_from(msg.unb64(v, "seed share")) for p, v in seeds.items()},
                                {p: shamir.value_from(msg.unb64(v, "key share")) for p, v in keys.items()})

    # -- closing stages ----------------------------------------------------------------------------------------
    def _enough(self, count: int, what: str) -> None:
        if count < self.setup.threshold:
            self.stage = "abandoned"
            raise Abandoned(f"group {self.setup.group!r} round {self.setup.round}: {count} {what}, "
                            f"fewer than the threshold {self.setup.threshold}; the round's sum is abandoned",
                            hint="lower [privacy] threshold, or give the round more time")

    def close_keys(self) -> dict[str, bytes]:
        """End stage 1: each device of U1 gets the keys of its neighbours in U1."""
        self._enough(len(self.keys), "devices advertised keys")
        self.stage = "shares"
        return {d: msg.encode(self.setup, "roster", COORDINATOR, {"keys": {
            p: [msg.b64(self.keys[p][0]), msg.b64(self.keys[p][1])] for p in sorted(self.graph[d]) if p in self.keys}})
            for d in self.keys}

    def close_shares(self) -> dict[str, bytes]:
        """End stage 2: each device of U2 gets the shares its neighbours in U2 sealed for it."""
        self._enough(len(self.shares), "devices shared keys")
        self.stage = "masked"
        return {d: msg.encode(self.setup, "inbox", COORDINATOR, {"shares": {
            s: self.shares[s][d] for s in sorted(self.graph[d]) if s in self.shares}}) for d in self.shares}

    def close_masked(self) -> dict[str, bytes]:
        """End stage 3: every survivor gets the same request (survivors U3, dropped U2 \\ U3)."""
        self._enough(len(self.masked), "devices sent masked input")
        self.stage = "unmask"
        body = {"survivors": sorted(self.masked), "dropped": sorted(set(self.shares) - set(self.masked))}
        return {d: msg.encode(self.setup, "unmask-request", COORDINATOR, body) for d in self.masked}

    def close_unmask(self) -> dict[str, np.ndarray]:
        """End stage 4: the survivors' sum, decoded per segment (float64); :class:`Abandoned` if a secret is out
        of reach. :attr:`survivors` says whose sum it is."""
        self._enough(len(self.unmasks), "devices answered the unmask request")
        plan, setup = self.setup.plan, self.setup
        assert self.total is not None
        total = self.total.copy()
        for dev in sorted(self.masked):
            seed = self._recover(dev, 0)
            total -= crypto.expand(seed, plan.length, plan.bits)
        for gone in sorted(set(self.shares) - set(self.masked)):
            s_raw = self._recover(gone, 1)
            if crypto.public_key(s_raw) != self.keys[gone][1]:
                self.stage = "abandoned"
                raise Abandoned(f"group {setup.group!r} round {setup.round}: the key shares of {gone!r} do not "
                                "recover the key it advertised (forged shares); the round's sum is abandoned")
            s_sk = crypto.private_key(s_raw)
            for peer in sorted(self.graph[gone] & set(self.masked)):
                # the peer added ±PRG(s_{peer,gone}); derive it from the dropped device's side and remove it
                total += pairwise_mask(setup, s_sk, gone, peer, self.keys[peer][1])
        self.stage = "done"
        return plan.decode_sum(plan.reduce(total), len(self.masked))

    @property
    def survivors(self) -> list[str]:
        """The devices whose inputs the sum holds (U3)."""
        return sorted(self.masked)

    def _recover(self, device: str, which: int) -> bytes:
        """The seed (``which`` 0) or s key (1) of ``device`` from the shares the responders returned."""
        shares = [(self.setup.number(r), parts[which][device]) for r, parts in self.unmasks.items()
                  if device in parts[which]]
        if len(shares) < self.setup.threshold:
            self.stage = "abandoned"
            raise Abandoned(f"group {self.setup.group!r} round {self.setup.round}: {len(shares)} shares of "
                            f"the {'seed' if which == 0 else 'mask key'} of {device!r}, fewer than the threshold "
                            f"{self.setup.threshold}; the round's sum is abandoned")
        try:
            return shamir.combine(shares, self.setup.threshold)
        except FedgeError as exc:
            self.stage = "abandoned"
            raise Abandoned(f"group {self.setup.group!r}: {exc.message}") from exc

