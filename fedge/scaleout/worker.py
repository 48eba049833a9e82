"""An aggregation worker over MQTT: ``fedge coordinator worker``.

Several workers share a fleet's update stream through an MQTT 5 **shared subscription**
(``$share/{group}/fedge/{fleet}/devices/+/update``): the broker hands each update to one member of the
group. Each worker registers every device from its retained hello (the coordinator's checks, from the
same fleet config), runs the update gate and the strategy's streaming ``accumulate`` over its share
(:class:`~fedge.scaleout.aggregator.PartialAggregator`), and every ``flush_s`` sends what it
accumulated as one ``partial`` to ``fedge/{fleet}/partials/{its account}``, where the coordinator
(started with ``--workers``, so it does not read the updates itself) merges it.

Updates must arrive whole: the broker distributes each MQTT message on its own, so the chunk frames
of one update would land on different workers. A chunk frame is refused (``chunked``) with the fix:
run the fleet with a ``--chunk-bytes`` above its largest update (and the broker's ``max_packet_size``
with it), or aggregate large models with relays instead (docs/scale.md).
"""

from __future__ import annotations

import logging
import threading
import time

from fedge.mqtt.chunking import Reassembler, split
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.inbound import InboundClassifier, RefusalLog
from fedge.mqtt.settings import TransportSettings, TransportStats
from fedge.mqtt.topics import FleetTopics, shared
from fedge.scaleout.aggregator import PartialAggregator

log = logging.getLogger(__name__)

DEFAULT_GROUP = "fedge-workers"


class AggregationWorker:
    """One member of a shared-subscription group of aggregation workers (see the module docstring)."""

    def __init__(self, broker: BrokerSettings, fleet: str, aggregator: PartialAggregator, *,
                 group: str = DEFAULT_GROUP, flush_s: float = 0.05, settings: TransportSettings | None = None) -> None:
        self.topics = FleetTopics(fleet)
        self.aggregator = aggregator
        self.name = aggregator.name
        self.flush_s = flush_s
        self.settings = settings or TransportSettings()
        self.stats = TransportStats()
        # hellos, updates and descriptors, as the coordinator and relays read them (refusals in stats.rejected);
        # a worker reads whole updates only: it has no reassembler's worth of chunks to hold
        self.inbound = InboundClassifier(RefusalLog(f"worker {self.name}", self.stats), Reassembler(0))
        self.updates_in = 0  # updates this worker received (its share)
        self._lock = threading.Lock()  # the aggregator: dispatcher thread (inbound) and flusher (outbound)
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._round_id: str | None = None
        self.client = MqttClient(broker, self.name, clean_session=True, mqtt5=True, on_message=self._on_message)
        self.subscription = shared(group, self.topics.device_filter("update"))
        self.client.subscribe(self.subscription)
        self.client.subscribe(self.topics.device_filter("hello"))
        self.client.subscribe(self.topics.round)

    def start(self) -> AggregationWorker:
        self.client.start(self.settings.connect_timeout_s)
        self._flusher = threading.Thread(target=self._flush_loop, name=f"flush-{self.name}", daemon=True)
        self._flusher.start()
        log.info("worker %s reads %s and sends partials to %s", self.name, self.subscription,
                 self.topics.partial(self.name))
        return self

    # -- inbound (the client's dispatcher thread) ---------------------------------------------
    def _on_message(self, m: Received) -> None:
        self.stats.messages_in += 1
        self.stats.bytes_in += len(m.payload)
        if m.topic == self.topics.round:
            self._on_round(m.payload)
            return
        t = self.topics.parse_device(m.topic)
        if t is None or not m.payload:
            return
        if t.kind == "hello":
            hello = self.inbound.hello(t.device_id, m.payload, m.received)
            if hello is not None:
                with self._lock:
                    self.aggregator.register([hello])
            return
        if t.kind != "update":
            return
        self.updates_in += 1
        item = self.inbound.upload(t.device_id, m.payload, m.retain, m.received, chunks=False, chunks_refused=(
            "shared-subscription workers need whole messages: raise --chunk-bytes above the fleet's largest "
            "update, or use relays"))
        if item is not None:
            with self._lock:
                self.aggregator.admit(item)

    def _on_round(self, raw: bytes) -> None:
        if not raw:
            return
        # a signed descriptor (docs/protocol.md section 11) is read inside its frame: a worker only counts
        read = self.inbound.descriptor(raw)
        if read is None:
            return
        msg, rnd, final = read.msg, read.round, read.final
        if msg.msg_id == self._round_id:
            return
        self._round_id = msg.msg_id
        with self._lock:
            leftover = self.aggregator.flush() if msg.round != self.aggregator.round else None
            self.aggregator.begin(msg.round, final=final, descriptor=msg.msg_id,
                                  sampled=self.aggregator.sampled_of(rnd))
        if leftover is not None:
            self._send(leftover)

    # -- outbound -----------------------------------------------------------------------------
    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            with self._lock:
                data = self.aggregator.flush()
            if data is not None:
                self._send(data)

    def _send(self, data: bytes) -> None:
        frames = split(data, self.settings.chunk_bytes)
        for f in frames:
            self.client.publish(self.topics.partial(self.name), f)
            self.stats.count_out(len(f))

    def flush_now(self) -> None:
        """Send what accumulated (tests; a clean stop)."""
        with self._lock:
            data = self.aggregator.flush()
        if data is not None:
            self._send(data)

    def run_forever(self) -> None:
        """Block until :meth:`stop` (or SIGTERM in the command)."""
        while not self._stop.wait(1.0):
            pass

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(5)
        self.flush_now()
        time.sleep(0)  # let paho take the last publish before the DISCONNECT
        self.client.stop()
