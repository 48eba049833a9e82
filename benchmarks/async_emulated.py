"""Asynchronous against synchronous FedAvg on the Docker-emulated 3-profile fleet, in measured time (issue 27).

Issue 27's "async's measured time-to-accuracy is <= 0.6x sync's" on the fleet of ``benchmarks.clock honest``
(x86 gateway, Raspberry Pi 4, Pi Zero 2 W under ``fedge emulate``'s CPU quotas and links), with one model for
all three (``arch = "tier-xs"``, so FedAvg has one group and one global model to score). Per seed, two runs of
the same fleet:

* **sync**: ``--rounds`` synchronous rounds (each waits for the Pi Zero);
* **async**: ``[coordinator] mode = "async"``, ``buffer_size = --buffer``, every device training at once,
  polynomial staleness weights (FedBuff's 1/sqrt(1+s)); stopped once it has run as long as the synchronous run
  (measured from each run's first round descriptor).

While a run goes, this process subscribes to the fleet's broker (the host reaches the broker container on the
fleet network, with the coordinator's account) and keeps every round descriptor and global model the
coordinator publishes, with the time it arrived. Afterwards each global model is scored on the dataset's whole
test split (the devices' training is untouched by it). Reported side by side: the time each mode takes to reach
95 % of the synchronous run's final accuracy and their ratio, and each mode's accuracy at the synchronous run's
end. The clock starts at each run's first round descriptor: container start-up and registration are not a
round's.

    python -m benchmarks.async_emulated [--rounds 8] [--buffer 2] [--seeds 0 1] [--fraction 1.0] [--epochs 5]

Needs Docker (``fedge emulate``'s images are built if missing). Writes
benchmarks/results/async-emulated/<cell>.json per run (resumable; ``--force`` reruns) and
benchmarks/results/async-emulated-summary.json, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.async_ import TARGET, acc_at, time_to
from benchmarks.common import RESULTS, text_table
from fedge.common.messages import Message
from fedge.mqtt.chunking import RetainedAssembler
from fedge.mqtt.topics import FleetTopics

OUT = RESULTS / "async-emulated"
PROFILES = ("x86-gateway", "rpi4-4gb", "rpi-zero-2w")
MAX_GLOBAL_BYTES = 1 << 26  # a reassembled global model (tier-xs on digits: some 100 kB)
log = logging.getLogger(__name__)

FLEET = """
[run]
method = "fedavg"
rounds = {rounds}
dataset = "{dataset}"
fleet = "asyncemu"
seed = {seed}
eval_every = 100000

[partition]
fraction = {fraction}

