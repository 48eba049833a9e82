"""The safe tensor encoding: round trips, precision, and malformed input."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from fedge.common.messages import PROTOCOL_VERSION, Message
from fedge.common.tensorcodec import SCALE_PREFIX, Payload, decode, encode
from fedge.errors import PayloadError


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(16, 8)).astype(np.float32), "counts": np.arange(10, dtype=np.int64)}


def test_fp32_round_trip_is_exact_and_keeps_ints() -> None:
    arrays = _arrays()
    out = decode(encode(Payload(arrays, {"k": "v"}), "fp32"))
    np.testing.assert_array_equal(out.tensors["w"], arrays["w"])
    assert out.tensors["counts"].dtype == np.int64
    np.testing.assert_array_equal(out.tensors["counts"], arrays["counts"])
    assert out.meta == {"k": "v"}


@pytest.mark.parametrize(("precision", "tol", "raw_bytes"), [("fp16", 2e-3, 2), ("int8", 0.5 / 127, 1)])
def test_lower_precision_shrinks_and_bounds_error(precision: str, tol: float, raw_bytes: int) -> None:
    arrays = _arrays()
    data32 = encode(Payload(arrays), "fp32")
    data = encode(Payload(arrays), precision)
    out = decode(data).tensors["w"]
    assert out.dtype == np.float32
    # int8: error <= half a quantization step (scale = max|w|/127)
    bound = tol * np.abs(arrays["w"]).max()
    assert np.abs(out - arrays["w"]).max() <= bound + 1e-7
    # the float tensor's raw bytes shrink by exactly 4/raw_bytes; the header grows a little at most
    saved = arrays["w"].size * (4 - raw_bytes)
    assert len(data32) - len(data) >= saved - 200


def test_int8_scale_tensor_is_on_the_wire_but_not_decoded() -> None:
    data = encode(Payload({"w": np.ones((3,), np.float32)}), "int8")
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    assert SCALE_PREFIX + "w" in header and header["w"]["dtype"] == "I8"
    assert set(decode(data).tensors) == {"w"}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"abc", "too short"),
        (struct.pack("<Q", 1000) + b"{}", "truncated"),
        (struct.pack("<Q", 4) + b"nope", "not valid JSON"),
    ],
)
def test_malformed_payloads_name_the_problem(data: bytes, needle: str) -> None:
    with pytest.raises(PayloadError, match=needle):
        decode(data)


def test_oversize_is_rejected_before_parsing() -> None:
    data = encode(Payload({"w": np.zeros(1000, np.float32)}))
    with pytest.raises(PayloadError, match="exceeds the limit of 100 bytes"):
        decode(data, max_bytes=100)


def test_unknown_precision() -> None:
    with pytest.raises(PayloadError, match="unknown upload precision 'bf16'"):
        encode(Payload({}), "bf16")


def test_message_envelope_round_trip() -> None:
    msg = Message("update", "dev-1", 7, "fleet-a", tensors=_arrays(), info={"num_samples": 12})
    back = Message.from_bytes(msg.to_bytes())
    envelope = (back.kind, back.sender, back.round, back.fleet, back.msg_id)
    assert envelope == ("update", "dev-1", 7, "fleet-a", msg.msg_id)
    assert back.info == {"num_samples": 12}


def test_message_rejects_other_protocol_version() -> None:
    data = encode(Payload({}, {"fedge.v": "99", "round": "1", "msg_id": "x", "sender": "a", "kind": "update"}))
    with pytest.raises(PayloadError, match=f"this is {PROTOCOL_VERSION}"):
        Message.from_bytes(data)


def test_message_rejects_missing_envelope_fields() -> None:
    with pytest.raises(PayloadError, match=r"lacks .*msg_id"):
        Message.from_bytes(encode(Payload({}, {"fedge.v": PROTOCOL_VERSION, "round": "1", "sender": "a",
                                               "kind": "update"})))
