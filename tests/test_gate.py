"""The update gate: every kind of bad device input of issue 12 is refused with its reason, counted per
device, and leaves the aggregate exactly as the honest devices make it (real engine, real FedProto
strategy, in-memory transport; the same cases over Mosquitto are in test_gate_mqtt.py)."""

from __future__ import annotations

import dataclasses
import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gate_helpers import CLASSES, DIM, FLEET, StatsFleet, device, expected_prototypes, hello, honest_arrays, stats_fleet

from fedge.common.boundedjson import loads, nesting_depth
from fedge.common.messages import PROTOCOL_VERSION, Message
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo
from fedge.common.tensorcodec import SchemaError, decode
from fedge.coordinator.config import DeviceSlotCheck
from fedge.coordinator.engine import EngineConfig
from fedge.errors import PayloadError
from fedge.mqtt.chunking import ChunkError, Reassembler, split

DEEP = 100_000
DEEP_HELLO = 20_000  # a hello is at most 64 KiB: deeper ones are refused as oversize before parsing


def raw_message(sender: str, rnd: int, tensors: dict[str, tuple[str, list[int], bytes]], *, kind: str = "update",
                info: str = "{}", header_extra: str = "") -> bytes:
    """A safetensors message written by hand, so the tests can declare anything a real encoder would not."""
    meta = {"fedge.v": PROTOCOL_VERSION, "fleet": FLEET, "round": str(rnd), "msg_id": f"{sender}-{rnd}-{len(info)}",
            "sender": sender, "kind": kind, "info": info, "fedge.precision": "int8"}
    entries, data, pos = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        data += raw
        pos += len(raw)
    header = json.dumps({"__metadata__": meta, **entries})
    if header_extra:
        header = header[:-1] + "," + header_extra + "}"
    hb = header.encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def int8_update(dev_id: str, rnd: int, scale_shape: list[int]) -> bytes:
    q = np.ones((CLASSES, DIM), np.int8).tobytes()
    scale = np.ones(scale_shape or [1], np.float32).reshape(scale_shape).tobytes()
    counts = np.full(CLASSES, 5, np.int64).tobytes()
    return raw_message(dev_id, rnd, {"protos": ("I8", [CLASSES, DIM], q),
                                     "__scale__/protos": ("F32", scale_shape, scale),
                                     "counts": ("I64", [CLASSES], counts)})


def update(dev_id: str, rnd: int, *, info: dict | None = None, **tensors: np.ndarray) -> bytes:
    dev = device(int(dev_id[1:]))
    arrays = {**honest_arrays(dev, rnd), **tensors}
    return Message("update", dev_id, rnd, FLEET, tensors=arrays, info=info or {}).to_bytes()


def assert_unharmed(fleet: StatsFleet, rnd: int = 1) -> None:
    protos, counts = expected_prototypes(fleet.devices, rnd)
    glob = fleet.engine.globals[PROTOTYPES_ARTIFACT]
    np.testing.assert_array_equal(glob["counts"], counts)
    np.testing.assert_allclose(glob["protos"], protos, rtol=1e-5, atol=1e-6)