[train]
lr = 0.1  # the figures were measured before issue 45 changed the defaults: pinned
lr_schedule = "constant"
local_epochs = {epochs}
min_tail = 1
val_fraction = 0.0
{coordinator}
"""

ASYNC = """
[coordinator]
mode = "async"
buffer_size = {buffer}
concurrency = 3
max_staleness = {max_staleness}
staleness_weight = "polynomial"
staleness_exponent = 0.5
"""


def fleet_text(args: argparse.Namespace, seed: int, mode: str) -> str:
    """The fleet config of one run: ``mode`` "sync" (``--rounds`` rounds) or "async" (versions enough to outlast
    the synchronous run: it is stopped at that run's duration)."""
    versions = 20 * args.rounds * len(PROFILES) // args.buffer
    coordinator = (ASYNC.format(buffer=args.buffer, max_staleness=args.max_staleness) if mode == "async" else "")
    text = FLEET.format(rounds=args.rounds if mode == "sync" else versions, dataset=args.dataset, seed=seed,
                        fraction=args.fraction, epochs=args.epochs, coordinator=coordinator)
    return text + "".join(f'\n[[devices]]\nprofile = "{p}"\narch = "tier-xs"\n' for p in PROFILES)


class Recorder:
    """Every round descriptor and global model published on the fleet's broker, with the time each arrived."""

    def __init__(self, fleet: str) -> None:
        self.topics = FleetTopics(fleet)
        self.lock = threading.Lock()
        self.rounds: list[tuple[float, int]] = []  # (monotonic time, round or version announced)
        self.globals: list[tuple[float, bytes]] = []  # (monotonic time, the whole global message)
        self._asm: dict[str, RetainedAssembler] = {}  # artifact -> its chunks reassembled

    def on_message(self, m: Any) -> None:
        now = time.monotonic()
        if m.topic == self.topics.round:
            if m.payload:
                with self.lock:
                    self.rounds.append((now, Message.from_bytes(m.payload).round))
            return
        rest = m.topic.removeprefix(self.topics.base + "/global/")
        if rest == m.topic:
            return
        artifact, _, part = rest.partition("/part/")
        asm = self._asm.get(artifact)
        if asm is None:
            asm = self._asm[artifact] = RetainedAssembler(MAX_GLOBAL_BYTES)
        whole = asm.on_part(m.payload) if part else asm.on_root(m.payload)
        if whole is not None:
            with self.lock:
                self.globals.append((now, whole))


OBSERVER = "bench-observer"


def observer_account(broker_dir: Path, fleet: str) -> str:
    """Add a read-only account for this benchmark to the emulation's broker (before it starts): the round
    descriptors and the global state. Not the coordinator's: the broker takes a user name as the client id
    (``use_username_as_clientid``), so a second client on that account would take the coordinator's session
    over, again and again."""
    from fedge.broker.passwords import hash_password, new_password

    password = new_password()
    with open(broker_dir / "passwd", "a") as f:
        f.write(f"{OBSERVER}:{hash_password(password)}\n")
    with open(broker_dir / "acl", "a") as f:
        f.write(f"\nuser {OBSERVER}\ntopic read fedge/{fleet}/rounds/#\ntopic read fedge/{fleet}/global/#\n")
    return password


def run_cell(args: argparse.Namespace, seed: int, mode: str, until: float | None) -> dict[str, Any]:
    """One emulated run; its global models' accuracy against seconds since its first round descriptor
    (asynchronous: stopped ``until`` seconds after it)."""
    from fedge.coordinator.store import REPORTS_FILE, read_reports
    from fedge.emulate import discovery, images, lifecycle, status
    from fedge.emulate.lifecycle import BROKER, COORDINATOR
    from fedge.mqtt.client import MqttClient
    from fedge.mqtt.connection import DEFAULT_PORT, BrokerSettings

    client = discovery.docker_client()
    tags = images.ensure_images(client, "amd64")
    work = Path(args.work).resolve() / f"{mode}-s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    fleet = work / "fleet.toml"
    fleet.write_text(fleet_text(args, seed, mode))
    emu = lifecycle.prepare(fleet, work / "emu", images=tags, device_args=("--keep-running",))
    password = observer_account(emu.out / "broker", emu.fleet)
    rec = Recorder(emu.fleet)
    t_wall = time.perf_counter()
    try:
        # lifecycle.start, with this process subscribed before the coordinator publishes anything
        emu.compose("up", "-d", "--no-build", BROKER, *emu.devices)
        lifecycle.wait_online(emu, client, timeout=1800)
        broker = BrokerSettings(host=lifecycle.broker_address(emu, client), port=DEFAULT_PORT,
                                username=OBSERVER, password=password, keepalive_s=30)
        mq = MqttClient(broker, f"bench-async-emulated-{mode}", clean_session=True, on_message=rec.on_message)
        mq.subscribe(rec.topics.round)
        mq.subscribe(rec.topics.base + "/global/#")
        mq.start(wait_s=60)
        try:
            lifecycle.start_coordinator(emu)
            if until is None:
                code = lifecycle.wait_exited(emu, client, COORDINATOR, timeout=7200)
                if code != 0:
                    raise SystemExit(status.logs(emu, client, COORDINATOR, tail=30))
            else:
                while True:
                    time.sleep(1.0)
                    with rec.lock:
                        start = next((t for t, r in rec.rounds if r >= 1), None)
                    if start is not None and time.monotonic() - start >= until:
                        break
                    if start is None and time.perf_counter() - t_wall > 1800:
                        raise SystemExit("the asynchronous run announced no version in 30 min: "
                                         + status.logs(emu, client, COORDINATOR, tail=30))
        finally:
            mq.stop()
        reports = read_reports(emu.out / "coordinator" / REPORTS_FILE, live=True)
    finally:
        lifecycle.down(emu)
    start = next(t for t, r in rec.rounds if r >= 1)
    curve = score(args, seed, [(t - start, Message.from_bytes(raw)) for t, raw in rec.globals if t >= start])
    training = [r for r in reports if r.phase != "final"]
    stale = [s for r in training for s in r.staleness.values()]
    per_device: dict[str, int] = {}
    for r in training:
        for d in r.accepted:
            per_device[d] = per_device.get(d, 0) + 1
    return {
        "seed": seed, "mode": mode, "rounds": args.rounds, "buffer": args.buffer if mode == "async" else 3,
        "dataset": args.dataset, "fraction": args.fraction, "epochs": args.epochs, "until": until,
        "curve": curve, "final_acc": curve[-1][1], "duration_s": curve[-1][0],
        "versions": len(training), "updates_per_device": per_device, "mean_staleness": float(np.mean(stale))
        if stale else 0.0, "rejected": sum(sum(r.rejected.values()) for r in training),
        "wall_s": time.perf_counter() - t_wall, "limits": emu.limits,
        "load_average_after": os.getloadavg(),
    }


def score(args: argparse.Namespace, seed: int, published: list[tuple[float, Any]]) -> list[tuple[float, float]]:
    """(seconds, accuracy on the whole test split) of each global model, from the fleet's own initial model
    at 0 (every device starts from the run seed's weights)."""
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.methods.base import load_arrays
    from fedge.edge.training import accuracy
    from fedge.fleet.config import parse_fleet
    from fedge.sim.simulate import build_fleet

    torch.set_num_threads(1)
    cfg = parse_fleet(tomllib.loads(fleet_text(args, seed, "sync")), source="benchmarks/async_emulated.py")
    fleet, _ = build_fleet(cfg)  # the devices' own start: the run seed's initial weights
    model = fleet[0].method.ctx.model
    test = load_dataset(args.dataset, train=False)
    curve = [(0.0, float(accuracy(model, test.x, test.y)))]
    for t, msg in published:
        if not msg.tensors:
            continue
        load_arrays(model, msg.tensors)
        curve.append((t, float(accuracy(model, test.x, test.y))))
    return curve


def cell(args: argparse.Namespace, seed: int, mode: str, until: float | None = None) -> dict[str, Any]:
    """A run, from its JSON when one was saved with the same settings (``--force``: always run)."""
    name = (f"{mode}-r{args.rounds}-k{args.buffer}-{args.dataset}-f{args.fraction}-e{args.epochs}-s{seed}.json")
    path = OUT / name
    if path.is_file() and not args.force:
        return dict(json.loads(path.read_text()))
    res = run_cell(args, seed, mode, until)
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"  {name}: final {100 * res['final_acc']:.1f} % after {res['duration_s']:.0f} s, "
          f"{res['versions']} rounds/versions, updates {res['updates_per_device']}", flush=True)
    return res


