"""How fast an asynchronous fleet makes its next version after its broker is killed with SIGKILL (issue 47; target:
< 10 s from the broker being back).

Three FedProto devices on digits (``tier-xs``), ``[coordinator] mode = "async"``, ``buffer_size = 2``, over a real
Mosquitto on loopback with persistence as ``fedge broker config`` writes it (``autosave_interval 30``) or without.
Every client keeps the library's default reconnect back-off (1-2 s first step, doubling up to 30 s). At a random
moment (uniform in 0.5-4 s after the first version, then after the fleet's previous recovery, so a kill lands
anywhere in a version: before the devices have their tasks, mid-training, after an upload) the broker is killed
with SIGKILL and restarted on the same port ``--down`` seconds later. Measured per crash: seconds from the broker
listening again to the next version being published. The run also records whether every version holds exactly
``buffer_size`` accepted updates, and what was refused (copies resent: ``replay``); that no accepted update is lost
or counted twice is what tests/test_async_broker_crash.py checks against the state directory's update logs.

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.broker_crash     # writes results/broker_crash.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, markdown_table
from fedge.coordinator.engine import EngineConfig, RoundEngine
from fedge.coordinator.report import RoundReport
from fedge.fleet.config import load_fleet
from fedge.mqtt.broker import MosquittoProcess, free_port, loopback_config
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.settings import TransportSettings
from fedge.sim.over_mqtt import start_fleet
from fedge.sim.simulate import build_fleet

FLEET_TOML = """
[run]
method = "fedproto"
rounds = 1000
dataset = "digits"
fleet = "{fleet}"
seed = 5

[partition]
kind = "dirichlet"
alpha = 0.5
fraction = 0.2

[train]
lr = 0.05
lr_schedule = "constant"
local_epochs = 1

[coordinator]
mode = "async"
buffer_size = 2
max_staleness = 10

[[devices]]
profile = "rpi4-2gb"
count = 3
arch = "tier-xs"
"""


class Done(Exception):
    """Every crash measured: ends the engine's run."""


def run(persistence: bool, crashes: int, down_s: float, seed: int, work: Path) -> dict[str, Any]:
    fleet = f"crash-bench-{int(persistence)}"
    path = work / f"{fleet}.toml"
    path.write_text(FLEET_TOML.format(fleet=fleet))
    cfg = load_fleet(path)
    port = free_port()
    broker = MosquittoProcess(loopback_config(port, persistence_dir=work if persistence else None), port=port,
                              workdir=work).start()
    devices, strat = build_fleet(cfg)
    wire = TransportSettings(global_timeout_s=60)
    coord = MqttCoordinatorTransport(broker.settings(), fleet, wire).start()
    _, _, stop = start_fleet(cfg, devices, broker.settings(), wire, coordinator=False)
    coord.wait_for_hellos([d.info.device_id for d in devices], 60)
    rng = random.Random(seed)
    published: list[tuple[int, float]] = []
    recovered = threading.Condition()
    measured: list[dict[str, Any]] = []

    def on_version(report: RoundReport) -> None:
        with recovered:
            published.append((report.round, time.monotonic()))
            recovered.notify_all()
        if len(measured) >= crashes:
            raise Done

    def crasher() -> None:
        with recovered:  # after the first version: its tasks include the devices' one-off start-up (torch, data)
            recovered.wait_for(lambda: bool(published), 300)
        while len(measured) < crashes:
            time.sleep(rng.uniform(0.5, 4.0))
            version = len(published) + 1  # the version being built when the broker dies
            broker.kill()
            time.sleep(down_s)
            broker.start()
            back = time.monotonic()
            def next_version(back: float = back) -> bool:
                return any(t > back for _, t in published)

            with recovered:
                recovered.wait_for(next_version, 120)
            after = [(v, t) for v, t in published if t > back]
            if not after:
                measured.append({"version": version, "seconds": None})
                return
            measured.append({"version": version, "next_version": after[0][0], "seconds": after[0][1] - back})

    engine = RoundEngine(strat, coord, EngineConfig(fleet=fleet, method=cfg.run.method,
                                                    asynchronous=cfg.asynchronous))
    thread = threading.Thread(target=crasher, daemon=True)
    try:
        thread.start()
        with contextlib.suppress(Done):
            engine.run(on_version)
        thread.join(150)
    finally:
        stop()
        coord.close()
        broker.close()
    versions = engine.reports
    ids = [m for r in versions for m in r.accepted]
    refused: dict[str, int] = {}
    for r in versions:
        for reason, n in r.rejected.items():
            refused[reason] = refused.get(reason, 0) + n
    times = [m["seconds"] for m in measured if m["seconds"] is not None]
    return {"persistence": persistence, "crashes": measured, "versions": len(versions),
            "every_version_full": all(len(r.accepted) == 2 for r in versions),
            "accepted": len(ids), "missing": sum(len(r.missing) for r in versions), "refused": refused,
            "stalled": sum(m["seconds"] is None for m in measured),
            "median_s": statistics.median(times) if times else None, "max_s": max(times) if times else None,
            "coordinator_connects": coord.client.connects}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crashes", type=int, default=10)
    ap.add_argument("--down", type=float, default=2.0, help="seconds the broker stays down")
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--out", type=Path, default=RESULTS / "broker_crash.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cells = []
    for persistence in (True, False):
        with tempfile.TemporaryDirectory(prefix="fedge-crash-") as tmp:
            cells.append(run(persistence, args.crashes, args.down, args.seed, Path(tmp)))
    doc = {"benchmark": "broker_crash", "crashes": args.crashes, "down_s": args.down, "seed": args.seed,
           "machine": platform.platform(), "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    rows = []
    for c in cells:
        secs = [m["seconds"] for m in c["crashes"] if m["seconds"] is not None]
        rows.append(["on (autosave 30 s)" if c["persistence"] else "off", str(len(c["crashes"])), str(c["stalled"]),
                     f"{c['median_s']:.2f}" if secs else "-", f"{c['max_s']:.2f}" if secs else "-",
                     str(c["versions"]), "yes" if c["every_version_full"] else "NO",
                     ", ".join(f"{k} {v}" for k, v in sorted(c["refused"].items())) or "none"])
    print(markdown_table(["persistence", "crashes", "stalled", "median s", "max s", "versions", "every version full",
                          "refused"], rows))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
