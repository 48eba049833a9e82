"""``fedge simulate --transport mqtt``: the same fleet, over an embedded broker on loopback.

Named in :data:`fedge.sim.transports.TRANSPORTS` and imported only when chosen.

Each simulated device gets its own MQTT connection and runs the real device
loop (:class:`fedge.edge.service.EdgeService`) in a thread; the coordinator is
the same round engine the in-process run uses. Round 1 starts only once every
device has said hello, so the fleet — and with the same seeds, every aggregate —
is the in-process run's. Updates arrive in network order, not fleet order: a robust
rule (:func:`fedge.coordinator.accumulators.robust_combine`) sorts them by content
first, so its aggregates are bit for bit the in-process ones; the plain mean's
streaming float64 sums agree within float tolerance (addition is not associative).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from fedge.common.signing import Signer, Verifier
from fedge.common.transport import CoordinatorTransport
from fedge.edge.agent import DeviceAgent
from fedge.edge.service import EdgeService
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import SimDevice
from fedge.mqtt.broker import EmbeddedBroker
from fedge.mqtt.connection import BrokerSettings
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.settings import TransportSettings

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 60.0


def start_fleet(cfg: FleetConfig, devices: list[SimDevice],
                broker: BrokerSettings | Callable[[str], BrokerSettings],
                settings: TransportSettings | None = None, *, coordinator: bool = True,
                signer: Signer | None = None, verifier: Verifier | None = None,
                ) -> tuple[MqttCoordinatorTransport | None, list[DeviceAgent], Callable[[], None]]:
    """Connect a coordinator transport (optional) and one device service thread per device to ``broker``
    (or, given a function, to the broker it names for each device id: a sharded fleet; then no coordinator).

    Returns (coordinator transport, agents, stop) where ``stop`` ends the device
    threads and closes every connection. Waits until every device said hello. With ``signer`` the coordinator
    signs what it publishes; with ``verifier`` every device accepts only state the fleet key signed.
    """
    fleet = cfg.run.fleet
    if callable(broker) and coordinator:
        raise ValueError("a coordinator transport needs one broker, not one per device")
    device_broker = broker if callable(broker) else (lambda _: broker)
    coord = (MqttCoordinatorTransport(broker, fleet, settings, signer=signer).start()
             if coordinator and not callable(broker) else None)
    transports: list[MqttDeviceTransport] = []
    services: list[EdgeService] = []
    threads: list[threading.Thread] = []
    try:
        for d in devices:
            t = MqttDeviceTransport(device_broker(d.info.device_id), fleet, d.info.device_id, settings,
                                    verifier=verifier).start()
            transports.append(t)
            agent = DeviceAgent(d.method, t, d.info, fleet=fleet, eval_every=cfg.run.eval_every)
            svc = EdgeService(agent, t)
            services.append(svc)
            threads.append(threading.Thread(target=svc.run, name=f"device-{d.info.device_id}", daemon=True))
        for th in threads:
            th.start()
        if coord is not None:
            coord.wait_for_hellos([d.info.device_id for d in devices], HELLO_TIMEOUT_S)
    except BaseException:
        _stop(services, threads, transports, coord)
        raise

    def stop() -> None:
        _stop(services, threads, transports, coord)

    return coord, [s.agent for s in services], stop


def _stop(services: list[EdgeService], threads: list[threading.Thread], transports: list[MqttDeviceTransport],
          coord: MqttCoordinatorTransport | None) -> None:
    for s in services:
        s.stop()
    for th in threads:
        th.join(30.0)
        if th.is_alive():
            log.warning("%s did not stop within 30 s", th.name)
    for t in transports:
        t.close()
    if coord is not None:
        coord.close()


def run_mqtt(cfg: FleetConfig, devices: list[SimDevice]) -> tuple[CoordinatorTransport, list[DeviceAgent],
                                                                 Callable[[], None]]:
    """Start an embedded broker and connect the fleet to it: (coordinator transport, agents, cleanup)."""
    broker = EmbeddedBroker().start()
    try:
        coord, agents, stop_fleet = start_fleet(cfg, devices, broker.settings())
    except BaseException:
        broker.stop()
        raise
    assert coord is not None

    def cleanup() -> None:
        stop_fleet()
        broker.stop()

    return coord, agents, cleanup
