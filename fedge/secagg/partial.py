"""A relay's part of secure aggregation: forward the stages untouched, sum its devices' masked inputs.

Behind a relay (:mod:`fedge.scaleout.relay`) a shard's devices run the same four stages as on one broker; the
relay carries them without reading what it must not:

* **stage messages** — ``keys``, ``shares``, ``unmask`` up (device → coordinator) and ``roster``, ``inbox``,
  ``unmask-request`` down — go through byte for byte: their shares are sealed end to end between devices, and
  what the coordinator sends stays signed;
* **masked inputs** are not forwarded: :class:`RelaySums` checks each (the round's field and length, a member of
  the group, once) and adds it to its group's running sum modulo 2^k, and a child relay's ``masked-sum`` the
  same way. :meth:`RelaySums.flush` turns what was added since the last flush into one ``masked-sum`` per group
  (:func:`fedge.secagg.messages.encode_masked_sum`), which the relay sends to its parent.

A sum of masked inputs is still masked: each device's self-mask PRG(b_i) is in it, and the pairwise masks cancel
only in the group's total, so the relay (which sees masked inputs) and its parent (which sees sums) learn no
device's values. The coordinator's :meth:`~fedge.secagg.server.SecAggServer.receive_sum` counts the listed
devices as survivors and removes their masks with the shares their neighbours return, as for devices on its own
broker. A device whose masked input arrives after its relay flushed goes up in a later sum of the same round
(the devices of two sums never overlap); one refused here is counted in :attr:`RelaySums.refusals` and never
forwarded (the coordinator sees it as dropped after sharing).
"""

from __future__ import annotations

import logging
import struct
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from fedge.secagg import messages as msg
from fedge.secagg.messages import Refusal, RoundSetup
from fedge.secagg.rounds import SecureTask

log = logging.getLogger(__name__)


@dataclass
class GroupSum:
    """One group's running sum of masked inputs at a relay in one round."""

    setup: RoundSetup
    total: np.ndarray | None = None  # Σ y over the devices added since the last flush, mod 2^k
    pending: list[str] = field(default_factory=list)  # the devices in ``total``
    counted: set[str] = field(default_factory=set)  # every device added this round (flushed or not)

    def add(self, devices: list[str], words: np.ndarray) -> None:
        self.total = words.copy() if self.total is None else self.setup.plan.reduce(self.total + words)
        self.pending += devices
        self.counted.update(devices)


def is_masked(data: bytes) -> bool:
    """Whether ``data`` is laid out as a masked input (a safetensors payload: 8-byte header length, then the JSON
    header) rather than a JSON stage message."""
    if len(data) < 10 or data[8:9] != b"{":
        return False
    (hlen,) = struct.unpack("<Q", data[:8])
    return hlen <= len(data) - 8


class RelaySums:
    """Relay ``name``'s secure sums of one round at a time (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.round = 0
        self.groups: dict[str, GroupSum] = {}
        self.member_of: dict[str, str] = {}  # device -> its group this round
        self.shared: set[str] = set()  # devices whose shares this relay forwarded: each owes a masked input
        self.refusals: Counter[str] = Counter()
        self.last_refusal: Refusal | None = None
        self.last_added = 0.0  # monotonic time of the latest masked input or sum added

    @property
    def active(self) -> bool:
        """Whether the current round sums anything securely."""
        return bool(self.groups)

    def begin(self, rnd: int, secagg: object) -> bool:
        """Round ``rnd``'s descriptor, whose ``secagg`` entry (group -> task) says what is summed; True if it is a
        new round here. A task that does not parse is skipped (its devices' messages are forwarded, the
        coordinator refuses them)."""
        if rnd == self.round:
            return False
        self.round, self.groups, self.member_of, self.shared = rnd, {}, {}, set()
        for group, entry in (secagg.items() if isinstance(secagg, dict) else ()):
            try:
                task = SecureTask.from_dict(entry)
            except Refusal as r:
                log.warning("relay %s: round %d group %s: %s", self.name, rnd, str(group)[:40], r.message)
                continue
            self.groups[task.setup.group] = GroupSum(task.setup)
            self.member_of.update(dict.fromkeys(task.setup.members, task.setup.group))
        return True

    # -- what arrives on the shard ---------------------------------------------------------------
    def upward(self, device: str, data: bytes) -> bytes | None:
        """A stage message from ``device`` (the shard's topic names it): the bytes to forward to the parent
        untouched, or None when it was a masked input (summed here) or refused (counted)."""
        group = self.member_of.get(device)
        if group is None or not is_masked(data):
            if group is not None:
                try:  # its shares: it owes a masked input (whatever else it is, the coordinator checks it)
                    msg.decode(self.groups[group].setup, data, "shares", device)
                    self.shared.add(device)
                except Refusal:
                    pass
            return data
        try:
            gs = self.groups[group]
            words = msg.decode_masked(gs.setup, data, device)
            if device in gs.counted:
                raise Refusal("duplicate", f"a second masked input from {device!r} (replayed?)")
        except Refusal as r:
            self._refused(r)
            return None
        gs.add([device], words)
        self.last_added = time.monotonic()
        return None

    def child_sum(self, child: str, data: bytes, allowed: Collection[str] | None) -> bool:
        """Child relay ``child``'s ``masked-sum``, added to its group's sum; ``allowed``: the devices it may
        speak for (None: any member). False if refused (counted)."""
        try:
            group = msg.masked_group(data)
            gs = self.groups.get(group)
            if gs is None:
                raise Refusal("round", f"a masked sum of group {group[:40]!r} from {child!r}, which round "
                                       f"{self.round} does not sum here")
            devices, words = msg.decode_masked_sum(gs.setup, data, child)
            outside = sorted(d for d in devices if allowed is not None and d not in allowed)
            if outside:
                raise Refusal("foreign", f"{child!r} sums {outside[0]!r}, a device outside its shard")
            twice = sorted(set(devices) & gs.counted)
            if twice:
                raise Refusal("duplicate", f"{child!r} sums {twice[0]!r}, whose masked input was counted already")
        except Refusal as r:
            self._refused(r)
            return False
        gs.add(devices, words)
        self.last_added = time.monotonic()
        return True

    def _refused(self, r: Refusal) -> None:
        self.refusals[r.reason] += 1
        self.last_refusal = r
        log.warning("relay %s round %d: refused %s", self.name, self.round, r.message)

    # -- what goes up ----------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether a flush would send something."""
        return any(gs.pending for gs in self.groups.values())

    def waiting(self) -> set[str]:
        """The devices whose shares this relay forwarded and whose masked input (theirs, or in a child's sum)
        has not arrived yet."""
        counted = set().union(*(gs.counted for gs in self.groups.values())) if self.groups else set()
        return self.shared - counted

    def flush(self) -> list[bytes]:
        """Each group's sum of what was added since the last flush, as a ``masked-sum`` (none: nothing new)."""
        out = []
        for gs in self.groups.values():
            if gs.pending and gs.total is not None:
                out.append(msg.encode_masked_sum(gs.setup, self.name, gs.pending, gs.total))
                log.info("relay %s round %d: the masked sum of %d device(s) of group %s", self.name, self.round,
                         len(gs.pending), gs.setup.group)
            gs.total, gs.pending = None, []
        return out
