"""Hierarchical aggregation over several real Mosquitto brokers: relays, shards, faults.

* A fleet split over two shard brokers, each with a relay to the root broker — and the same fleet
  as a chain (a relay of a relay: root ← shard 1 ← shard 2) — gives the same global state as the
  flat fleet on one broker, every device counted once per round through its relay's partial.
* A relay process killed with SIGKILL mid-round (after forwarding part of its shard) and restarted
  loses no accepted update and counts none twice: it re-issues the descriptor, its devices resend,
  the ones it had forwarded are refused as duplicates, and the round completes with every device.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gate_helpers import FLEET
from scaleout_helpers import FAST, engine_config, root_engine, start_devices, stop_devices, strategy

from fedge.common.rounds import DeviceInfo
from fedge.coordinator.aggregator import PartialAggregator
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import BrokerSettings
from fedge.mqtt.relay import Relay

N = 12
ALL = sorted(f"d{i}" for i in range(N))


def shard_of(d: DeviceInfo) -> int:
    return 0 if int(d.device_id[1:]) < N // 2 else 1


@pytest.fixture
def brokers(mosquitto_bin: str) -> Iterator[list[MosquittoProcess]]:
    """Three Mosquittos on loopback: the root and two shards (distinct ports), persistence on."""
    out = [MosquittoProcess(persistence=True).start() for _ in range(3)]
    yield out
    for b in out:
        b.close()


def flat_reference() -> dict[str, np.ndarray]:
    """The same fleet on one broker of its own (a broker the sharded run shares would keep its retained
    hellos and last statuses)."""
    with MosquittoProcess() as flat:
        engine, transport = root_engine(flat.settings(), N, client_id="flat")
        devs = start_devices(lambda d: flat.settings(), range(N))
        try:
            engine.run()
        finally:
            stop_devices(devs)
            transport.close()
    return engine.globals["prototypes"]


@pytest.mark.parametrize("topology", ["two-shards", "chain"])
def test_a_sharded_fleet_with_relays_equals_the_flat_fleet(brokers: list[MosquittoProcess], topology: str) -> None:
    root, s1, s2 = brokers
    want = flat_reference()
    # two-shards: root <- relay r1 <- s1, root <- relay r2 <- s2; chain: root <- r1 <- s1 <- r2 <- s2
    parent2 = root if topology == "two-shards" else s1
    relays = [Relay(s1.settings(), root.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "r1"),
                    settings=FAST, hold_s=5.0).start(),
              Relay(s2.settings(), parent2.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "r2"),
                    settings=FAST, hold_s=5.0).start()]
    engine, transport = root_engine(root.settings(), N, client_id=f"root-{topology}")
    shards = [s1, s2]
    devs = start_devices(lambda d: shards[shard_of(d)].settings(), range(N))
    try:
        reports = engine.run()
    finally:
        stop_devices(devs)
        for r in relays:
            r.stop()
        transport.close()
    got = engine.globals["prototypes"]
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_max_ulp(got["protos"], want["protos"], maxulp=1)
    for rep in reports:
        assert sorted(rep.accepted) == ALL and rep.missing == [] and rep.rejected == {}, rep
        # the root hears only relay r1 in the chain; both relays in two shards
        assert rep.partials == ({"r1": 6, "r2": 6} if topology == "two-shards" else {"r1": N}), rep.partials
    # the root broker carried partials, not updates: one partial per relay per round (and per child relay's)
    assert relays[0].partials_sent == len(reports)


def test_a_relay_killed_mid_round_loses_no_accepted_update(brokers: list[MosquittoProcess], tmp_path: Path) -> None:
    root, s1, s2 = brokers
    want = flat_reference()
    state = tmp_path / "r1"

    def relay_process() -> subprocess.Popen[bytes]:
        log = open(tmp_path / "r1.log", "ab")  # noqa: SIM115 - the child writes it until it dies
        script = str(Path(__file__).with_name("scaleout_helpers.py"))
        return subprocess.Popen([sys.executable, script, "r1", str(s1.port), str(root.port), str(state), "0.5"],
                                stdout=log, stderr=log)

    proc = relay_process()
    other = Relay(s2.settings(), root.settings(), FLEET, PartialAggregator(strategy(), engine_config(), "r2"),
                  settings=FAST, hold_s=5.0).start()
    engine, transport = root_engine(root.settings(), N, client_id="root-kill")
    shards = [s1, s2]
    # d5 answers round 1 after 4 s: by then r1 has forwarded d0-d4 (after 0.5 s without news) and is killed
    devs = start_devices(lambda d: shards[shard_of(d)].settings(), range(N), delay={"d5": {1: 4.0}})
    killed_after: list[str] = []

    def kill_once(_: BrokerSettings | None = None) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (state / "relay-state.json").is_file():
            time.sleep(0.05)
        killed_after.append((state / "relay-state.json").read_text())
        proc.kill()  # SIGKILL: no clean disconnect, its last-will fires
        proc.wait(5)

    import threading

    killer = threading.Thread(target=kill_once, daemon=True)
    killer.start()
    restarted: list[subprocess.Popen[bytes]] = []
    try:
        import contextlib

        def restart_later() -> None:
            killer.join(30)
            time.sleep(0.5)
            restarted.append(relay_process())

        t = threading.Thread(target=restart_later, daemon=True)
        t.start()
        reports = engine.run()
        t.join(5)
    finally:
        stop_devices(devs)
        other.stop()
        transport.close()
        for p in [proc, *restarted]:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(5)
    assert killed_after and '"round": 1' in killed_after[0] and '"d0"' in killed_after[0], killed_after
    assert '"d5"' not in killed_after[0]  # killed mid-round: d5 had not answered yet
    first = reports[0]
    assert sorted(first.accepted) == ALL and first.missing == [], first
    # d0-d4 resent their cached update to the restarted relay, which had forwarded them: refused there
    assert first.rejected_by_device.keys() <= {f"d{i}" for i in range(5)}
    assert all(c == {"duplicate": 1} for c in first.rejected_by_device.values()), first.rejected_by_device
    assert all(sorted(r.accepted) == ALL for r in reports)
    got = engine.globals["prototypes"]
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_max_ulp(got["protos"], want["protos"], maxulp=1)
