"""Fuzzing the coordinator's error boundary: 10,000+ mutated hellos, updates and chunk frames through the
in-memory transport into the real engine (FedProto, fleet slots, real chunk reassembly), from a seeded
mutator. Nothing may raise; every message is accepted as valid or refused with a reason and counted.
(A smaller sample over Mosquitto, with statuses, is in test_gate_mqtt.py.)"""

from __future__ import annotations

import json
import logging
import struct
from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
from gate_helpers import CLASSES, FLEET, StatsFleet, device, hello, honest_update, stats_fleet

from fedge.common.messages import Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT
from fedge.coordinator.config import DeviceSlotCheck
from fedge.coordinator.engine import EngineConfig
from fedge.coordinator.validation import parse_device
from fedge.mqtt.chunking import ChunkError, Reassembler, frame_kind, split

T = TypeVar("T")
NASTY: list[object] = [1e308, -1, 2**63, 2**64 + 1, "x", "", [], {}, None, True, 0, 1.5, -(10**30), "[" * 50,
                       [[[[[[[[[[1]]]]]]]]]], {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}},
                       "1e999", 10**40, "../../etc", "\u0000\ud7ff"]


class Mutator:
    """Seeded mutations of a valid message: raw bytes, its JSON header, its envelope info."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, seq: Sequence[T]) -> T:
        return seq[int(self.rng.integers(len(seq)))]

    def __call__(self, data: bytes) -> bytes:
        op = int(self.rng.integers(6))
        if op == 0:  # flip a few bytes anywhere
            b = bytearray(data)
            for _ in range(int(self.rng.integers(1, 9))):
                b[int(self.rng.integers(len(b)))] = int(self.rng.integers(256))
            return bytes(b)
        if op == 1:  # truncate or extend
            cut = int(self.rng.integers(len(data) + 1))
            return data[:cut] if self.rng.random() < 0.5 else data + self.rng.bytes(int(self.rng.integers(1, 64)))
        return self.structured(data, op)

    def structured(self, data: bytes, op: int) -> bytes:
        if frame_kind(data) != "message" or len(data) < 8:
            return self.frame(data)
        (hlen,) = struct.unpack("<Q", data[:8])
        try:
            header = json.loads(data[8 : 8 + hlen])
        except ValueError:
            return data
        body = data[8 + hlen :]
        meta = header.setdefault("__metadata__", {})
        if op == 2:  # a metadata field gets a nasty string
            meta[str(self.pick(["round", "sender", "kind", "fleet", "msg_id", "fedge.v", "info"]))] = str(
                self.pick(NASTY))
        elif op == 3:  # a key of info (or of its nested device / metrics) gets a nasty value
            try:
                info = json.loads(meta.get("info", "{}"))
            except ValueError:
                info = {}
            target = info
            for sub in ("device", "metrics", "extra"):
                if isinstance(target.get(sub), dict) and self.rng.random() < 0.5:
                    target = target[sub]
            keys = [*target, "num_samples", "bytes_down", "metrics", "extra", "feature_dim", "acc_global"]
            target[str(self.pick(keys))] = self.pick(NASTY)
            meta["info"] = json.dumps(info)
        else:  # a tensor entry's dtype, shape or offsets
            names = [k for k in header if k != "__metadata__"]
            if not names:
                header[str(self.pick(["protos", "__scale__/protos", "w"]))] = {
                    "dtype": "F32", "shape": [int(self.rng.integers(0, 5))], "data_offsets": [0, 0]}
            else:
                entry = header[str(self.pick(names))]
                field = str(self.pick(["dtype", "shape", "data_offsets"]))
                entry[field] = self.pick([*NASTY, "I8", "F64", "BOOL", [3], [40000, 1, 1], [10, 32], [0, 10**12]])
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + body

    def frame(self, data: bytes) -> bytes:
        (hlen,) = struct.unpack("<I", data[8:12]) if len(data) >= 12 else (0,)
        try:
            h = json.loads(data[12 : 12 + hlen])
        except ValueError:
            return data
        h[str(self.pick(["seq", "count", "total", "id", "sha256", "part_sha256", "v"]))] = self.pick(NASTY)
        raw = json.dumps(h).encode()
        return data[:8] + struct.pack("<I", len(raw)) + raw + data[12 + hlen :]


def feed(fleet: StatsFleet, reasm: Reassembler, frames: list[bytes]) -> tuple[int, int]:
    """Queue chunk frames as the MQTT transport does: reassembled into whole updates, or refused
    (the transport hands a refused frame to the engine as ``Inbound(reject=...)``; here it is counted).
    Returns (whole updates queued, frames refused)."""
    whole_count = refused = 0
    for data in frames:
        try:
            whole = reasm.add("fuzzer", data)
        except ChunkError:
            refused += 1
            continue
        if whole is not None:
            fleet.bus.updates.append(whole)
            whole_count += 1
    return whole_count, refused


def test_ten_thousand_mutated_messages_never_crash_the_engine_and_are_all_accounted_for() -> None:
    logging.getLogger("fedge.coordinator.gate").setLevel(logging.ERROR)  # 10,000 warnings: keep the run fast
    try:
        _fuzz(rounds=20, per_round=720)
    finally:
        logging.getLogger("fedge.coordinator.gate").setLevel(logging.NOTSET)


def _fuzz(rounds: int, per_round: int) -> None:
    n = 4
    devices = [device(i) for i in range(n)]
    slots = {d.device_id: DeviceSlotCheck(d, tuple(range(CLASSES))) for d in devices}
    cfg = EngineConfig(fleet=FLEET, method="fedproto", slots=slots, allowed_devices=frozenset(slots))
    fleet = stats_fleet(n, rounds=rounds - 1, config=cfg)
    mutate = Mutator(seed=12)
    reasm = Reassembler(1 << 20)
    sent = Counter({"hellos": n})  # the fleet's own hellos
    queued: Counter[str] = Counter()

    def pump() -> None:
        rnd = fleet.engine.gate._round
        base = [honest_update(d, rnd) for d in devices] + [honest_update(d, rnd, "int8") for d in devices]
        hellos = [mutate(hello(d)) for d in devices for _ in range(per_round // 10 // n)]
        updates = [mutate(mutate.pick(base)) for _ in range(per_round // 2)]
        frames = []
        for _ in range(per_round // 4 // 5):
            parts = split(mutate.pick(base), 1024)
            frames += [mutate(f) if mutate.rng.random() < 0.5 else f for f in parts]
        fleet.bus.hellos.extend(hellos)
        fleet.bus.updates.extend(updates)
        whole, refused = feed(fleet, reasm, frames)
        sent.update(hellos=len(hellos), updates=len(updates), frames=len(frames))
        queued.update(updates=len(updates) + whole, frames_refused=refused)
        if rnd == rounds:  # the final round: metrics only
            honest = [Message("update", d.device_id, rnd, FLEET, info={"metrics": {"acc_global": 1.0}}).to_bytes()
                      for d in devices]
        else:
            honest = [honest_update(d, rnd) for d in devices]
        fleet.bus.updates.extend(honest)  # last: a valid mutation may have taken a device's place already
        queued.update(updates=len(honest))

    fleet.bus.pump = pump
    reports = fleet.engine.run()  # must not raise
    assert len(reports) == rounds
    assert sum(sent.values()) >= 10_000, sent
    update_outcomes = sum(len(r.accepted) + sum(v for k, v in r.rejected.items() if not k.startswith("hello-"))
                          for r in reports)
    assert update_outcomes == queued["updates"]  # every update that reached the engine: accepted or refused
    hello_refusals = sum(v for r in reports for k, v in r.rejected.items() if k.startswith("hello-"))
    assert hello_refusals + fleet.engine.gate.hellos_accepted == sent["hellos"]
    assert hello_refusals > 0.5 * sent["hellos"] and queued["frames_refused"] > 0
    for rep in reports:
        assert sum(sum(c.values()) for c in rep.rejected_by_device.values()) == sum(rep.rejected.values())
        assert sorted(rep.accepted) == sorted(slots)  # one update per fleet device per round, nobody else
    for dev in fleet.engine.devices.values():  # whatever registered is a valid hello matching its slot
        assert parse_device(dev.to_dict()) == dev and slots[dev.device_id].mismatches(dev) == []
    glob = fleet.engine.globals[PROTOTYPES_ARTIFACT]
    assert np.all(np.isfinite(glob["protos"])) and int(glob["counts"].sum()) <= sum(d.num_samples for d in devices)
