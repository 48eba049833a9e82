"""Local, coordinator half: no aggregation."""

from __future__ import annotations

from typing import Any, ClassVar

from fedge.common.method_settings import LocalSettings
from fedge.common.rounds import DeviceInfo
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec


class LocalStrategy(Strategy):
    """No aggregation: devices upload nothing but metrics."""

    settings_type = LocalSettings
    partial_fields: ClassVar[tuple[str, ...] | None] = ()  # nothing to aggregate: any split merges

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        pass

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        return {}

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        return {}
