"""FedAvg within an architecture group and LG-FedAvg, coordinator halves: sample-weighted means of weights."""

from __future__ import annotations

from typing import Any, ClassVar

from fedge.common.families import spec_by_name
from fedge.common.method_settings import FedAvgSettings, LGFedAvgSettings
from fedge.common.rounds import EXTRACTOR_ARTIFACT, EXTRACTOR_PREFIX, DeviceInfo, group_artifact
from fedge.common.settings import MethodSettings
from fedge.coordinator.accumulators import GroupedMean, mean
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec


def weight_spec(arch: str) -> UpdateSpec:
    """Float state-dict entries of an architecture (BN counters are never sent)."""
    return {
        k: (shape, "float")
        for k, shape in spec_by_name(arch).param_shapes().items()
        if not k.endswith("num_batches_tracked")
    }


class FedAvgStrategy(Strategy):
    """Sample-weighted average of full weights within each architecture group."""

    settings_type: ClassVar[type[MethodSettings]] = FedAvgSettings
    partial_fields: ClassVar[tuple[str, ...] | None] = ("groups",)

    def begin_round(self, rnd: int) -> None:
        self.groups = GroupedMean(self.aggregation)

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        self.groups.add(device.group, arrays, float(max(device.num_samples, 1)) * at.weight)

    def accumulate_group_sum(self, group: str, sums: Arrays) -> None:
        self.groups.add_sum(group, {k: v for k, v in sums.items() if k != "weight"}, float(sums["weight"][0]))

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        return {group_artifact(g): a for g, a in self.groups.results().items()}

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        return weight_spec(device.arch)


class LGFedAvgStrategy(FedAvgStrategy):
    """The extractor averaged over all devices; everything else within the group."""

    settings_type: ClassVar[type[MethodSettings]] = LGFedAvgSettings
    partial_fields: ClassVar[tuple[str, ...] | None] = ("groups", "extractor")
    # True: the group artifacts carry the group's own average of the stem as well (FedAvg within the
    # group), so a device can compare it with the fleet's; GeFL's guard sets it (docs/methods.md).
    group_extractor: bool = False

    def begin_round(self, rnd: int) -> None:
        super().begin_round(rnd)
        self.extractor = mean(self.aggregation)

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        w = float(max(device.num_samples, 1)) * at.weight
        shared = {k: v for k, v in arrays.items() if k.startswith(EXTRACTOR_PREFIX)}
        rest = {k: v for k, v in arrays.items() if not k.startswith(EXTRACTOR_PREFIX)}
        self.extractor.add(shared, w)
        self.groups.add(device.group, arrays if self.group_extractor else rest, w)

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        out = super().finish_round(rnd)
        if self.extractor:
            out[EXTRACTOR_ARTIFACT] = self.extractor.result()
        return out
