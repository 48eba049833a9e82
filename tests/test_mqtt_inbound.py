"""One inbound path (``fedge.mqtt.inbound``): the coordinator transport, the relay and the aggregation worker
classify what arrives the same way, and refuse it the same way: counted by reason, logged at a bounded rate."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from broker_helpers import wait_until
from gate_helpers import FLEET
from scaleout_helpers import FAST, engine_config, strategy

from fedge.common.messages import Message
from fedge.common.signing import Signer
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.chunking import Reassembler, split
from fedge.mqtt.client import MqttClient
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.inbound import InboundClassifier, RefusalLog
from fedge.mqtt.settings import MAX_HELLO_BYTES, TransportStats
from fedge.mqtt.topics import FleetTopics
from fedge.scaleout.aggregator import PartialAggregator
from fedge.scaleout.relay import Relay
from fedge.scaleout.worker import AggregationWorker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def classifier(clock: Clock | None = None, max_bytes: int = 1 << 20) -> InboundClassifier:
    stats = TransportStats()
    return InboundClassifier(RefusalLog("tester", stats, interval_s=60.0, clock=clock or Clock()),
                             Reassembler(max_bytes))


def test_refusals_are_counted_every_time_and_logged_once_a_minute_per_reason(caplog: pytest.LogCaptureFixture
                                                                             ) -> None:
    clock = Clock()
    c = classifier(clock)
    caplog.set_level(logging.WARNING, logger="fedge.mqtt.inbound")
    big = b"x" * (MAX_HELLO_BYTES + 1)
    for _ in range(5):
        assert c.hello("d1", big, 1.0) is None
    retained = c.upload("d2", b"update", True, 1.0)
    assert retained is not None and retained.reject is not None and retained.reject[0] == "retained"
    clock.now += 59.0
    c.hello("d1", big, 1.0)  # still within the minute: counted, not logged
    clock.now += 2.0
    c.hello("d1", big, 1.0)
    assert c.refusals.stats.rejected == {"hello-oversize": 7, "retained": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"tester refused hello-oversize: a {MAX_HELLO_BYTES + 1}-byte hello from d1 (at most {MAX_HELLO_BYTES} bytes)",
        "tester refused retained: a retained update from d2 (the protocol never retains one)",
        f"tester refused hello-oversize: a {MAX_HELLO_BYTES + 1}-byte hello from d1 (at most {MAX_HELLO_BYTES} "
        "bytes) (5 more refused since the last such line)"]


def test_uploads_hellos_and_descriptors_are_classified_once() -> None:
    c = classifier(max_bytes=10_000)
    msg = Message("update", "d1", 3, FLEET, tensors={"w": np.ones(1500, np.float32)}).to_bytes()
    assert c.hello("d1", b"", 1.0) is None  # a cleared retained hello
    assert c.hello("d1", b"hi", 2.0).data == b"hi"  # type: ignore[union-attr]
    whole = c.upload("d1", msg, False, 2.0)
    assert whole is not None and (whole.data, whole.origin, whole.kind, whole.reject) == (msg, "d1", "update", None)
    frames = split(msg, 2048)
    assert len(frames) > 2 and [c.upload("w1", f, False, 3.0, kind="partial") for f in frames[:-1]] == \
        [None] * (len(frames) - 1)
    done = c.upload("w1", frames[-1], False, 3.0, kind="partial")
    assert done is not None and (done.data, done.kind) == (msg, "partial")
    refused = c.upload("d1", frames[0], False, 3.0, chunks=False, chunks_refused="send whole messages")
    assert refused is not None and refused.reject == ("chunked", "d1's update arrived in chunks; send whole messages")
    # a round descriptor: read inside its signed frame; a bad one refused
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    desc = Message("round", "coordinator", 4, FLEET, info={"round": {"phase": "final", "deadline": 12.5}})
    read = c.descriptor(Signer(Ed25519PrivateKey.generate()).seal("fedge/t/rounds/current", desc.to_bytes()))
    assert read is not None and (read.msg.round, read.final, read.deadline) == (4, True, 12.5)
    assert c.descriptor(b"garbage") is None
    assert c.refusals.stats.rejected == {"chunked": 1, "descriptor": 1}


def test_an_oversized_hello_is_refused_the_same_way_by_coordinator_relay_and_worker(
        mosquitto: MosquittoProcess, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedge.mqtt.inbound")
    parent = MosquittoProcess()
    parent.start()
    coord = MqttCoordinatorTransport(mosquitto.settings(), FLEET, FAST).start()
    worker = AggregationWorker(mosquitto.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "w1"),
                               settings=FAST).start()
    relay = Relay(mosquitto.settings(), parent.settings(), FLEET,
                  PartialAggregator(strategy(), engine_config(), "relay-1"), settings=FAST).start()
    sender = MqttClient(mosquitto.settings(), "sender").start()
    topics = FleetTopics(FLEET)
    try:
        big = b"h" * (MAX_HELLO_BYTES + 1)
        sender.wait_published([sender.publish(topics.hello(f"big-{i}"), big) for i in range(3)], 30)
        counted = {"coordinator": coord.stats.rejected, "relay": relay.down_stats.rejected,
                   "worker": worker.stats.rejected}
        assert wait_until(lambda: all(c.get("hello-oversize") == 3 for c in counted.values()), 30), counted
        assert coord.hellos() == []  # dropped: nothing registers
    finally:
        sender.stop()
        relay.stop()
        worker.stop()
        coord.close()
        parent.close()
    lines = sorted(r.getMessage() for r in caplog.records if "hello-oversize" in r.getMessage())
    # one line each (the bounded rate: the two after the first are counted, not logged), naming who refused
    assert [line.split(" refused ")[0] for line in lines] == [f"coordinator of {FLEET!r}", "relay relay-1",
                                                              "worker w1"]
    assert all(f"a {MAX_HELLO_BYTES + 1}-byte hello from big-" in line for line in lines)
