"""A staged rollout of one model version: publish it once, order it to a canary fraction of the chosen devices,
wait for their verdicts, and order it to the rest only if every canary installed it.

Each device verifies, checks and installs the version itself (:mod:`fedge.runtime.ota`) and reports on its
retained status topic; this module only publishes (the signed package, the signed orders) and reads those
statuses. A canary that refuses, rolls back, fails or does not answer before the stage's timeout stops the
rollout: the remaining devices never receive an order, and keep their model.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fedge.common.signing import Signer
from fedge.errors import FedgeError
from fedge.mqtt.client import MqttClient, Received
from fedge.mqtt.ota import DEFAULT_THRESHOLD, FINAL_STATES, Order, Release, parse_status, release
from fedge.mqtt.topics import FleetTopics

log = logging.getLogger(__name__)


class DeployError(FedgeError):
    """A rollout stopped (a canary failed, devices did not answer) or could not start."""

    exit_code = 10


@dataclass
class RolloutPlan:
    """What to deploy where, and how carefully."""

    version: int
    devices: list[str]
    canary_fraction: float = 0.25
    threshold: float = DEFAULT_THRESHOLD
    stage_timeout_s: float = 600.0
    chunk_bytes: int = 256 * 1024

    def stages(self) -> list[list[str]]:
        """[canaries, the rest] (one stage when the fraction is 0 or covers every device)."""
        n = len(self.devices)
        k = min(n, math.ceil(self.canary_fraction * n)) if self.canary_fraction > 0 else n
        return [self.devices[:k], self.devices[k:]] if 0 < k < n else [self.devices]


@dataclass
class RolloutReport:
    """Every device's last status for this deployment (None: no answer), and how the rollout ended."""

    deployment: str
    version: int
    stages: list[list[str]]
    statuses: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    stopped_at_canary: bool = False
    seconds: dict[str, float] = field(default_factory=dict)  # per device: order → final status

    @property
    def ok(self) -> bool:
        return all(s is not None and s.get("state") == "installed" for s in self.statuses.values()) and \
            not self.stopped_at_canary

    def to_dict(self) -> dict[str, Any]:
        return {"deployment": self.deployment, "version": self.version, "stages": self.stages, "ok": self.ok,
                "stopped_at_canary": self.stopped_at_canary, "statuses": self.statuses, "seconds": self.seconds}


class StatusBoard:
    """The devices' retained OTA statuses, as they arrive (the deploy client's message handler)."""

    def __init__(self, topics: FleetTopics) -> None:
        self.topics = topics
        self.latest: dict[str, dict[str, Any]] = {}
        self._cond = threading.Condition()

    def on_message(self, m: Received) -> None:
        device = self.topics.parse_ota_status(m.topic)
        if device is None:
            return
        status = parse_status(m.payload)
        if status is None or status.get("device") != device:
            return
        with self._cond:
            self.latest[device] = status
            self._cond.notify_all()

    def wait(self, devices: list[str], deployment: str, timeout_s: float) -> dict[str, dict[str, Any] | None]:
        """Each device's final status for ``deployment`` (None for one that gave none within ``timeout_s``)."""
        end = time.monotonic() + timeout_s

        def final(d: str) -> bool:
            s = self.latest.get(d)
            return s is not None and s.get("deployment") == deployment and s.get("state") in FINAL_STATES

        with self._cond:
            while not all(final(d) for d in devices):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            return {d: (self.latest[d] if final(d) else None) for d in devices}


def rollout(client: MqttClient, board: StatusBoard, signer: Signer, package: bytes, plan: RolloutPlan) -> RolloutReport:
    """Publish ``package`` (a :mod:`fedge.runtime.package` byte string) and order it stage by stage."""
    topics = board.topics
    rel: Release = release(topics, signer, package, plan.version, plan.chunk_bytes)
    pubs = [client.publish(t, p, retain=True) for t, p in rel.publications]
    client.require_published(pubs, plan.stage_timeout_s, f"publishing model version {plan.version}")
    log.info("published model version %d: %d bytes in %d parts", plan.version, rel.size, max(rel.parts, 1))
    deployment = uuid.uuid4().hex
    report = RolloutReport(deployment, plan.version, plan.stages(), {d: None for d in plan.devices})
    for i, stage in enumerate(report.stages):
        started = time.monotonic()
        orders = []
        for device in stage:
            order = Order(topics.fleet, device, plan.version, deployment, rel.sha256, rel.size, plan.threshold)
            topic = topics.ota_order(device)
            orders.append(client.publish(topic, signer.seal(topic, order.to_json()), retain=True))
        client.require_published(orders, plan.stage_timeout_s, "publishing the orders")
        got = board.wait(stage, deployment, plan.stage_timeout_s)
        report.statuses.update(got)
        for device, status in got.items():
            if status is not None:
                report.seconds[device] = round(time.monotonic() - started, 3)
        failed = [d for d, s in got.items() if s is None or s.get("state") != "installed"]
        if failed and i == 0 and len(report.stages) > 1:
            report.stopped_at_canary = True
            log.warning("canary stage failed on %s: the other %d devices get no order", ", ".join(failed),
                        len(report.stages[1]))
            break
    return report


def describe(status: dict[str, Any] | None) -> str:
    """One line for a device's status."""
    if status is None:
        return "no answer"
    line = f"{status.get('state')}: running version {status.get('version')}"
    acc = status.get("accuracy")
    if isinstance(acc, dict) and isinstance(acc.get("new"), float) and isinstance(acc.get("current"), float):
        line += f", local accuracy {acc['new']:.1%} (was {acc['current']:.1%})"
    dl = status.get("download")
    if isinstance(dl, dict) and isinstance(dl.get("bytes"), int) and isinstance(dl.get("seconds"), (int, float)):
        line += f", downloaded {dl['bytes']:,} bytes in {dl['seconds']:.1f} s"
    if status.get("reason"):
        line += f" — {status['reason']}"
    return line
