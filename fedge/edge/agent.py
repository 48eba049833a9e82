"""The device agent: follows round descriptors, runs its method's device half, uploads.

The same class runs in-process (stepped by the simulator) and on a real device
over MQTT (stepped by its own loop), so the bytes it counts are the wire bytes.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedge.common.messages import Message
from fedge.common.privacy import privatize, project_global
from fedge.common.rounds import DeviceInfo, RoundInfo, evaluates_at
from fedge.common.transport import DeviceTransport
from fedge.edge.methods.base import DeviceMethod
from fedge.edge.secure import SecureOutcome, secure_upload, task_for, task_seed
from fedge.errors import PayloadError
from fedge.secagg.messages import Refusal
from fedge.secagg.rounds import SecureTask

log = logging.getLogger(__name__)
MAX_REPLANS = 3  # re-planned secure sums of one round a device answers again (restarts of its coordinator)


@dataclass
class Traffic:
    """Bytes this device received and sent in one round (encoded sizes)."""

    round: int
    bytes_down: int
    bytes_up: int


class DeviceAgent:
    """Runs one device: hello, then one :meth:`step` per announced round."""

    def __init__(self, method: DeviceMethod, transport: DeviceTransport, device: DeviceInfo,
                 *, fleet: str = "default", eval_every: int = 1) -> None:
        self.method = method
        self.transport = transport
        self.device = device
        self.fleet = fleet
        self.eval_every = max(1, eval_every)
        self.last_round = 0
        self.model_round = 0  # round of the newest global state applied (its "model version"; 0: none yet)
        self.traffic: list[Traffic] = []
        self.trained_runs: set[str] = set()  # run ids (of round descriptors) this agent trained a round in
        self._ignored_run = ""
        self._noise_rng = np.random.default_rng()  # [privacy] noise: OS entropy, never the run's seed
        # The last secure sum this device took part in: (round, its graph seed, the arrays it summed), kept so that
        # a round re-announced with another sum (a restarted coordinator) is answered without training again.
        self._secure_answered: tuple[int, bytes, dict[str, Any]] | None = None
        # what info.train_s is measured with; a simulator on a virtual clock replaces it (fedge.sim.clocked)
        self.timer: Callable[[], float] = time.perf_counter
        self.task_done: tuple[str, int] | None = None  # asynchronous mode: (run, task) last trained

    def hello(self) -> None:
        msg = Message("hello", self.device.device_id, 0, self.fleet, info={"device": self.device.to_dict()})
        self.transport.send_hello(msg.to_bytes())

    def step(self) -> bool:
        """Handle the current round if it is new; returns whether a round was handled."""
        raw = self.transport.current_round()
        if raw is None:
            return False
        try:
            announce = Message.from_bytes(raw)
            info = RoundInfo.from_dict(announce.info["round"])
        except (PayloadError, KeyError, TypeError) as exc:
            log.warning("%s: ignored a bad round descriptor: %s", self.device.device_id, exc)
            return False
        run = announce.info.get("run")
        run = run if isinstance(run, str) else ""
        if info.assigned is not None:
            return self._step_async(info, run, len(raw))
        if info.round == self.last_round and self._secure_replanned(info, raw):
            return True
        if info.round <= self.last_round:
            return False
        if info.is_final and run and run not in self.trained_runs:
            # A final round of a run this device never trained in: a previous run's retained
            # descriptor (its coordinator is gone, the next one has not started). Answering it
            # would end this device's run before it began; wait for a descriptor of a live run.
            if run != self._ignored_run:
                log.info("%s: ignoring the final round of run %s, in which it trained no round",
                         self.device.device_id, run[:8])
                self._ignored_run = run
            return False
        if not info.includes(self.device.device_id):
            # not sampled for this round: no work, nothing sent (docs/protocol.md, round.sampled)
            log.debug("%s: not sampled for round %d", self.device.device_id, info.round)
            self.last_round = info.round
            if run:
                self.trained_runs.add(run)  # its run all the same: it may answer the final round
            return False
        self.handle_round(info, len(raw), secure=announce.info.get("secagg"))
        if not info.is_final and run:
            self.trained_runs.add(run)
        return True

    def _step_async(self, info: RoundInfo, run: str, descriptor_bytes: int) -> bool:
        """Asynchronous mode: train once per task the descriptor assigns this device, from the version it
        announces (docs/async.md); a device not assigned, or whose task is done, waits."""
        task = info.assigned.get(self.device.device_id) if info.assigned is not None else None
        if task is None or (run, task) == self.task_done:
            return False
        self.handle_round(info, descriptor_bytes)
        self.task_done = (run, task)  # after it: a round that failed (no global state yet) is tried again
        if run:
            self.trained_runs.add(run)
        return True

    def evaluates(self, info: RoundInfo) -> bool:
        """Whether the device evaluates at the start of ``info``'s round (:func:`fedge.common.rounds.evaluates_at`)."""
        return evaluates_at(info.round, self.eval_every, final=info.is_final)

    def measure(self, info: RoundInfo) -> dict[str, float]:
        """The metrics this device would report if ``info``'s round started now: the published global state
        applied and evaluated exactly as at the start of a round (:meth:`handle_round`), on a copy of its method,
        so that the device, its random streams and the process's are left as they were. The experimenter's
        measurement, not the device's work (an asynchronous simulation's fleet curve,
        :mod:`fedge.sim.clocked_async`)."""
        method, model_round = self.method, self.model_round
        np_state = np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            try:
                self.method = measuring_copy(method)
                self._apply_global(info, self._fetch_global(info))
                return self.method.evaluate()
            finally:
                self.method, self.model_round = method, model_round
                np.random.set_state(np_state)

    def _fetch_global(self, info: RoundInfo) -> dict[str, bytes]:
        fetched = {}
        for name in self.method.needed_artifacts(info):
            data = self.transport.fetch_global(name)
            if data is not None:  # None: nothing aggregated yet (first round)
                fetched[name] = data
        return fetched

    def _apply_global(self, info: RoundInfo, fetched: dict[str, bytes]) -> None:
        """Decode the fetched global state and hand it to the method (projected under [privacy])."""
        artifacts = {}
        for name, data in fetched.items():
            msg = Message.from_bytes(data)
            artifacts[name] = msg.tensors
            self.model_round = max(self.model_round, msg.round)
        if self.method.ctx.privacy is not None:
            artifacts = project_global(artifacts, self.method.ctx.privacy)
        self.method.apply_global(info, artifacts)

    def handle_round(self, info: RoundInfo, descriptor_bytes: int = 0, *, secure: object = None) -> None:
        """Evaluate, train and upload for ``info``'s round. ``secure``: the descriptor's ``secagg`` tasks — the
        arrays then go into the group's secure sum (:mod:`fedge.edge.secure`) and the update carries metrics."""
        fetched = self._fetch_global(info)
        # info.train_s: this round's work on the device's own clock, from here. The fetches above wait on the
        # link (a subscription's round trip, then the bytes), which the virtual clock counts as the download,
        # not as the device's compute; decoding the global state is the device's work and counts.
        started = self.timer()
        down = descriptor_bytes + sum(len(data) for data in fetched.values())
        self._apply_global(info, fetched)
        metrics = {}
        if self.evaluates(info):
            metrics = self.method.evaluate()
            self.method.keep_best(info.round, metrics)  # the model as of this round: the one shipped if best
        if info.is_final:
            arrays: dict[str, Any] = {}
            extra: dict[str, Any] = {}
        else:
            self.method.schedule(info)  # [train] lr_schedule: this round's learning rate
            arrays, extra = self.method.train_round(info)
            mech = self.method.ctx.privacy
            if mech is not None:
                # On the device, before anything leaves it; fresh OS entropy, so the coordinator (or anyone
                # who knows the run's seed) cannot regenerate the noise and subtract it.
                arrays = privatize(arrays, mech, self._noise_rng)
        train_s = round(self.timer() - started, 6)
        stage_up = 0
        if secure is not None and not info.is_final:  # the stages wait on the coordinator: not the device's work
            arrays, stage_up, down = self._secure(info, secure, arrays, down)
        update = Message(
            "update", self.device.device_id, info.round, self.fleet, tensors=arrays,
            info={"metrics": metrics, "bytes_down": down, "num_samples": self.device.num_samples, **extra,
                  "train_s": train_s},
        )
        data = update.to_bytes(self.device.upload_precision)
        self.transport.send_update(data)
        self.traffic.append(Traffic(info.round, down, len(data) + stage_up))
        self.last_round = info.round
        log.debug("%s: round %d (%s) up %d B down %d B", self.device.device_id, info.round, info.phase,
                  len(data), down)

    def _secure_replanned(self, info: RoundInfo, raw: bytes) -> bool:
        """A round this device answered re-announced with another secure sum (a coordinator restarted after this
        device's update): run the new sum's stages with the arrays it summed, without training again (its
        transport sent the cached update again, which carries metrics only). Whether it did."""
        answered = self._secure_answered
        if answered is None or answered[0] != info.round or info.is_final:
            return False
        seed = task_seed(self.device.device_id, raw, info.round)
        if seed is None or seed == answered[1]:
            return False
        log.warning("%s: round %d was re-announced with another secure sum (a restarted coordinator): its stages "
                    "again, with the arrays it summed", self.device.device_id, info.round)
        self._secure_stages(info, answered[2])
        return True

    def _secure(self, info: RoundInfo, tasks: object, arrays: dict[str, Any],
                down: int) -> tuple[dict[str, Any], int, int]:
        """This device's part of its group's secure sum of ``arrays``; what its update then carries (nothing),
        the stage bytes sent, and ``down`` plus the stage bytes received."""
        me = self.device.device_id
        try:
            task = task_for(me, tasks)
        except Refusal as exc:
            log.warning("%s: round %d: unreadable secure-aggregation task: %s", me, info.round, exc.message)
            return {}, 0, down
        if task is None:  # not in the round's groups (it joined after the round was planned): nothing to sum
            log.info("%s: round %d: in no secure group this round; its update carries metrics only", me, info.round)
            return {}, 0, down
        # The values a plain upload carries (at this device's upload precision): the secure sum is the plain
        # round's sum, and the in-process simulation's (fedge.sim.secure sums the decoded uploads).
        wire = Message("update", me, info.round, self.fleet, tensors=arrays).to_bytes(self.device.upload_precision)
        out = self._secure_stages(info, Message.from_bytes(wire).tensors, task)
        return {}, out.bytes_up, down + out.bytes_down

    def _secure_stages(self, info: RoundInfo, arrays: dict[str, Any], task: SecureTask | None = None
                       ) -> SecureOutcome:
        """The four stages of this device's task in the round's current descriptor (else ``task``), again for each
        re-planned sum (:data:`MAX_REPLANS` at most); what they sent and received in all."""
        me = self.device.device_id
        total = SecureOutcome()
        for _ in range(MAX_REPLANS + 1):
            current = self._current_task(info.round)
            task = current or task
            if task is None:
                break
            seed = task.setup.seed
            replanned = functools.partial(self._replanned, info.round, seed)
            out = secure_upload(self.transport, me, task, arrays, num_samples=self.device.num_samples,
                                wait_until=info.deadline, superseded=replanned)
            total.bytes_up += out.bytes_up
            total.bytes_down += out.bytes_down
            total.sent, total.error = out.sent, out.error
            total.refusals.update(out.refusals)
            self._secure_answered = (info.round, seed, arrays)
            if not out.superseded:
                break
            log.warning("%s: round %d was re-announced with another secure sum (a restarted coordinator): its "
                        "stages again, with the same arrays", me, info.round)
        return total

    def _current_task(self, rnd: int) -> SecureTask | None:
        """This device's secure task in the current descriptor, if that is of round ``rnd``."""
        raw = self.transport.current_round()
        try:
            msg = Message.from_bytes(raw) if raw else None
            return task_for(self.device.device_id, msg.info.get("secagg")) if msg and msg.round == rnd else None
        except (PayloadError, Refusal):
            return None

    def _replanned(self, rnd: int, seed: bytes) -> bool:
        """Whether the current descriptor plans another secure sum of round ``rnd`` for this device than ``seed``'s."""
        now = task_seed(self.device.device_id, self.transport.current_round(), rnd)
        return now is not None and now != seed


def measuring_copy(method: DeviceMethod) -> DeviceMethod:
    """A copy of ``method`` to measure with (:meth:`DeviceAgent.measure`): its model, state and random
    generators copied, the data sets and the process's shared evaluation cache shared (read only)."""
    ctx = method.ctx
    shared: list[Any] = [ctx.global_eval]
    for ds in (ctx.train, ctx.local_test, ctx.global_test):
        if ds is not None:
            shared += [ds, ds.x, ds.y]
    memo = {id(obj): obj for obj in shared if obj is not None}
    return copy.deepcopy(method, memo)
