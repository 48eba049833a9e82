"""FedProto (Tan et al., AAAI 2022), coordinator half: count-weighted mean of per-class prototypes."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from fedge.common.method_settings import FedProtoSettings
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo, class_stats_spec
from fedge.coordinator.accumulators import ClassMean
from fedge.coordinator.strategies.running import LatestUploads
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec


class FedProtoStrategy(Strategy):
    """Count-weighted mean of per-class prototypes over all devices (asynchronous: a running aggregate of
    every device's latest prototypes, :mod:`~fedge.coordinator.strategies.running`)."""

    settings_type = FedProtoSettings
    partial_fields: ClassVar[tuple[str, ...] | None] = ("protos",)

    def __init__(self, settings: FedProtoSettings | None = None, *, num_classes: int, rounds: int) -> None:
        super().__init__(settings, num_classes=num_classes, rounds=rounds)
        self.latest = LatestUploads()

    def begin_round(self, rnd: int) -> None:
        self.protos = ClassMean(self.num_classes, self.aggregation)

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        if self.asynchronous is not None:
            self.latest.put(device.device_id, arrays, at.version)
            return
        self.protos.add(arrays["protos"], arrays["counts"])

    def accumulate_group_sum(self, group: str, sums: Arrays) -> None:
        counts = np.rint(sums["counts"])  # exact: the field's error on a count sum is far below 0.5
        self.protos.add_sums(sums["sums"], counts, counts.astype(np.int64))

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        a = self.asynchronous
        if a is not None and self.aggregation.robust:  # every device's rows, each with its own weight
            for arrays, version in self.latest.items():
                self.protos.add(arrays["protos"], arrays["counts"], a.weight(rnd - version))
        elif a is not None:  # the mean: one weighted sum per version the uploads trained from
            for version, (sums, counts) in self.latest.version_sums("fedproto", _terms):
                w = a.weight(rnd - version)
                self.protos.add_sums(sums * w, counts * w, counts)
        if not self.protos:
            return {}
        protos, counts = self.protos.result()
        return {PROTOTYPES_ARTIFACT: {"protos": protos, "counts": counts}}

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        return class_stats_spec(self.num_classes, device.feature_dim)

    def state_dict(self) -> dict[str, Any]:
        return {"latest": self.latest.state_dict()} if self.latest.uploads else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latest.load_state_dict(state.get("latest", {}))


def _terms(arrays: Arrays) -> tuple[np.ndarray, np.ndarray]:
    """One device's part of the count-weighted mean before its staleness weight: prototypes times class counts
    (float64, as :class:`ClassMean` sums them) and the counts."""
    counts = np.asarray(arrays["counts"], dtype=np.float64)
    return np.asarray(arrays["protos"], dtype=np.float64) * counts[:, None], counts
