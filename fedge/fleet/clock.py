"""The virtual clock: how long each device's work takes, and how long each synchronous round lasts.

Per device (:class:`DeviceClock`), for one round's work:

* **download** — the descriptor and the global state it fetched: ``RTT/2 + bytes × 8 ÷ downlink``;
* **compute** — its local training, ``3 × MACs × samples × epochs ÷`` the speed model's rate for its
  model and batch (:mod:`fedge.profiles.speed`, or the profile's ``[measured]`` rates), plus the forward
  passes over its training samples its method makes for the statistics it uploads (FedProto's prototypes:
  one; :meth:`fedge.common.settings.MethodSettings.statistics_passes`) at the same rate, plus, in a round
  whose start the device evaluates (``[run] eval_every``, :func:`fedge.common.rounds.evaluates_at`), one
  forward pass over its test images (its local test split and the global test set) at the same rate, plus
  the round's fixed costs (applying the global state, the optimizer's set-up, encoding the update:
  :meth:`fedge.profiles.speed.SpeedModel.round_fixed_s`);
* **upload** — its update: ``RTT/2 + bytes × 8 ÷ uplink``;

each part times a seeded mean-one lognormal jitter factor (σ = ``[clock] jitter``), drawn from the
device's index, the round and the part, so a run repeats exactly whatever order devices are asked in.
Availability (:mod:`fedge.fleet.availability`) says when the device is online.

A **synchronous round** (:meth:`FleetClock.sync_round`) starts when the previous one ended; each
participant starts at once, and its update arrives at start + its total, unless it goes offline
first (the coordinator hears its last will then) or misses ``deadline_s``; the round lasts until the
coordinator has heard of every participant, or the whole deadline when one missed it. An
asynchronous scheduler would use the same :meth:`DeviceClock.timing` and availability per event.

Torch-free: sizes come from the devices' slots (:mod:`fedge.fleet.slots`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fedge.common.families import ModelSpec
from fedge.common.heat import hot_after
from fedge.common.rounds import evaluates_at
from fedge.errors import ConfigError
from fedge.fleet.availability import Availability, OnOff, read_trace
from fedge.fleet.config import FleetConfig
from fedge.fleet.sim_sections import ClockSection
from fedge.fleet.slots import DeviceSlot, device_profile, test_labels
from fedge.profiles.power import Power
from fedge.profiles.schema import Network
from fedge.profiles.speed import TRAIN_MACS_FACTOR, SpeedModel, speed_model
from fedge.profiles.thermal import Thermal

log = logging.getLogger(__name__)

_PARTS = {"download": 1, "compute": 2, "upload": 3}  # jitter streams


@dataclass(frozen=True)
class TrainWork:
    """One round of local training: ``epochs`` passes over ``samples`` samples of ``spec`` at ``batch``, then
    ``statistics_passes`` forward passes over them (the method's class statistics); and an evaluation, when the
    round has one, of ``eval_samples`` test images (one forward pass each)."""

    spec: ModelSpec
    batch: int
    samples: int
    epochs: int
    eval_samples: int = 0
    statistics_passes: int = 0

    @property
    def macs(self) -> float:
        """Training multiply-accumulates, 3 × forward MACs per sample × samples × epochs, and the statistics'
        forward MACs × samples × statistics passes."""
        per_sample = self.spec.macs() * self.samples
        return float(TRAIN_MACS_FACTOR * per_sample * self.epochs + per_sample * self.statistics_passes)

    @property
    def eval_macs(self) -> float:
        """One evaluation's multiply-accumulates: forward MACs per image × test images."""
        return float(self.spec.macs() * self.eval_samples)


@dataclass(frozen=True)
class Timing:
    """How long one device's work of one round takes, by part, in virtual seconds."""

    download_s: float
    compute_s: float
    upload_s: float

    @property
    def total_s(self) -> float:
        return self.download_s + self.compute_s + self.upload_s


@dataclass
class DeviceClock:
    """One device's timing model: its speed, its link, its availability and its jitter."""

    device_id: str
    index: int
    speed: SpeedModel
    network: Network
    availability: Availability
    work: TrainWork
    """What one training round of this device is (its model, batch, samples and epochs)."""
    jitter: float = 0.0
    seed: int = 0
    eval_every: int = 1
    """``[run] eval_every``: which rounds' starts the device evaluates (:func:`evaluates_at`)."""
    power: Power | None = None
    """Its profile's energy model (``[power]``; None: its work has no joules)."""
    thermal: Thermal | None = None
    """Its profile's thermal model (``[thermal]``; None: it never throttles)."""
    temp_c: float | None = None
    """Its temperature at ``temp_at`` (thermal model only; None: the air's, at the start)."""
    temp_at: float = 0.0
    hot: bool = False
    """Whether its firmware was throttling at ``temp_at`` (the hysteresis of :func:`fedge.common.heat.hot_after`)."""

    def _factor(self, rnd: int, part: str) -> float:
        if self.jitter <= 0:
            return 1.0
        z = np.random.default_rng([self.seed & 0xFFFF_FFFF, self.index, rnd, _PARTS[part]]).standard_normal()
        return math.exp(self.jitter * z - self.jitter**2 / 2)  # mean one

    def compute_s(self, work: TrainWork | None, rnd: int = 0) -> float:
        """Seconds of ``work`` on this device (None: no training, e.g. the final evaluation)."""
        if work is None:
            return 0.0
        # its training and statistics passes, and the round's fixed costs (applying the state, encoding: speed model)
        rate = self.speed.mac_rate(work.spec, work.batch)
        seconds = work.macs / rate + self.speed.round_fixed_s(work.spec, work.batch)
        return seconds * self._factor(rnd, "compute")

    def eval_s(self, rnd: int, eval_round: int | None = None) -> float:
        """Seconds of the evaluation at the start of round ``eval_round`` (default ``rnd``; asynchronous mode: the
        version being built), 0 if that round has none; ``rnd`` seeds the jitter as in :meth:`compute_s`.

        At the training rate of the device's model and batch: inference runs no backward pass but the same
        kernels, and on this host an evaluation's MACs ran at 0.6-0.9x of training's rate (docs/results.md,
        "Is the clock honest?"), so this errs short."""
        w = self.work
        if not w.eval_samples or not evaluates_at(rnd if eval_round is None else eval_round, self.eval_every):
            return 0.0
        return w.eval_macs / self.speed.mac_rate(w.spec, w.batch) * self._factor(rnd, "compute")

    def train_s(self, rnd: int, eval_round: int | None = None) -> float:
        """Seconds of this device's own work in round or task ``rnd``: its training (its ``work``) and the
        evaluation that starts the round, if any (:meth:`eval_s`). What a simulated device reports as its
        ``train_s``, as a real one measures both."""
        return self.compute_s(self.work, rnd) + self.eval_s(rnd, eval_round)

    def transfer_s(self, nbytes: int, *, up: bool, rnd: int = 0) -> float:
        """Seconds to move ``nbytes`` over the link: half the round-trip time, then bytes × 8 ÷ rate."""
        if nbytes <= 0:
            return 0.0
        kbps = self.network.uplink_kbps if up else self.network.downlink_kbps
        wire = self.network.latency_ms / 2000 + nbytes * 8 / (kbps * 1000)
        return wire * self._factor(rnd, "upload" if up else "download")

    def temperature(self, t: float) -> float | None:
        """Its temperature at ``t`` (not before its last piece of work), idling since then (None: no thermal model)."""
        th = self.thermal
        if th is None or self.power is None:
            return None
        temp = th.ambient_c if self.temp_c is None else self.temp_c
        return th.after(temp, self.power.idle_w, t - self.temp_at)

    def throttled(self, t: float) -> bool:
        """Whether its firmware slows it at ``t``: it reached its thermal limit and has not yet cooled below its
        ``resume_c`` (:func:`fedge.common.heat.hot_after`; idling, its temperature moves monotonically, so the state
        at its last piece of work and the temperature now decide)."""
        temp = self.temperature(t)
        return temp is not None and self.thermal is not None and hot_after(self.hot, temp, self.thermal.limits)

    def _heat(self, start: float, t: Timing, worked_s: float) -> None:
        """Its temperature after a piece of work started at ``start``: idle power while it transfers, busy power
        while it computes, for the ``worked_s`` seconds it worked."""
        th, power = self.thermal, self.power
        if th is None or power is None:
            return
        temp = self.temperature(start)
        assert temp is not None
        hot = self.throttled(start)
        left = worked_s
        for part, watts in ((t.download_s, power.idle_w), (t.compute_s, power.busy_w), (t.upload_s, power.idle_w)):
            s = min(part, max(0.0, left))
            temp, left = th.after(temp, watts, s), left - s
            hot = hot_after(hot, temp, th.limits)  # each part heats or cools monotonically
        self.temp_c, self.temp_at, self.hot = temp, start + worked_s, hot

    def timing(self, rnd: int, *, bytes_down: int, bytes_up: int, work: TrainWork | None,
               eval_round: int | None = None, start: float | None = None) -> Timing:
        """The parts of this device's work in round ``rnd`` (its compute: ``work`` and, when ``work`` is
        given, the round's evaluation, :meth:`eval_s`).

        ``rnd`` only seeds the jitter: an asynchronous scheduler passes the device's task counter (its n-th
        piece of work) and asks :attr:`availability` whether the device is still online when the work ends
        (``availability.online_until(start) >= start + timing.total_s``) and when it can start the next
        (``availability.next_online(t)``).
        """
        compute = self.compute_s(work, rnd) + (self.eval_s(rnd, eval_round) if work is not None else 0.0)
        if start is not None and self.thermal is not None and self.throttled(start):
            compute /= self.thermal.throttle_share  # hot at its start: the firmware caps its clock (thermal.py)
        return Timing(self.transfer_s(bytes_down, up=False, rnd=rnd), compute,
                      self.transfer_s(bytes_up, up=True, rnd=rnd))

    def task_j(self, t: Timing, *, bytes_down: int, bytes_up: int, worked_s: float | None = None) -> float | None:
        """Joules of a piece of work timed ``t`` (None without a ``[power]`` model): download, compute and upload in
        that order, cut after ``worked_s`` seconds (the device went offline, or its round ended at a missed
        deadline); a transfer cut short moved its share of the bytes."""
        if self.power is None:
            return None
        left = t.total_s if worked_s is None else max(0.0, worked_s)
        done = []
        for part in (t.download_s, t.compute_s, t.upload_s):
            done.append(min(part, left))
            left -= done[-1]

        def share(i: int, whole: float) -> float:
            return done[i] / whole if whole > 0 else 1.0

        return self.power.task_j(compute_s=done[1], transfer_s=done[0] + done[2],
                                 bytes_down=round(bytes_down * share(0, t.download_s)),
                                 bytes_up=round(bytes_up * share(2, t.upload_s)))

    def record(self, start: float, t: Timing, *, bytes_down: int, bytes_up: int, until: float,
               lost: str = "") -> DeviceRound:
        """The timeline of a piece of work started at ``start`` and timed ``t``, with its joules: it worked until
        its end or ``until``, whichever comes first."""
        finish = start + t.total_s
        worked = min(finish, until) - start
        joules = self.task_j(t, bytes_down=bytes_down, bytes_up=bytes_up, worked_s=worked)
        temp, hot = self.temperature(start), self.throttled(start)
        self._heat(start, t, worked)
        return DeviceRound(start, t.download_s, t.compute_s, t.upload_s, finish, not lost, lost, joules, temp, hot)


@dataclass(frozen=True)
class DeviceRound:
    """One participant of one round, in virtual time."""

    start_s: float
    download_s: float
    compute_s: float
    upload_s: float
    finish_s: float
    delivered: bool
    lost: str = ""
    """Why its update never arrived: ``"offline"`` (went offline first) or ``"deadline"``; empty if delivered."""
    joules: float | None = None
    """What the work cost the device (:meth:`DeviceClock.task_j`; None: its profile has no ``[power]``)."""
    temp_c: float | None = None
    """Its temperature when the work started (None: no ``[thermal]`` model)."""
    throttled: bool = False
    """Whether its firmware throttled it when the work started (it computed at ``[thermal] throttle_share``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RoundTime:
    """One round in virtual time: when it started and ended, and each participant's timeline."""

    round: int
    start_s: float
    end_s: float
    devices: dict[str, DeviceRound] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass
class FleetEvaluation:
    """Every device's metrics at one moment of virtual time, after ``after`` versions: the experimenter's
    measurement of an asynchronous simulation (its fleet curve; :mod:`fedge.sim.clocked_async`), which costs no
    virtual time. ``metrics`` maps each device to what it would report evaluating then (``acc_global``, ...)."""

    after: int
    virtual_s: float
    metrics: dict[str, dict[str, float]]


@dataclass
class Participation:
    """What one device did in a round: the bytes it moved and whether it trained."""

    bytes_down: int
    bytes_up: int
    trained: bool


class FleetClock:
    """Virtual time of a whole fleet: the devices' clocks, the current time, every round so far."""

    def __init__(self, devices: Sequence[DeviceClock], *, deadline_s: float = 0.0) -> None:
        self.devices = {d.device_id: d for d in devices}
        self.deadline_s = deadline_s
        self.now = 0.0
        self.rounds: list[RoundTime] = []
        self.evaluations: list[FleetEvaluation] = []
        """Asynchronous simulations: the whole fleet evaluated at fixed moments (:class:`FleetEvaluation`)."""
        self.other_work: dict[str, list[DeviceRound]] = {}
        """Asynchronous simulations: work that no version's record holds — a task still under way when the run
        ended, a device's earlier task to end within the same version as another — busy all the same."""

    def online(self, t: float | None = None) -> set[str]:
        """The devices online at ``t`` (default: now)."""
        t = self.now if t is None else t
        return {d for d, c in self.devices.items() if c.availability.online(t)}

    def advance_to_online(self, ids: Iterable[str] | None = None) -> float:
        """Move ``now`` to the first moment one of ``ids`` (default: every device) is online; returns it.

        Raises :class:`ConfigError` when none of them ever comes online again (a trace that ends).
        """
        pool = list(self.devices if ids is None else ids)
        t = min((self.devices[d].availability.next_online(self.now) for d in pool), default=math.inf)
        if math.isinf(t):
            raise ConfigError(f"no device comes online after virtual time {self.now:g} s",
                              hint="the availability trace ends before the run: extend it, or use fewer rounds")
        self.now = max(self.now, t)
        return self.now

    def sync_round(self, rnd: int, participants: Mapping[str, Participation], *, record: bool = True) -> RoundTime:
        """Time one synchronous round in which ``participants`` worked (each started at ``now``); advances now.

        A participant's update is lost when it goes offline before it finishes, or finishes after
        ``deadline_s``. The round ends when the coordinator has heard of every participant: its
        update arrived, it went offline (its last will), or the deadline passed (the whole deadline
        when one was lost to it).
        """
        start = self.now
        out = RoundTime(rnd, start, start)
        heard = [start]  # when the coordinator learns each participant's outcome
        timed: dict[str, tuple[Timing, str, float]] = {}
        for dev_id, p in participants.items():
            c = self.devices[dev_id]
            t = c.timing(rnd, bytes_down=p.bytes_down, bytes_up=p.bytes_up, work=c.work if p.trained else None,
                         start=start)
            finish = start + t.total_s
            lost = ""
            gone = c.availability.online_until(start)
            if self.deadline_s and t.total_s > self.deadline_s and start + self.deadline_s < gone:
                lost = "deadline"
                heard.append(start + self.deadline_s)
            elif finish > gone:
                lost = "offline"
                heard.append(gone)  # its last will: the coordinator stops waiting for it
            else:
                heard.append(finish)
            timed[dev_id] = (t, lost, gone)
        end = max(heard)
        if self.deadline_s and any(lost == "deadline" for _, lost, _ in timed.values()):
            end = start + self.deadline_s
        for dev_id, (t, lost, gone) in timed.items():
            p = participants[dev_id]
            # it works until done, offline, or the round's end (a missed deadline: busy_s cuts it there too)
            out.devices[dev_id] = self.devices[dev_id].record(start, t, bytes_down=p.bytes_down, bytes_up=p.bytes_up,
                                                              until=min(gone, end), lost=lost)
        out.end_s = end
        if record:
            self.now = end
            self.rounds.append(out)
        return out

    # -- what a report shows ------------------------------------------------------------------
    def busy_s(self, device_id: str) -> float:
        """Virtual seconds ``device_id`` spent working — downloading, training and uploading alike, in both modes —
        each piece of work from its own start until it ended, the device went offline, its round ended (a missed
        synchronous deadline) or the run did (:attr:`other_work`). An asynchronous task starts before the version
        it ends in, so it is timed from the task's start, not the version's."""
        return self.busy_within(device_id, 0.0, math.inf)

    def work(self, device_id: str) -> list[tuple[DeviceRound, float]]:
        """Every piece of work of ``device_id`` with the moment it stopped: its end, its going offline, its round's
        end (a missed deadline) or the run's (:attr:`other_work`)."""
        avail = self.devices[device_id].availability
        work = [(w, r.end_s) for r in self.rounds if (w := r.devices.get(device_id)) is not None]
        work += [(w, self.now) for w in self.other_work.get(device_id, [])]
        return [(w, min(w.finish_s, end, avail.online_until(w.start_s))) for w, end in work]

    def busy_within(self, device_id: str, t0: float, t1: float) -> float:
        """Virtual seconds of :meth:`busy_s` that fall between ``t0`` and ``t1``."""
        return sum(max(0.0, min(stop, t1) - max(w.start_s, t0)) for w, stop in self.work(device_id))

    def shares(self, device_id: str) -> dict[str, float]:
        """Fractions of the run's virtual time ``device_id`` was busy, idle (online, no work) and offline."""
        total = self.now
        if total <= 0:
            return {"busy": 0.0, "idle": 1.0, "offline": 0.0}
        busy = min(self.busy_s(device_id), total)
        online = self.devices[device_id].availability.online_share(0.0, total) * total
        busy = min(busy, online)
        return {"busy": busy / total, "idle": max(0.0, online - busy) / total, "offline": 1 - online / total}


def _work(cfg: FleetConfig, slot: DeviceSlot, global_test: int) -> TrainWork:
    p = slot.plan
    epochs = cfg.train.local_epochs or p.local_epochs
    return TrainWork(slot.spec, cfg.train.batch_size or p.batch_size, max(1, slot.num_samples), epochs,
                     eval_samples=slot.num_test + global_test,
                     statistics_passes=cfg.method_config.statistics_passes(epochs))


def global_test_size(cfg: FleetConfig) -> int:
    """Images in the test set every device of ``cfg`` evaluates on (the dataset's test split; 0 for a fleet on
    its own data, whose test images only the devices know)."""
    return 0 if cfg.own_data else len(test_labels(cfg))


def _availability(cfg: FleetConfig, slot: DeviceSlot, clock: ClockSection, seed: int,
                  trace: Mapping[str, Availability] | None) -> Availability:
    if clock.availability == "trace":
        assert trace is not None
        return trace[slot.device_id]
    if clock.availability == "onoff":
        g = cfg.devices[slot.group]
        on = g.online_mean_s if g.online_mean_s is not None else clock.online_mean_s
        off = g.offline_mean_s if g.offline_mean_s is not None else clock.offline_mean_s
        return OnOff(on, off, (seed & 0xFFFF_FFFF, slot.index, 0xA7))
    return Availability()


def fleet_clock(cfg: FleetConfig, slots: Sequence[DeviceSlot]) -> FleetClock:
    """The virtual clock of ``cfg``'s devices (``slots``, in fleet order) per its ``[clock]`` table."""
    ck = cfg.clock
    seed = cfg.run.seed if ck.seed is None else ck.seed
    trace = None
    if ck.availability == "trace":
        path = cfg.base_dir / ck.trace
        trace = read_trace(path, [s.device_id for s in slots])
    clocks = []
    global_test = global_test_size(cfg)
    for slot in slots:
        profile = device_profile(cfg, slot.group)
        clocks.append(DeviceClock(slot.device_id, slot.index, speed_model(profile), profile.network,
                                  _availability(cfg, slot, ck, seed, trace), _work(cfg, slot, global_test),
                                  ck.jitter, seed, cfg.run.eval_every, profile.power, profile.thermal))
    return FleetClock(clocks, deadline_s=ck.deadline_s)
