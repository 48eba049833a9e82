"""Per-round checkpoints of a generative benchmark cell, so a long cell survives the end of a session (issue 43).

A cell is one sequential in-process simulation (:func:`fedge.sim.simulate.simulate`'s default path). After every
round :func:`run_resumable` writes one file, ``checkpoint.pt`` in the cell's checkpoint directory, atomically
(:func:`~fedge.common.atomicfile.write_atomic`), holding everything the next round depends on:

* the coordinator: the engine's state as its own store keeps it (:class:`~fedge.coordinator.store.EngineState`:
  rounds completed, registered devices, the strategy's state, published artifacts, run id, every round's report —
  the accuracies and bytes the cell's JSON is made of);
* every device: its method half's attributes (model, generator, the generator's optimizers and any other state a
  method keeps between rounds, its caches), its numpy and torch generators, its agent's round bookkeeping;
* the process: torch's, numpy's and Python's global random states; the virtual clock's time and rounds;
* the wall seconds spent so far and which rounds each session ran.

Re-run with the same settings, the cell builds its fleet as usual, loads the file, puts every piece back and runs
the remaining rounds: the results equal an uninterrupted run's, figure for figure (tests/test_generative_resume.py).
A checkpoint written under other settings (its ``expect``) is set aside and the cell starts over. The file is
pickled Python objects, so it is for the same code: resume with the checkout that wrote it.
"""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedge.common.atomicfile import write_atomic
from fedge.coordinator.engine import RoundEngine, RoundReport
from fedge.coordinator.store import EngineState
from fedge.edge.agent import DeviceAgent
from fedge.edge.methods.gefl import GenerativeMixin
from fedge.fleet.config import FleetConfig
from fedge.fleet.devices import SimDevice
from fedge.fleet.slots import checked_slots
from fedge.sim.clocked import ClockedCoordinatorTransport
from fedge.sim.parallel import sequential_run
from fedge.sim.simulate import SimResult, _engine, build_fleet
from fedge.sim.transports import transport_runner

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
PROGRESS_FILE = "progress.json"  # a readable summary of the checkpoint: where the cell stands
# A method's attributes not saved: its context (restored piece by piece) and its parsed [method] settings,
# which the rebuilt fleet has from the config (the same, as ``expect`` checks).
NOT_SAVED = ("ctx", "settings")
# A forked cell's method attributes taken from its own settings, not the checkpoint (GeFL's head-stage knobs).
FORK_FRESH = ("synthetic_epochs", "real_epochs", "synthetic_ratio")
# The agent's bookkeeping between rounds (the rest of a DeviceAgent is its wiring to the transport).
AGENT_STATE = ("last_round", "model_round", "traffic", "trained_runs", "_ignored_run", "task_done")


def checkpoint_dir(cell_json: Path) -> Path:
    """Where the cell saved as ``cell_json`` keeps its checkpoint: ``ckpt/<cell name>/`` beside it."""
    return cell_json.parent / "ckpt" / cell_json.stem


@dataclass(frozen=True)
class Fork:
    """Start a cell from another cell's kept checkpoint (``path``, written under ``expect``) instead of round 1:
    for a row whose settings differ from that cell's only in what the rounds after it use (rows.py checks)."""

    path: Path
    expect: dict[str, Any]


def kept_path(ckpt_dir: Path, rnd: int) -> Path:
    """Where a cell keeps its round-``rnd`` checkpoint for forks: beside its checkpoint directory, so it stays
    when the cell finishes."""
    return ckpt_dir.with_name(f"{ckpt_dir.name}@r{rnd}.pt")