def test_every_crash_case_of_issue_12_is_refused_with_its_reason(tmp_path: Path) -> None:
    deep = "[" * DEEP + "]" * DEEP
    bad_hellos = [
        hello(device(7, extra=[])),  # extra must be an object
        hello({**device(8).to_dict(), "extra": {"x": json.loads("[" * 5 + "]" * 5)}}),  # extra values: scalars
        raw_message("d9", 0, {}, kind="hello", info='{"device": ' + "[" * DEEP_HELLO + "]" * DEEP_HELLO + "}"),
        hello({**device(10).to_dict(), "num_samples": "x"}),
    ]
    fleet = stats_fleet(3, rounds=1, state_dir=tmp_path / "state", extra_hellos=bad_hellos)
    d0 = "d0"
    fleet.before[1] = [
        int8_update(d0, 1, [3]),                 # scale of shape (3,): dequantize would broadcast-fail
        int8_update(d0, 1, [40000, 1, 1]),       # scale that would broadcast to 40000 x 10 x 64
        raw_message(d0, 1, {}, header_extra='"x": ' + deep),           # header nested 100,000 deep
        raw_message(d0, 1, {}, info='{"a": ' + deep + "}"),            # info nested 100,000 deep
        raw_message(d0, 1, {}, info='{"a": ' + "[" * 600 + "]" * 600 + "}"),  # would break state saving
        update(d0, 1, info={"metrics": 5}),
        update(d0, 1, info={"bytes_down": "x"}),
        update(d0, 1, info={"metrics": {"acc_global": "x"}}),
        update(d0, 1, info={"num_samples": 10**9}),
        update(d0, 1, counts=np.full(CLASSES, 2**62, np.int64)),       # poisoning by weight
        update(d0, 1, counts=np.full(CLASSES, 2**63 - 1, np.int64)),   # int64 overflow of the sum
        update(d0, 1, counts=np.full(CLASSES, 11, np.int64)),          # 110 > d0's 100 samples
    ]
    report = fleet.engine.run_round(1)
    assert sorted(report.accepted) == ["d0", "d1", "d2"]
    assert report.rejected == {"hello-malformed": 4, "dtype": 1, "oversize": 1, "malformed": 3, "info": 4,
                               "counts": 3}
    # the in-memory transport vouches for no sender: an envelope that does not parse has none ("?")
    assert report.rejected_by_device == {
        "d0": {"dtype": 1, "oversize": 1, "info": 4, "counts": 3}, "?": {"malformed": 3, "hello-malformed": 1},
        "d7": {"hello-malformed": 1}, "d8": {"hello-malformed": 1}, "d10": {"hello-malformed": 1}}
    assert_unharmed(fleet)
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["completed"] == 1 and {d["device_id"] for d in saved["devices"]} == {"d0", "d1", "d2"}
    assert (tmp_path / "state" / "state.json").stat().st_mode & 0o777 == 0o600


def test_a_broadcasting_scale_is_refused_before_anything_is_allocated() -> None:
    data = int8_update("d0", 1, [40000, 1, 1])
    tracemalloc.start()
    with pytest.raises(SchemaError, match=r"__scale__/protos' must be a float32 scalar"):
        decode(data)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * len(data)  # dequantizing it would have allocated 40000 x 10 x 64 floats (102 MB)


def test_a_feature_dim_the_fleet_does_not_use_is_refused_at_hello() -> None:
    odd = device(5, feature_dim=32)
    fleet = stats_fleet(3, rounds=1, extra_hellos=[hello(odd)])
    fleet.devices.append(odd)  # it sends its (10, 32) update as well
    report = fleet.engine.run_round(1)
    assert report.rejected_by_device["d5"] == {"hello-feature_dim": 1, "unregistered": 1}
    fleet.devices.pop()
    assert_unharmed(fleet)


def test_bad_retained_hellos_do_not_stop_a_restarted_coordinator(tmp_path: Path) -> None:
    state = tmp_path / "state"
    junk = [hello(device(7, extra=[])), raw_message("d8", 0, {}, kind="hello", info="[" * DEEP_HELLO)]
    fleet = stats_fleet(3, rounds=2, state_dir=state, extra_hellos=junk)
    fleet.engine.run_round(1)
    # the broker hands the retained hellos to the restarted coordinator again
    again = stats_fleet(3, rounds=2, state_dir=state, extra_hellos=junk)
    assert again.engine.completed == 1
    reports = again.engine.run()
    assert [r.round for r in reports] == [1, 2, 3]
    assert reports[1].rejected == {"hello-malformed": 2} and len(reports[1].accepted) == 3