def compare(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, Any]:
    """Time to 95 % of sync's final accuracy in each mode, the ratio, and each mode's accuracy at sync's end."""
    level = TARGET * sync["final_acc"]
    end = sync["duration_s"]
    ts, ta = time_to(sync["curve"], level), time_to(asyn["curve"], level)
    return {"seed": sync["seed"], "level": level, "sync_s": ts, "async_s": ta,
            "ratio": ta / ts if ts and ta is not None else None, "end_s": end,
            "sync_end_acc": sync["final_acc"], "async_end_acc": acc_at(asyn["curve"], end),
            "async_updates": asyn["updates_per_device"], "sync_updates": sync["updates_per_device"],
            "async_staleness": asyn["mean_staleness"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="synchronous rounds (async runs as long)")
    p.add_argument("--buffer", type=int, default=2, help="asynchronous buffer size K (of 3 devices)")
    p.add_argument("--max-staleness", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--dataset", default="digits", help="a dataset the device images hold (digits)")
    p.add_argument("--fraction", type=float, default=1.0, help="share of the training set the 3 devices split")
    p.add_argument("--epochs", type=int, default=5, help="local epochs per round or task")
    p.add_argument("--work", default="runs/bench-async-emulated")
    p.add_argument("--force", action="store_true", help="rerun cells saved before")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for seed in args.seeds:
        sync = cell(args, seed, "sync")
        asyn = cell(args, seed, "async", until=sync["duration_s"])
        rows.append(compare(sync, asyn))
    summary = {"benchmark": "async_emulated", "args": {k: v for k, v in vars(args).items() if k != "force"},
               "target_ratio": 0.6, "rows": rows}
    (RESULTS / "async-emulated-summary.json").write_text(json.dumps(summary, indent=1))
    print(text_table(["seed", "95 % of sync's final", "sync s", "async s", "async / sync", "sync acc at end",
                      "async acc then", "updates sync / async"],
                     [[str(r["seed"]), f"{100 * r['level']:.1f} %", _s(r["sync_s"]), _s(r["async_s"]),
                       f"{r['ratio']:.2f}" if r["ratio"] is not None else "-", f"{100 * r['sync_end_acc']:.1f} %",
                       f"{100 * r['async_end_acc']:.1f} %",
                       f"{sum(r['sync_updates'].values())} / {sum(r['async_updates'].values())}"] for r in rows]))
    return 0


def _s(t: float | None) -> str:
    return "never" if t is None else f"{t:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
