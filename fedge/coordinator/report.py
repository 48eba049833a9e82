"""What happened in one round: the record the engine keeps, saves and hands to callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedge.coordinator.gate import Admitted


@dataclass
class RoundReport:
    """What happened in one round (saved in the state and in results.json)."""

    round: int
    phase: str
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    missing: list[str] = field(default_factory=list)  # expected devices whose update did not arrive
    deadline_s: float = 0.0  # the round's time budget (0: none, waited for every expected device)
    # device id -> reason -> refused messages from it in this round (hellos and updates; the same
    # messages as ``rejected``, which counts them by reason only). Messages whose sender is unknown
    # (not even a parsable envelope on an unvouched transport) are counted under "?".
    rejected_by_device: dict[str, dict[str, int]] = field(default_factory=dict)
    # the devices sampled to train this round ([coordinator] sample); empty: every online device was asked
    sampled: list[str] = field(default_factory=list)
    # device id -> seconds the device spent on this round's work (info.train_s: applying the global state,
    # evaluating, training), as the device measured it on its own clock.
    train_s: dict[str, float] = field(default_factory=dict)
    # [privacy]: ε spent per round and cumulative at δ after this round (fedge.common.privacy.PrivacyLedger).
    privacy: dict[str, Any] = field(default_factory=dict)
    # aggregator account (worker or relay) -> devices counted through its partials in this round; a
    # shard whose relay sent nothing is absent here and its devices are in ``missing``.
    partials: dict[str, int] = field(default_factory=dict)
    # aggregator account -> the totals its compact partials carried instead of per-device entries (their
    # devices are in ``accepted`` but not in bytes_up/bytes_down/metrics/train_s): {"devices": n, "bytes_up",
    # "bytes_down", "metrics": {name: [sum, count]}, "train_s": [sum, max, count]} (fedge.coordinator.merge.Summary)
    aggregated: dict[str, dict[str, Any]] = field(default_factory=dict)
    # asynchronous mode: device id -> its update's staleness (versions behind the version this report made)
    staleness: dict[str, int] = field(default_factory=dict)
    # [coordinator] selection = "oort" | "energy": device id -> why it was or was not tasked this round
    # (fedge.common.selection); empty for the other selections
    selection: dict[str, str] = field(default_factory=dict)
    # [coordinator] thermal_guard: the candidates held out of this round because they were hot (fedge.common.heat;
    # why: ``selection``). Asynchronous mode: the idle devices refused a new task in this version because they were
    # hot (``selection`` says why, and why a device whose heartbeat is too old to judge was not held)
    hot: list[str] = field(default_factory=list)
    # [privacy] secure_aggregation over a transport (fedge.coordinator.secure): group -> {"survivors": devices
    # whose values the group's sum holds, "dropped": devices lost after sharing their keys, "abandoned": why the
    # group's sum was abandoned ("" when it completed)}
    secure: dict[str, dict[str, Any]] = field(default_factory=dict)

    def total_bytes(self) -> tuple[int, int]:
        """(bytes up, bytes down) of every accepted update: per-device entries plus compact partials' totals."""
        up = sum(self.bytes_up.values()) + sum(int(a.get("bytes_up", 0)) for a in self.aggregated.values())
        down = sum(self.bytes_down.values()) + sum(int(a.get("bytes_down", 0)) for a in self.aggregated.values())
        return up, down

    def metric_values(self, name: str) -> tuple[float, int]:
        """(sum, count) of metric ``name`` over every device that reported it, per-device and summarised."""
        vals = [float(v) for m in self.metrics.values()
                if isinstance(v := m.get(name), int | float) and not isinstance(v, bool)]
        total, n = sum(vals), len(vals)
        for a in self.aggregated.values():
            s, c = a.get("metrics", {}).get(name, (0.0, 0))
            total, n = total + float(s), n + int(c)
        return total, n


def rolled_back(report: RoundReport) -> list[str]:
    """The devices that undid their last round at the start of this one (issue 45's divergence guard: their
    validation accuracy fell by more than ``[train] divergence_margin``; they train from their previous model)."""
    return sorted(d for d, m in report.metrics.items() if m.get("rolled_back"))


def record_accepted(report: RoundReport, device_id: str, *, bytes_up: int, bytes_down: int,
                    metrics: dict[str, float], info: dict[str, Any]) -> None:
    """An accepted update in its round's report — the device's own, or one a worker's or relay's partial
    counted: its bytes, metrics, info and (taken out of the info) the seconds it trained, ``train_s``."""
    report.accepted.append(device_id)
    report.bytes_up[device_id] = bytes_up
    report.bytes_down[device_id] = bytes_down
    report.metrics[device_id] = metrics
    report.info[device_id] = {k: v for k, v in info.items() if k != "train_s"}
    if "train_s" in info:
        report.train_s[device_id] = float(info["train_s"])


def record_admitted(report: RoundReport, up: Admitted) -> None:
    """:func:`record_accepted` of an update the gate admitted."""
    record_accepted(report, up.msg.sender, bytes_up=up.size, bytes_down=up.bytes_down, metrics=up.metrics,
                    info=up.info)
