"""Statistics-only FedProto devices over real MQTT, for the scale-out tests (workers, relays, shards).

Each device is fedge's real device transport (``MqttDeviceTransport``: status and last-will, retained
hello, descriptor, cached update resent when a round is re-announced) with a thread that answers every
round with the seeded update of ``tests.gate_helpers`` — no model, so the expected aggregate is exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from gate_helpers import CLASSES, FLEET, device, hello, honest_update

from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.signing import Signer, Verifier
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.coordinator.strategies.fedproto import FedProtoStrategy
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.settings import TransportSettings

FAST = TransportSettings(connect_timeout_s=20, offline_confirm_s=0.2, status_grace_s=2.0, publish_timeout_s=30)


@dataclass
class StatsDevice:
    """One device: its transport and the thread answering rounds."""

    info: DeviceInfo
    transport: MqttDeviceTransport
    answered: list[int] = field(default_factory=list)
    delay: dict[int, float] = field(default_factory=dict)  # round -> seconds to wait before answering it
    gate: threading.Event | None = None  # set: it may answer (a test orders its messages before the updates)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def run(self) -> None:
        last: tuple[str, int] | None = None
        while not self.stop.is_set():
            self.transport.wait_for_round(0.2)
            raw = self.transport.current_round()
            if not raw:
                continue
            msg = Message.from_bytes(raw)
            key = (str(msg.info.get("run")), msg.round)
            if key == last:
                continue
            last = key
            final = msg.info["round"]["phase"] == "final"
            if self.stop.wait(self.delay.get(msg.round, 0.0)):
                return
            while self.gate is not None and not self.gate.wait(0.1):
                if self.stop.is_set():
                    return
            if final:
                data = Message("update", self.info.device_id, msg.round, FLEET,
                               info={"metrics": {"acc_global": 0.5}, "num_samples": self.info.num_samples}).to_bytes()
            else:
                data = honest_update(self.info, msg.round)
            self.transport.send_update(data)
            self.answered.append(msg.round)
            if final:
                return


def start_devices(brokers: Callable[[DeviceInfo], BrokerSettings], ids: range,
                  delay: dict[str, dict[int, float]] | None = None,
                  fleet_key: Ed25519PublicKey | None = None, gate: threading.Event | None = None) -> list[StatsDevice]:
    """Devices ``d{i}`` for ``i`` in ``ids``, each on the broker ``brokers`` gives it (``delay``: device id ->
    round -> seconds it waits before answering; ``fleet_key``: every device verifies signed state with it;
    ``gate``: no device answers a round before it is set)."""
    out = []
    for i in ids:
        info = device(i)
        verifier = None if fleet_key is None else Verifier(fleet_key)
        tr = MqttDeviceTransport(brokers(info), FLEET, info.device_id, FAST, verifier=verifier).start()
        tr.send_hello(hello(info))
        dev = StatsDevice(info, tr, delay=(delay or {}).get(info.device_id, {}), gate=gate)
        dev.thread = threading.Thread(target=dev.run, daemon=True, name=f"dev-{info.device_id}")
        dev.thread.start()
        out.append(dev)
    return out


def stop_devices(devs: list[StatsDevice]) -> None:
    for d in devs:
        d.stop.set()
    for d in devs:
        if d.thread is not None:
            d.thread.join(5)
        d.transport.close()


def root_engine(broker: BrokerSettings, n: int, *, rounds: int = 2, updates: bool = True,
                timeout_s: float = 0.0, client_id: str = "root",
                signer: Signer | None = None) -> tuple[RoundEngine, MqttCoordinatorTransport]:
    """The real engine with FedProto over MQTT, waiting for ``n`` devices (``updates=False``: workers read them;
    ``signer``: it signs descriptors, global state and refusals)."""
    tr = MqttCoordinatorTransport(broker, FLEET, FAST, client_id=client_id, updates=updates, signer=signer).start()
    strat = FedProtoStrategy(num_classes=CLASSES, rounds=rounds)
    cfg = EngineConfig(fleet=FLEET, method="fedproto", min_devices=n, quorum_timeout_s=60, round_timeout_s=timeout_s)
    return RoundEngine(strat, tr, cfg), tr


def engine_config() -> EngineConfig:
    """What a worker or relay builds from the fleet config (here: the same settings as the root's)."""
    return EngineConfig(fleet=FLEET, method="fedproto")


def strategy() -> FedProtoStrategy:
    return FedProtoStrategy(num_classes=CLASSES, rounds=2)


def relay_main(argv: list[str]) -> None:
    """``python tests/scaleout_helpers.py NAME SHARD_PORT PARENT_PORT STATE_DIR HOLD_S``: one relay process
    with the tests' FedProto settings (the tests kill it with SIGKILL)."""
    import logging
    import signal

    from fedge.scaleout.aggregator import PartialAggregator
    from fedge.scaleout.relay import Relay

    logging.basicConfig(level=logging.INFO)
    name, shard, parent, state, hold = argv
    relay = Relay(BrokerSettings(port=int(shard)), BrokerSettings(port=int(parent)), FLEET,
                  PartialAggregator(strategy(), engine_config(), name), settings=FAST, state_dir=state,
                  hold_s=float(hold)).start()
    signal.signal(signal.SIGTERM, lambda *a: relay.stop())
    relay.run_forever()


if __name__ == "__main__":
    import sys

    relay_main(sys.argv[1:])
