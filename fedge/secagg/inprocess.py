"""One group's secure sum with every device in this process: the four stages, in order, with optional losses.

What the in-process simulation and the benchmark run: the same state machines as over a network, their
messages carried as bytes from one to the other. ``lost`` says which devices stop answering from which stage on
(a device lost at ``"shares"`` advertised keys and then vanished), the dropouts the protocol must survive.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from fedge.secagg.device import SecAggDevice
from fedge.secagg.messages import RoundSetup
from fedge.secagg.server import SecAggServer

# The stage from which a lost device sends nothing more.
LOSS_STAGES = ("keys", "shares", "masked", "unmask")


@dataclass
class SecureSum:
    """A finished group sum: the decoded sums per segment, whose inputs they hold, and the bytes each sent."""

    sums: dict[str, np.ndarray]
    survivors: list[str]
    bytes_up: dict[str, int] = field(default_factory=dict)  # device -> bytes of its four stage messages
    bytes_down: dict[str, int] = field(default_factory=dict)  # device -> bytes the coordinator sent it


def run_group(setup: RoundSetup, inputs: Mapping[str, Mapping[str, np.ndarray]], *,
              lost: Mapping[str, Collection[str]] | None = None,
              on_device: Callable[[str, SecAggDevice], None] | None = None,
              server: SecAggServer | None = None) -> SecureSum:
    """Run one group's secure sum over ``inputs`` (device -> its arrays by segment name).

    ``lost`` maps a stage of :data:`LOSS_STAGES` to the devices that send nothing from it on; a device not in
    ``inputs`` is lost from the start. Raises :class:`~fedge.secagg.server.Abandoned` when too few remain.
    ``server`` lets the caller keep the coordinator's state machine (its refusals) and hand in messages itself."""
    lost = lost or {}
    gone: set[str] = set(setup.members) - set(inputs)
    srv = server or SecAggServer(setup)
    devices = {m: SecAggDevice(m, setup) for m in setup.members if m in inputs}
    if on_device is not None:
        for m, d in devices.items():
            on_device(m, d)
    up = dict.fromkeys(devices, 0)
    down = dict.fromkeys(devices, 0)

    def send(stage: str, make: Callable[[str], bytes], to: Collection[str]) -> None:
        gone.update(lost.get(stage, ()))
        for m in sorted(to):
            if m in gone or m not in devices:
                continue
            data = make(m)
            up[m] += len(data)
            srv.receive(m, data)

    def deliver(out: dict[str, bytes]) -> dict[str, bytes]:
        for m, data in out.items():
            if m in down:
                down[m] += len(data)
        return out

    send("keys", lambda m: devices[m].advertise(), devices)
    rosters = deliver(srv.close_keys())
    send("shares", lambda m: devices[m].share_keys(rosters[m]), rosters)
    inboxes = deliver(srv.close_shares())
    send("masked", lambda m: devices[m].masked_input(inboxes[m], inputs[m]), inboxes)
    requests = deliver(srv.close_masked())
    send("unmask", lambda m: devices[m].unmask(requests[m]), requests)
    sums = srv.close_unmask()
    return SecureSum(sums, srv.survivors, up, down)