@pytest.mark.parametrize(("header", "reason"), [
    ('{"v": 1, "id": "ab", "seq": 1e999, "count": 2, "total": 10, "sha256": "' + "0" * 64 + '"}', "1e999"),
    ('{"v": 1, "id": "ab", "seq": 0, "count": 2, "total": 1e999, "sha256": "' + "0" * 64 + '"}', "1e999"),
    ('{"v": 1, "id": "ab", "seq": 1e300, "count": 2, "total": 10, "sha256": "' + "0" * 64 + '"}', "seq"),
    ('{"v": 1, "id": "ab", "seq": 0, "count": "2", "total": 10, "sha256": "' + "0" * 64 + '"}', "count"),
    ('{"v": 1, "id": ' + "[" * 2000 + "]" * 2000 + "}", "nested"),
])
def test_chunk_frames_with_absurd_headers_are_refused_and_counted(header: str, reason: str) -> None:
    reasm = Reassembler(1 << 20)
    h = header.encode()
    frame = b"FDGCHUNK" + struct.pack("<I", len(h)) + h + b"xx"
    with pytest.raises(ChunkError, match=reason) as err:
        reasm.add("d0", frame)
    assert err.value.reason == "malformed"


def test_a_bad_chunked_upload_is_counted_once_not_per_frame() -> None:
    reasm = Reassembler(1 << 20)
    frames = split(b"\x01" * 5000, 1024)
    bad = [bytearray(f) for f in frames]
    for f in bad:
        f[-1] ^= 1  # every part's checksum is wrong
    with pytest.raises(ChunkError, match="checksum"):
        reasm.add("d0", bytes(bad[0]))
    assert all(reasm.add("d0", bytes(f)) is None for f in bad[1:])  # the rest of that transfer: ignored


def test_bounded_json_refuses_depth_size_and_numbers_without_recursing() -> None:
    with pytest.raises(PayloadError, match="nested 100000 deep"):
        loads("[" * DEEP + "]" * DEEP, max_bytes=1 << 20, max_depth=8)
    with pytest.raises(PayloadError, match="out of range"):
        loads('{"seq": 1e999}', max_bytes=100, max_depth=8)
    with pytest.raises(PayloadError, match="exceeds the limit of 10 bytes"):
        loads('{"a": 12345678}', max_bytes=10, max_depth=8)
    assert loads('{"a": "[[[[[[[[[[", "b": [[1]]}', max_bytes=100, max_depth=3) == {"a": "[[[[[[[[[[", "b": [[1]]}
    # short documents are counted in Python, long ones with numpy: the same depths either way
    docs = (b"1", b'{"a": "[[[[", "b": [[1]]}', b"[" * 9 + b"]" * 9, b"[]" * 40, b'["]]]]", ["[["]]' * 20,
            b"[" * 60 + b"]" * 60, b"{" * 70 + b"}" * 70)
    assert [nesting_depth(d) for d in docs] == [0, 3, 9, 1, 2, 60, 70]


def test_a_hello_that_contradicts_its_slot_is_refused_and_the_device_is_told_why() -> None:
    devices = [device(i) for i in range(3)]
    slots = {d.device_id: DeviceSlotCheck(d, classes=tuple(range(CLASSES))) for d in devices}
    slots["d1"] = DeviceSlotCheck(devices[1], classes=tuple(range(CLASSES - 1)))  # d1 holds no class 9
    # a hello for d2 as a tier-s, int8, 629-sample device: its slot is a tier-xs, fp32, 120-sample one
    liar = device(2, arch="tier-s", upload_precision="int8", num_samples=629)
    fleet = stats_fleet(3, rounds=1, extra_hellos=[hello(liar)],
                        config=EngineConfig(fleet=FLEET, method="fedproto", slots=slots))
    d1_nine = honest_arrays(devices[1], 1)
    d1_nine["counts"] = np.zeros(CLASSES, np.int64)
    d1_nine["counts"][9] = 1
    fleet.before[1] = [Message("update", "d1", 1, FLEET, tensors=d1_nine).to_bytes()]
    del fleet.devices[1]  # d1 sends only that update
    report = fleet.engine.run_round(1)
    assert report.rejected_by_device == {"d2": {"hello-slot": 1}, "d1": {"classes": 1}}
    assert report.missing == ["d1"]
    refusal = Message.from_bytes(fleet.bus.refusals["d2"])
    assert refusal.kind == "refused" and refusal.info["reason"] == "slot"
    assert refusal.info["run"] == fleet.engine.run_id
    assert refusal.info["message"] == (
        "slot: d2's hello contradicts its slot in the fleet config: arch: expected 'tier-xs', got 'tier-s'; "
        "upload_precision: expected 'fp32', got 'int8'; num_samples: expected 120, got 629")
    assert fleet.engine.devices["d2"] == devices[2]  # its earlier, true hello stands
    assert_unharmed(fleet)
    # the device corrects itself: its next hello is accepted and the refusal is cleared
    fleet.bus.hellos.append(hello(devices[2]))
    fleet.engine.register_pending()
    assert "d2" not in fleet.bus.refusals


