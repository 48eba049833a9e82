"""A device's part of a secure round over its transport: the four stages of :mod:`fedge.secagg.device`.

When a round descriptor carries ``secagg`` (the coordinator's :mod:`fedge.coordinator.secure`), the device
trains as always, then, instead of uploading its arrays, turns them into its method's terms
(:func:`fedge.secagg.terms.device_terms`: clipped, weighted) and answers the coordinator's stage messages with
the same state machine the in-process simulation runs (:class:`~fedge.secagg.device.SecAggDevice`): keys →
shares → masked input → unmask answers. Its ``update`` message then carries its metrics only.

Whatever goes wrong — a stage message that does not come within the task's ``stage_s``, one the state machine
refuses (counted in :attr:`SecureOutcome.refusals`) — ends the device's part: the coordinator sees a dropout
and, past the threshold, sums the others. The device's values never leave it unmasked.

A coordinator restarted mid-round re-announces the round with a fresh secure sum (a new graph seed): the state
of the old one died with the process. While it waits for a stage message the device watches the descriptor
(``superseded``); when the round's task for it changes, its part of the old sum ends
(:attr:`SecureOutcome.superseded`) and the device runs the new sum's four stages with the same arrays, without
training again (:mod:`fedge.edge.agent`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.common.messages import Message
from fedge.common.transport import DeviceTransport
from fedge.errors import PayloadError
from fedge.secagg import terms
from fedge.secagg.device import SecAggDevice
from fedge.secagg.messages import Refusal
from fedge.secagg.rounds import SecureTask

log = logging.getLogger(__name__)

NO_DEADLINE_WAIT_S = 3600.0  # longest wait for the roster in a round without a deadline
POLL_S = 0.5  # how often a device waiting for a stage message looks for a superseding descriptor


class Superseded(Exception):
    """The round's secure sum was re-planned (a restarted coordinator re-announced the round)."""


@dataclass
class SecureOutcome:
    """How far this device's part went: the last stage it sent (``unmask``: all four), bytes each way."""

    sent: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    error: str = ""
    superseded: bool = False  # ended because the round's descriptor now plans another secure sum


def task_for(device_id: str, tasks: object) -> SecureTask | None:
    """The task of the group ``device_id`` belongs to in a descriptor's ``secagg`` entry (None: in no group)."""
    if not isinstance(tasks, dict):
        return None
    for entry in tasks.values():
        members = entry.get("setup", {}).get("members", []) if isinstance(entry, dict) else []
        if isinstance(members, list) and device_id in members:
            return SecureTask.from_dict(entry)
    return None


def task_seed(device_id: str, raw: bytes | None, rnd: int) -> bytes | None:
    """The graph seed of ``device_id``'s secure task in descriptor ``raw`` if it is of round ``rnd`` (None: another
    round, no task, or unreadable): what tells a re-planned secure sum from a re-announcement of the same one."""
    if not raw:
        return None
    try:
        msg = Message.from_bytes(raw)
        task = task_for(device_id, msg.info.get("secagg")) if msg.round == rnd else None
    except (PayloadError, Refusal):
        return None
    return None if task is None else task.setup.seed


def secure_upload(transport: DeviceTransport, device_id: str, task: SecureTask, arrays: Mapping[str, Any], *,
                  num_samples: int, wait_until: float = 0.0,
                  superseded: Callable[[], bool] | None = None) -> SecureOutcome:
    """Run this device's four stages of ``task`` over ``transport`` with its upload ``arrays``.

    ``wait_until``: unix seconds until which the roster may be awaited (the round's deadline: the slowest device
    trains until then; 0, no deadline: :data:`NO_DEADLINE_WAIT_S`), then ``task.stage_s`` more; every later
    stage message within ``task.stage_s``. ``superseded``, asked every :data:`POLL_S` while waiting: whether
    this sum was re-planned (the part then ends with :attr:`SecureOutcome.superseded`)."""
    out = SecureOutcome()
    values = terms.device_terms(task.method, {k: np.asarray(v) for k, v in arrays.items()}, num_samples=num_samples,
                                cap=task.cap, clip=task.clip)
    dev = SecAggDevice(device_id, task.setup)
    transport.clear_stages()  # left from an earlier round: the roster comes only after our keys

    def send(data: bytes, stage: str) -> None:
        transport.send_stage(data)
        out.bytes_up += len(data)
        out.sent = stage

    def receive(first: bool) -> bytes:
        # the roster comes once the slowest device has trained: until the round's deadline, and without one
        # (a simulation, or a coordinator that waits for every device) up to NO_DEADLINE_WAIT_S
        wait = (max(0.0, wait_until - time.time()) if wait_until else NO_DEADLINE_WAIT_S) if first else 0.0
        timeout = task.stage_s + wait
        end = time.monotonic() + timeout
        while True:
            if superseded is not None and superseded():
                raise Superseded("the round was re-announced with another secure sum (a restarted coordinator)")
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no stage message from the coordinator within {timeout:.0f} s")
            data = transport.receive_stage(min(left, POLL_S) if superseded is not None else left)
            if data is not None:
                break
        out.bytes_down += len(data)
        return data

    try:
        send(dev.advertise(), "keys")
        send(dev.share_keys(receive(True)), "shares")
        send(dev.masked_input(receive(False), values), "masked")
        send(dev.unmask(receive(False)), "unmask")
    except (Refusal, TimeoutError, Superseded) as exc:
        out.superseded = isinstance(exc, Superseded)
        out.error = str(getattr(exc, "message", exc))
        log.warning("%s: round %d: its secure-aggregation part ended after %r: %s", device_id, task.setup.round,
                    out.sent or "nothing", out.error)
    out.refusals.update(dev.refusals)
    return out
