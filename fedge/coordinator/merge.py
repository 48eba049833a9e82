"""Admitting a partial aggregate: the checks a ``partial`` message passes before it is merged.

A partial comes from an aggregation worker or a relay (see :mod:`fedge.coordinator.partial`). Its
sender is the account whose topic it arrived on (``fedge/{fleet}/partials/{account}``, which the broker
ACL lets only that account write). Like a device's update it is untrusted input, inside the same
error boundary: any failure refuses *that partial* — counted as ``partial-{reason}`` under its sender,
logged — and the coordinator carries on. The checks, in order:

* the envelope: kind ``partial``, this fleet, sender = the topic's account (``spoofed``), an account
  allowed to speak for the devices it lists (``foreign``), this round (``stale`` / ``future``), a
  message id not merged before (``duplicate``);
* the devices it lists: registered here (``unregistered``), none already counted in this round
  (``overlap``: a device's update may be counted once; the whole partial is refused, since a sum
  cannot be taken apart), each with an update report that passes the same checks a device's own
  update info does (``info``) — or, in a **compact** partial, listed by id only (``ids``: runs of
  numbered ids, :func:`~fedge.coordinator.partial.pack_ids`) with one :class:`Summary` of their
  reports (totals of bytes, metric sums and counts, training time) bounded by their number (``summary``);
* the tensors: exactly what this coordinator's strategy would produce for those devices
  (:func:`~fedge.coordinator.partial.check_partial`: names, shapes, dtypes, finite, weights within
  the devices' samples), none in the final round or in a round summed securely (its sums come masked:
  :mod:`fedge.coordinator.secure`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.transport import Inbound
from fedge.coordinator.gate import UNKNOWN_SENDER, UpdateGate, reason_of
from fedge.coordinator.partial import (
    MAX_PARTIAL_DEVICES,
    MAX_PARTIAL_INFO_BYTES,
    check_partial,
    check_splittable,
    merge_partial,
    template,
    unpack_ids,
    weight_budget,
)
from fedge.coordinator.report import RoundReport, record_accepted
from fedge.coordinator.strategy import Strategy
from fedge.coordinator.validation import MAX_TRAIN_S, Rejected, parse_update_info

log = logging.getLogger(__name__)

MAX_COUNT = 1 << 30  # a refusal count a partial may report for one (device, reason)


@dataclass(frozen=True)
class MergedDevice:
    """One device's update as a partial reports it (already checked)."""

    device: DeviceInfo
    bytes_up: int
    metrics: dict[str, float]
    bytes_down: int
    info: dict[str, Any]
    raw_info: dict[str, Any]  # the update's info as the device sent it (forwarded by a relay)


MAX_METRICS = 64  # metric names a summary may carry
MAX_METRIC_CHARS = 64


