"""FedProto (Tan et al., AAAI 2022), coordinator half: count-weighted mean of per-class prototypes."""

from __future__ import annotations

from typing import Any, ClassVar

from fedge.common.method_settings import FedProtoSettings
from fedge.common.rounds import PROTOTYPES_ARTIFACT, DeviceInfo, class_stats_spec
from fedge.coordinator.aggregate import ClassMean
from fedge.coordinator.strategy import Arrays, Strategy, UpdateSpec


class FedProtoStrategy(Strategy):
    """Count-weighted mean of per-class prototypes over all devices."""

    settings_type = FedProtoSettings
    partial_fields: ClassVar[tuple[str, ...] | None] = ("protos",)

    def begin_round(self, rnd: int) -> None:
        self.protos = ClassMean(self.num_classes, self.aggregation)

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any]) -> None:
        self.protos.add(arrays["protos"], arrays["counts"])

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        if not self.protos:
            return {}
        protos, counts = self.protos.result()
        return {PROTOTYPES_ARTIFACT: {"protos": protos, "counts": counts}}

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        return class_stats_spec(self.num_classes, device.feature_dim)
