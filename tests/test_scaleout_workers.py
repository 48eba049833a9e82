"""Aggregation workers on an MQTT 5 shared subscription, over a real Mosquitto.

Two workers share the update stream (``$share/fedge-workers/...``); the coordinator reads only their
partials. The global prototypes of every round must equal a single coordinator's over the same
devices (the workers' run signed, its devices verifying: a worker reads the signed descriptor inside its
frame), both workers must have had a share, and a bad partial from a worker's account is refused
(counted, with its reason) while the coordinator keeps serving.
"""

from __future__ import annotations

import threading

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gate_helpers import FLEET
from scaleout_helpers import FAST, engine_config, root_engine, start_devices, stop_devices, strategy

from fedge.common.messages import Message
from fedge.common.signing import Signer
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.topics import FleetTopics
from fedge.scaleout.aggregator import PartialAggregator
from fedge.scaleout.worker import AggregationWorker

N = 12


def run_fleet(broker: MosquittoProcess, *, workers: int, signed: bool = False) -> tuple[dict[str, np.ndarray], list,
                                                                                   list]:
    """``signed``: the coordinator signs (the workers read the descriptor inside its frame) and every device
    verifies with the fleet key."""
    key = Ed25519PrivateKey.generate() if signed else None
    engine, transport = root_engine(broker.settings(), N, updates=workers == 0, client_id=f"root-{workers}",
                                    signer=None if key is None else Signer(key))
    pool = [AggregationWorker(broker.settings(), FLEET, PartialAggregator(strategy(), engine_config(), f"w{k}"),
                              settings=FAST).start() for k in range(workers)]
    devs = start_devices(lambda d: broker.settings(), range(N), fleet_key=None if key is None else key.public_key())
    try:
        reports = engine.run()
    finally:
        stop_devices(devs)
        for w in pool:
            w.stop()
        transport.close()
    return engine.globals["prototypes"], reports, pool


def test_two_workers_on_a_shared_subscription_give_the_single_coordinators_aggregate(
        mosquitto: MosquittoProcess) -> None:
    flat, flat_reports, _ = run_fleet(mosquitto, workers=0)
    split, reports, pool = run_fleet(mosquitto, workers=2, signed=True)  # the workers under signed state
    # the same devices and updates: sums of two partials (float64, sent as two float32 halves) vs one sum
    np.testing.assert_array_equal(split["counts"], flat["counts"])
    np.testing.assert_array_max_ulp(split["protos"], flat["protos"], maxulp=1)
    for rep in reports:
        assert sorted(rep.accepted) == sorted(f"d{i}" for i in range(N)), rep
        assert set(rep.partials) == {"w0", "w1"}, rep.partials  # both workers had a share ...
        assert sum(rep.partials.values()) == N
        assert rep.rejected == {}
    assert all(w.updates_in > 0 for w in pool) and sum(w.updates_in for w in pool) == N * len(reports)
    assert len(flat_reports) == len(reports) == 3  # 2 training rounds + the final one, in both runs


def test_a_bad_partial_from_a_workers_account_is_refused_and_the_round_goes_on(mosquitto: MosquittoProcess) -> None:
    engine, transport = root_engine(mosquitto.settings(), N, updates=False, client_id="root-bad")
    worker = AggregationWorker(mosquitto.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "w0"),
                               settings=FAST).start()
    topics = FleetTopics(FLEET)
    rogue = MqttClient(mosquitto.settings(), "rogue").start()
    sent, arrived = threading.Event(), threading.Event()
    # the devices answer once the root has queued the forged partial: it is merged before the honest ones
    on_partial = transport._on_partial

    def spy(account: str, m: Received) -> None:
        on_partial(account, m)
        if account == "w9":
            arrived.set()

    transport._on_partial = spy  # type: ignore[method-assign]
    devs = start_devices(lambda d: mosquitto.settings(), range(N), gate=arrived)

    # once round 1 is announced, a forged partial (NaN sums for d0) arrives on w9's topic before the honest ones
    def forge() -> None:
        while not sent.is_set():
            raw = transport._retained.round  # the descriptor the engine announced
            if raw:
                msg = Message.from_bytes(raw)
                bad = Message("partial", "w9", msg.round, FLEET, tensors={
                    "protos/counts": np.full(10, 1, np.int64), "protos/sums/hi": np.full((10, 64), np.nan, np.float32),
                    "protos/sums/lo": np.zeros((10, 64), np.float32)},
                    info={"descriptor": msg.msg_id, "devices": {"d0": {"up": 1, "info": {"num_samples": 100}}},
                          "rejected_by_device": {}})
                rogue.publish(topics.partial("w9"), bad.to_bytes())
                sent.set()
            sent.wait(0.01)

    t = threading.Thread(target=forge, daemon=True)
    t.start()
    try:
        reports = engine.run()
    finally:
        sent.set()
        arrived.set()
        stop_devices(devs)
        worker.stop()
        rogue.stop()
        transport.close()
    first = reports[0]
    assert first.rejected_by_device.get("w9") == {"partial-nonfinite": 1}, first.rejected_by_device
    assert sorted(first.accepted) == sorted(f"d{i}" for i in range(N))  # d0 counted once, from the worker
    assert np.isfinite(engine.globals["prototypes"]["protos"]).all()