@dataclass
class Summary:
    """Totals of the update reports of the devices a compact partial lists (instead of one entry each):
    the root's report says how many devices each aggregator counted, the bytes they moved, the mean of
    every metric and their training time, without a per-device line (docs/scale.md)."""

    devices: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]
    train_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0])  # [sum, max, count]

    def add(self, up: int, down: int, metrics: Mapping[str, float], train_s: object = None) -> None:
        """One device's (checked) update report."""
        self.devices += 1
        self.bytes_up += up
        self.bytes_down += down
        for k, v in metrics.items():
            if k in self.metrics or len(self.metrics) < MAX_METRICS:
                acc = self.metrics.setdefault(k, [0.0, 0])
                acc[0] += float(v)
                acc[1] += 1
        if isinstance(train_s, int | float) and not isinstance(train_s, bool):
            self.train_s = [self.train_s[0] + train_s, max(self.train_s[1], train_s), self.train_s[2] + 1]

    def merge(self, other: Summary) -> None:
        self.devices += other.devices
        self.bytes_up += other.bytes_up
        self.bytes_down += other.bytes_down
        for k, (total, n) in other.metrics.items():
            if k in self.metrics or len(self.metrics) < MAX_METRICS:
                acc = self.metrics.setdefault(k, [0.0, 0])
                acc[0] += total
                acc[1] += n
        self.train_s = [self.train_s[0] + other.train_s[0], max(self.train_s[1], other.train_s[1]),
                        self.train_s[2] + other.train_s[2]]

    def to_json(self) -> dict[str, Any]:
        return {"devices": self.devices, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "metrics": {k: [v[0], int(v[1])] for k, v in self.metrics.items()},
                "train_s": [self.train_s[0], self.train_s[1], int(self.train_s[2])]}

    def mean(self, metric: str) -> float | None:
        """The mean of ``metric`` over the devices that reported it (None: none did)."""
        total, n = self.metrics.get(metric, (0.0, 0))
        return total / n if n else None

    @classmethod
    def parse(cls, raw: object, devices: int, max_bytes: int) -> Summary:
        """A summary from the network, for ``devices`` listed devices: every number a count or a finite value
        within what that many devices can report (:class:`Rejected` ``summary`` otherwise)."""
        if not isinstance(raw, dict) or set(raw) != {"devices", "bytes_up", "bytes_down", "metrics", "train_s"}:
            raise Rejected("summary", "a compact partial's summary must hold exactly devices, bytes_up, bytes_down, "
                                      "metrics and train_s")

        def count(v: object, bound: float, what: str) -> int:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= bound:
                raise Rejected("summary", f"summary {what} must be an integer in [0, {bound:g}]")
            return v

        def number(v: object, lo: float, hi: float, what: str) -> float:
            if isinstance(v, bool) or not isinstance(v, int | float) or not isfinite(v) or not lo <= v <= hi:
                raise Rejected("summary", f"summary {what} must be a finite number in [{lo:g}, {hi:g}]")
            return float(v)

        if count(raw["devices"], devices, "devices") != devices:
            raise Rejected("summary", f"the summary counts {raw['devices']} devices, the partial lists {devices}")
        out = cls(devices, count(raw["bytes_up"], devices * max_bytes, "bytes_up"),
                  count(raw["bytes_down"], devices * float(1 << 62), "bytes_down"))
        metrics = raw["metrics"]
        if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
            raise Rejected("summary", f"summary metrics must be an object of at most {MAX_METRICS} names")
        for k, v in metrics.items():
            if not 0 < len(k) <= MAX_METRIC_CHARS or not isinstance(v, list) or len(v) != 2:
                raise Rejected("summary", f"summary metric {str(k)[:40]!r} must be [sum, count]")
            out.metrics[k] = [number(v[0], -1e300, 1e300, f"metric {k[:40]!r}"),
                              count(v[1], devices, f"metric {k[:40]!r} count")]
        t = raw["train_s"]
        if not isinstance(t, list) or len(t) != 3:
            raise Rejected("summary", "summary train_s must be [sum, max, count]")
        n = count(t[2], devices, "train_s count")
        out.train_s = [number(t[0], 0, n * MAX_TRAIN_S, "train_s sum"), number(t[1], 0, MAX_TRAIN_S, "train_s max"), n]
        return out


@dataclass(frozen=True)
class MergedSummary:
    """The devices a compact partial lists, counted together under one :class:`Summary` (already checked)."""

    devices: list[DeviceInfo]
    summary: Summary


# what a merged partial hands on: one entry per device it details, one summary for those it lists compactly
DeviceSink = Callable[[MergedDevice | MergedSummary], None]


def partial_info(descriptor: str, devices: Mapping[str, tuple[int, dict[str, Any]]],
                 rejected_by_device: Mapping[str, Mapping[str, int]], *, ids: list[Any] | None = None,
                 summary: Summary | None = None) -> dict[str, Any]:
    """The envelope info of a partial: the descriptor it answers, each detailed device's (bytes up, update
    info), the compactly listed devices (``ids``, packed) with their ``summary``, and the refusals its sender
    counted (hellos excepted: every node registers hellos itself)."""
    info: dict[str, Any] = {"descriptor": descriptor}
    if devices or ids is None:
        info["devices"] = {d: {"up": up, "info": info} for d, (up, info) in devices.items()}
    if ids is not None:
        info["ids"], info["summary"] = ids, (summary or Summary()).to_json()
    info["rejected_by_device"] = {d: {r: n for r, n in c.items() if not r.startswith("hello-")}
                                  for d, c in rejected_by_device.items()
                                  if any(not r.startswith("hello-") for r in c)}
    return info


