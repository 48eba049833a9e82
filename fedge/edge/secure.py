"""A device's part of a secure round over its transport: the four stages of :mod:`fedge.secagg.device`.

When a round descriptor carries ``secagg`` (the coordinator's :mod:`fedge.coordinator.secure`), the device
trains as always, then, instead of uploading its arrays, turns them into its method's terms
(:func:`fedge.secagg.terms.device_terms`: clipped, weighted) and answers the coordinator's stage messages with
the same state machine the in-process simulation runs (:class:`~fedge.secagg.device.SecAggDevice`): keys →
shares → masked input → unmask answers. Its ``update`` message then carries its metrics only.

Whatever goes wrong — a stage message that does not come within the task's ``stage_s``, one the state machine
refuses (counted in :attr:`SecureOutcome.refusals`) — ends the device's part: the coordinator sees a dropout
and, past the threshold, sums the others. The device's values never leave it unmasked.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.common.transport import DeviceTransport
from fedge.secagg import terms
from fedge.secagg.device import SecAggDevice
from fedge.secagg.messages import Refusal
from fedge.secagg.rounds import SecureTask

log = logging.getLogger(__name__)

NO_DEADLINE_WAIT_S = 3600.0  # longest wait for the roster in a round without a deadline


@dataclass
class SecureOutcome:
    """How far this device's part went: the last stage it sent (``unmask``: all four), bytes each way."""

    sent: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    error: str = ""


def task_for(device_id: str, tasks: object) -> SecureTask | None:
    """The task of the group ``device_id`` belongs to in a descriptor's ``secagg`` entry (None: in no group)."""
    if not isinstance(tasks, dict):
        return None
    for entry in tasks.values():
        members = entry.get("setup", {}).get("members", []) if isinstance(entry, dict) else []
        if isinstance(members, list) and device_id in members:
            return SecureTask.from_dict(entry)
    return None


def secure_upload(transport: DeviceTransport, device_id: str, task: SecureTask, arrays: Mapping[str, Any], *,
                  num_samples: int, wait_until: float = 0.0) -> SecureOutcome:
    """Run this device's four stages of ``task`` over ``transport`` with its upload ``arrays``.

    ``wait_until``: unix seconds until which the roster may be awaited (the round's deadline: the slowest device
    trains until then; 0, no deadline: :data:`NO_DEADLINE_WAIT_S`), then ``task.stage_s`` more; every later
    stage message within ``task.stage_s``."""
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
        data = transport.receive_stage(timeout)
        if data is None:
            raise TimeoutError(f"no stage message from the coordinator within {timeout:.0f} s")
        out.bytes_down += len(data)
        return data

    try:
        send(dev.advertise(), "keys")
        send(dev.share_keys(receive(True)), "shares")
        send(dev.masked_input(receive(False), values), "masked")
        send(dev.unmask(receive(False)), "unmask")
    except (Refusal, TimeoutError) as exc:
        out.error = str(getattr(exc, "message", exc))
        log.warning("%s: round %d: its secure-aggregation part ended after %r: %s", device_id, task.setup.round,
                    out.sent or "nothing", out.error)
    out.refusals.update(dev.refusals)
    return out