def run_resumable(cfg: FleetConfig, ckpt_dir: Path, expect: dict[str, Any], *, keep: Collection[int] = (),
                  fork: Fork | None = None, after_round: Callable[[int], None] | None = None,
                  ) -> tuple[SimResult, dict[str, Any]]:
    """Simulate ``cfg`` (sequential, in process), checkpointing into ``ckpt_dir`` after every round and resuming
    from it; returns the result and the sessions' record (``{"sessions": [{"from": r0, "to": r1}, ...]}``).

    ``expect`` identifies the settings (a checkpoint written under others is set aside). The checkpoints of the
    rounds in ``keep`` are also kept (:func:`kept_path`); with no checkpoint of its own, a cell starts from
    ``fork``'s if there is one. ``after_round(rnd)`` is called once round ``rnd``'s checkpoint is on disk (a test
    stops the run there).
    """
    if cfg.simulation.parallel:
        raise ValueError("a resumable cell runs sequentially: set [simulation] backend = \"sequential\"")
    t0 = time.perf_counter()
    devices, strat = build_fleet(cfg)
    coord, agents, cleanup = transport_runner("inprocess")(cfg, devices)
    try:
        engine = _engine(cfg, strat, coord, checked_slots(cfg))
        saved = _load(ckpt_dir / CHECKPOINT_FILE, expect)
        forked = saved is None and fork is not None and (saved := _load(fork.path, fork.expect)) is not None
        spent, sessions = 0.0, []
        if saved is not None:
            _restore(saved, engine, devices, agents, coord, forked=forked)
            spent, sessions = saved["wall_seconds"], saved["sessions"]
            if forked:
                sessions = [{**sessions[0], "forked_from": fork.path.name if fork else ""}, *sessions[1:]]
            log.info("%s: resuming after round %d%s", ckpt_dir, engine.completed, " (forked)" if forked else "")
        sessions.append({"from": engine.completed + 1, "to": engine.completed})
        bias = spent - t0  # wall seconds of the cell so far = time.perf_counter() + bias

        def on_round(report: RoundReport) -> None:
            sessions[-1]["to"] = report.round
            _save(ckpt_dir, expect, engine, devices, agents, coord, time.perf_counter() + bias, sessions)
            if report.round in keep:
                shutil.copyfile(ckpt_dir / CHECKPOINT_FILE, kept_path(ckpt_dir, report.round))
            if after_round is not None:
                after_round(report.round)

        engine.run(on_round=on_round)
    finally:
        cleanup()
    clock = getattr(coord, "clock", None)
    result = SimResult(cfg, devices, agents, engine.reports, time.perf_counter() + bias,
                       {"simulation": sequential_run(devices)}, [], engine.globals, clock)
    return result, {"sessions": sessions}


def fleet_at(cfg: FleetConfig, path: Path) -> list[SimDevice]:
    """The devices of ``cfg`` as a checkpoint file (a cell's own or a kept one) left them, each generator replaced
    by the fleet's average the coordinator published last (what the next round gives them): to measure them."""
    devices, strat = build_fleet(cfg)
    coord, agents, cleanup = transport_runner("inprocess")(cfg, devices)
    try:
        engine = _engine(cfg, strat, coord, checked_slots(cfg))
        _restore(torch.load(path, weights_only=False), engine, devices, agents, coord)
    finally:
        cleanup()
    for d in devices:
        if isinstance(d.method, GenerativeMixin):
            d.method._load_generator(engine.globals)
    return devices