def merged_into(report: RoundReport, sender: str | None) -> DeviceSink:
    """A sink that records each merged device in ``report`` as the engine records a device's own update; the
    devices of a compact partial are recorded as accepted, their summary under ``report.aggregated``."""
    key = sender or UNKNOWN_SENDER

    def sink(e: MergedDevice | MergedSummary) -> None:
        if isinstance(e, MergedSummary):
            report.accepted += [d.device_id for d in e.devices]
            total = Summary(**report.aggregated[key]) if key in report.aggregated else Summary()
            total.merge(e.summary)
            report.aggregated[key] = total.to_json()
            report.partials[key] = report.partials.get(key, 0) + len(e.devices)
            return
        record_accepted(report, e.device.device_id, bytes_up=e.bytes_up, bytes_down=e.bytes_down,
                        metrics=e.metrics, info=e.info)
        report.partials[key] = report.partials.get(key, 0) + 1

    return sink


class PartialMerger:
    """Checks partials and merges them into ``strategy``'s accumulators; refusals count in ``gate``."""

    def __init__(self, strategy: Strategy, gate: UpdateGate, *, fleet: str, max_bytes: int,
                 allowed: Mapping[str, Collection[str]] | None = None) -> None:
        self.strategy = strategy
        self.gate = gate
        self.fleet = fleet
        self.max_bytes = max_bytes
        # account -> the devices it may report (None: any account the broker lets publish a partial,
        # for any registered device)
        self.allowed = allowed
        self._round = 0
        self._final = False
        self._seen_ids: set[str] = set()
        self.merged = 0  # partials merged since start

    def begin_round(self, rnd: int, *, final: bool) -> None:
        self._round, self._final, self._seen_ids = rnd, final, set()

    def admit(self, item: Inbound, counted: Collection[str], sink: DeviceSink) -> list[str]:
        """Check and merge one partial; the ids of the devices it added (none if refused, counted).

        ``counted``: the devices already counted in this round (a partial listing one is refused);
        ``sink`` receives each device's report entry once the partial is merged.
        """
        sender = item.origin
        try:
            if item.reject is not None:
                raise Rejected(*item.reject)
            msg = Message.from_bytes(item.data, max_bytes=self.max_bytes, max_info_bytes=MAX_PARTIAL_INFO_BYTES)
            sender = sender or msg.sender
            entries, compact = self._check(msg, item, counted)
            if self.strategy.secure_sums and msg.tensors:  # a secure round's values arrive masked, summed
                raise Rejected("schema", f"{msg.sender}'s partial carries tensors in a round summed securely")
            if not self._final:
                check_splittable(self.strategy)
                devices = [e.device for e in entries] + (compact.devices if compact is not None else [])
                check_partial(msg.tensors, template(self.strategy, self._round, devices), len(devices),
                              weight_budget(devices))
            elif msg.tensors:
                raise Rejected("schema", f"{msg.sender}'s partial for the final round carries tensors")
            self._count_refusals(msg.info.get("rejected_by_device", {}))
        except Exception as exc:  # the error boundary: a partial never stops the coordinator
            self.refuse(sender, exc)
            return []
        if not self._final:
            merge_partial(self.strategy, msg.tensors)
        self._seen_ids.add(msg.msg_id)
        ids = [e.device.device_id for e in entries] + ([d.device_id for d in compact.devices] if compact else [])
        # the gate's per-round duplicate guard: a later update of one of these devices is a duplicate
        self.gate._seen.update(ids)
        self.merged += 1
        for e in entries:
            sink(e)
        if compact is not None and compact.devices:
            sink(compact)
        log.debug("round %d: merged %s's partial of %d devices", self._round, msg.sender, len(ids))
        return ids

    def refuse(self, sender: str | None, exc: BaseException) -> None:
        """Count and log one refused partial under ``sender`` (reason ``partial-`` + the error's reason)."""
        reason = f"partial-{reason_of(exc)}"
        who = (sender or UNKNOWN_SENDER)[:64]
        self.gate.rejections.add(who, reason)
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        log.warning("round %d: refused a partial from %s (%s): %s", self._round, who, reason, message,
                    exc_info=exc if reason == "partial-error" else None)

    def _check(self, msg: Message, item: Inbound,
               counted: Collection[str]) -> tuple[list[MergedDevice], MergedSummary | None]:
        if item.origin is not None and msg.sender != item.origin:
            raise Rejected("spoofed", f"a partial on {item.origin}'s topic claims to come from {msg.sender!r}")
        if msg.kind != "partial":
            raise Rejected("kind", f"expected a partial, got a {msg.kind} from {msg.sender}")
        if msg.fleet != self.fleet:
            raise Rejected("fleet", f"{msg.sender} sent a partial for fleet {msg.fleet!r}")
        if msg.round < self._round:
            raise Rejected("stale", f"{msg.sender} sent a partial of round {msg.round} during round {self._round}")
        if msg.round > self._round:
            raise Rejected("future", f"{msg.sender} sent a partial of round {msg.round} during round {self._round}")
        if msg.msg_id in self._seen_ids:
            raise Rejected("duplicate", f"{msg.sender}'s partial {msg.msg_id[:8]} was merged already")
        raw = msg.info.get("devices", {})
        if not isinstance(raw, dict) or len(raw) > MAX_PARTIAL_DEVICES:
            raise Rejected("malformed", f"{msg.sender}'s partial must list at most {MAX_PARTIAL_DEVICES} devices "
                                        "as an object")
        if "devices" not in msg.info and "ids" not in msg.info:
            raise Rejected("malformed", f"{msg.sender}'s partial lists no devices (neither devices nor ids)")
        listed = unpack_ids(msg.info["ids"], MAX_PARTIAL_DEVICES - len(raw)) if "ids" in msg.info else []
        if set(listed) & set(raw):
            raise Rejected("malformed", f"{msg.sender}'s partial lists a device both in devices and in ids")
        may = None if self.allowed is None else self.allowed.get(msg.sender)
        if self.allowed is not None and may is None:
            raise Rejected("unauthorized", f"{msg.sender!r} is not an aggregator of this fleet")
        entries = []
        overlap = []
        known: dict[str, DeviceInfo] = {}
        for dev_id in [*raw, *listed]:
            if may is not None and dev_id not in may:
                raise Rejected("foreign", f"{msg.sender} reports {dev_id[:64]!r}, a device outside its shard")
            device = self.gate.devices.get(dev_id)
            if device is None:
                raise Rejected("unregistered", f"{msg.sender} reports {dev_id[:64]!r}, which has not said hello here")
            if not self.gate.sampled(dev_id):
                raise Rejected("unsampled", f"{msg.sender} reports {dev_id[:64]!r}, which was not sampled for round "
                                            f"{self._round}")
            if dev_id in counted:
                overlap.append(dev_id)
            known[dev_id] = device
        for dev_id, entry in raw.items():
            device = known[dev_id]
            if not isinstance(entry, dict) or not isinstance(entry.get("info"), dict):
                raise Rejected("malformed", f"{msg.sender}'s entry for {dev_id} is not {{up, info}}")
            up = entry.get("up")
            if not isinstance(up, int) or isinstance(up, bool) or not 0 <= up <= self.max_bytes:
                raise Rejected("malformed", f"{msg.sender}'s entry for {dev_id}: up must be a byte count")
            metrics, down, rest = parse_update_info(entry["info"], device)
            entries.append(MergedDevice(device, up, metrics, down, rest, entry["info"]))
        if overlap:
            raise Rejected("overlap", f"{msg.sender}'s partial counts {len(overlap)} device(s) already counted in "
                                      f"round {self._round} ({', '.join(sorted(overlap)[:5])}); a sum cannot be "
                                      f"taken apart, so its {len(raw) + len(listed)} devices are refused")
        if "ids" not in msg.info:
            return entries, None
        summary = Summary.parse(msg.info.get("summary"), len(listed), self.max_bytes)
        return entries, MergedSummary([known[d] for d in listed], summary)

    def _count_refusals(self, raw: object) -> None:
        """The refusals the sender counted, added to this node's (they appear in the round report)."""
        if not isinstance(raw, dict):
            raise Rejected("malformed", "rejected_by_device must be an object")
        checked: list[tuple[str, str, int]] = []
        for dev, reasons in raw.items():
            if not isinstance(reasons, dict):
                raise Rejected("malformed", "rejected_by_device entries must be objects")
            for reason, n in reasons.items():
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_COUNT or len(reason) > 64:
                    raise Rejected("malformed", f"rejected_by_device[{dev[:40]!r}][{reason[:40]!r}] is not a count")
                checked.append((dev[:64], reason, n))
        for dev, reason, n in checked:
            self.gate.rejections.by_reason[reason] += n
            self.gate.rejections.by_device.setdefault(dev, Counter())[reason] += n