def test_the_slots_a_coordinator_checks_come_from_the_fleet_config(tmp_path: Path) -> None:
    """Benchmark data: every field of a device's hello is fixed by its slot. Own data: only its id,
    profile and embedding size (its model and precision follow a sample count only the device knows)."""
    from own_data_helpers import own_data_fleet

    from fedge.coordinator.config import OWN_DATA_FIELDS, SLOT_FIELDS, slot_checks
    from fedge.fleet.config import load_fleet
    from fedge.fleet.devices import build_devices, load_fleet_data
    from fedge.fleet.slots import checked_slots

    path = own_data_fleet(tmp_path / "own.toml", method="fedproto")
    own = load_fleet(path)
    checks = slot_checks(checked_slots(own), own_data=True)
    assert sorted(checks) == ["rpi4-2gb-1", "rpi4-2gb-2"]
    c = checks["rpi4-2gb-1"]
    assert (c.fields, c.classes, c.info.profile, c.info.feature_dim) == (OWN_DATA_FIELDS, None, "rpi4-2gb", 64)
    hello_ = DeviceInfo("rpi4-2gb-1", "tier-s", "rpi4-2gb", "int8", 37, 64, {})  # whatever its data made it
    assert c.mismatches(hello_) == []
    assert c.mismatches(dataclasses.replace(hello_, feature_dim=32, profile="x")) == [
        "profile: expected 'rpi4-2gb', got 'x'", "feature_dim: expected 64, got 32"]
    # the same fleet on benchmark data: the devices fedge builds say exactly what their slots say
    bench = dataclasses.replace(own, data=dataclasses.replace(own.data, classes=()))
    checks = slot_checks(checked_slots(bench), own_data=False)
    for dev in build_devices(bench, load_fleet_data(bench)):
        check = checks[dev.info.device_id]
        assert check.fields == SLOT_FIELDS and check.mismatches(dev.info) == []
        assert check.classes is not None and len(check.classes) >= 2


def test_the_fleets_embedding_size_is_counted_not_walked_and_a_devices_own_hello_does_not_bind_it() -> None:
    """The shared-feature check reads counted sizes (registering N devices was quadratic): the first device may
    change its own size by a new hello while it is alone, the second may not once two share one, and a restored
    registry counts as hellos would."""
    from fedge.common.transport import Inbound
    from fedge.coordinator.gate import UpdateGate
    from fedge.coordinator.strategies.fedproto import FedProtoStrategy

    def gate() -> UpdateGate:
        return UpdateGate(FedProtoStrategy(num_classes=CLASSES, rounds=1), EngineConfig(fleet=FLEET, method="fedproto"))

    def say(g: UpdateGate, dev: DeviceInfo) -> list[str]:
        return g.register([Inbound(hello(dev), dev.device_id)])

    g = gate()
    assert say(g, device(0)) == ["d0"]
    assert say(g, device(0, feature_dim=32)) == [] and g.devices["d0"].feature_dim == 32  # alone: its own hello
    assert say(g, device(1)) == [] and "d1" not in g.devices  # 64 against the fleet's 32: refused
    assert g.rejections.by_device["d1"] == {"hello-feature_dim": 1}
    assert say(g, device(1, feature_dim=32)) == ["d1"]
    assert say(g, device(0)) == [] and g.devices["d0"].feature_dim == 32  # d1 holds the fleet at 32 now
    restored = gate()
    restored.restore_devices({"d0": device(0), "d1": device(1)})
    assert say(restored, device(2, feature_dim=32)) == [] and say(restored, device(2)) == ["d2"]