def discard(ckpt_dir: Path) -> None:
    """Remove a finished cell's checkpoint (its JSON holds the results; the file can be hundreds of MB)."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def _device_state(d: SimDevice, agent: DeviceAgent) -> dict[str, Any]:
    m = d.method
    # One pickle for the method's attributes and its context's model: objects shared between them (a
    # generator and its trainer's optimizers, a head over the model's layers) stay shared when loaded.
    return {"method": {k: v for k, v in vars(m).items() if k not in NOT_SAVED}, "model": m.ctx.model,
            "rng": m.ctx.rng, "torch_gen": m.ctx.torch_gen.get_state(),
            "agent": {k: getattr(agent, k) for k in AGENT_STATE}}


def _save(ckpt_dir: Path, expect: dict[str, Any], engine: RoundEngine, devices: list[SimDevice],
          agents: list[DeviceAgent], coord: Any, wall: float, sessions: list[dict[str, int]]) -> None:
    clock = getattr(coord, "clock", None)
    state = {
        "expect": expect,
        "completed": engine.completed,
        "engine": EngineState(completed=engine.completed, method=engine.config.method, fleet=engine.config.fleet,
                              devices=dict(engine.devices), strategy=engine.strategy.state_dict(),
                              run_id=engine.run_id, global_rounds=dict(engine.global_rounds),
                              latency=engine.latency, globals=dict(engine.globals), reports=list(engine.reports)),
        "devices": {d.info.device_id: _device_state(d, a) for d, a in zip(devices, agents, strict=True)},
        "clock": None if clock is None else {"now": clock.now, "rounds": clock.rounds},
        "next_round": getattr(coord, "_next_round", None),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "wall_seconds": wall,
        "sessions": sessions,
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    write_atomic(ckpt_dir / CHECKPOINT_FILE, buf.getvalue())
    del buf
    evals = [(r.round, [m["acc_global"] for m in r.metrics.values() if "acc_global" in m]) for r in engine.reports]
    last = next(((rnd, accs) for rnd, accs in reversed(evals) if accs), None)
    progress = {"completed": engine.completed, "total": engine.strategy.total_rounds(),
                "phase": engine.reports[-1].phase, "wall_seconds": round(wall, 1), "sessions": sessions,
                "expect": expect, "last_eval_round": last[0] if last else None,
                "mean_acc_global_last_eval": float(np.mean(last[1])) if last else None}
    write_atomic(ckpt_dir / PROGRESS_FILE, json.dumps(progress, indent=1).encode(), durable=False)


def _load(path: Path, expect: dict[str, Any]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    # our own file, holding pickled fedge objects (not only tensors): weights_only cannot load it
    saved: dict[str, Any] = torch.load(path, weights_only=False)
    if saved.get("expect") != expect:
        if path.name != CHECKPOINT_FILE:  # another cell's kept checkpoint: not ours to move
            print(f"{path}: written under other settings; not used", flush=True)
            return None
        stale = path.parent.with_name(path.parent.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        path.parent.rename(stale)
        print(f"{path}: written under other settings; moved to {stale}, the cell starts over", flush=True)
        return None
    return saved


def current_report(old: RoundReport) -> RoundReport:
    """``old`` as today's :class:`RoundReport`: a cell can outlive a release. Unpickling restores an object's
    ``__dict__`` as it was saved, so a report pickled before a field was added lacks it (a resumed cell then
    failed in ``build_results`` reading ``selection``); rebuilt, the missing fields take their defaults."""
    saved = vars(old)
    return RoundReport(**{f.name: saved[f.name] for f in fields(RoundReport) if f.name in saved})


def _restore(saved: dict[str, Any], engine: RoundEngine, devices: list[SimDevice], agents: list[DeviceAgent],
             coord: Any, *, forked: bool = False) -> None:
    saved["engine"].reports = [current_report(r) for r in saved["engine"].reports]
    engine._resume(saved["engine"])  # the engine's own restart path (as from its state directory)
    for d, agent in zip(devices, agents, strict=True):
        s = saved["devices"][d.info.device_id]
        ctx = d.method.ctx
        # a fork keeps the settings its own config gave the method (those it may change: rows.FORKABLE)
        fresh = {k: getattr(d.method, k) for k in FORK_FRESH if forked and hasattr(d.method, k)}
        vars(d.method).update(s["method"])
        vars(d.method).update(fresh)
        ctx.model, ctx.rng = s["model"], s["rng"]
        ctx.torch_gen.set_state(s["torch_gen"])
        for k, v in s["agent"].items():
            setattr(agent, k, v)
    clock = getattr(coord, "clock", None)
    if clock is not None and saved["clock"] is not None:
        clock.now, clock.rounds = saved["clock"]["now"], saved["clock"]["rounds"]
    if isinstance(coord, ClockedCoordinatorTransport) and saved["next_round"] is not None:
        coord._next_round = saved["next_round"]
    rng = saved["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
