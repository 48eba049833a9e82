"""The worked example of docs/architecture.md, "Adding a method": heads-only averaging.

Every device keeps its own network and shares only its classifier head h (p -> classes),
averaged over all devices by samples — possible across architectures because every head reads
the same p features. The three classes below appear verbatim in the docs (a test checks), where
each goes to its own file; here they live in one module outside fedge and register themselves
with :func:`fedge.fleet.registry.register_method`, as a method outside the tree would.

They are the whole method: its name is written once (``HeadAvgSettings.method``; both halves read
it through ``settings_type``), and what lists or sizes methods (``BUILTIN_SETTINGS``, the broker's
packet limit) reads the registry line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.common.settings import MethodSettings, setting
from fedge.coordinator.accumulators import WeightedMean
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec
from fedge.edge.methods.base import DeviceMethod, load_arrays, model_arrays
from fedge.edge.training import train_epochs
from fedge.fleet.registry import METHODS, MethodEntry, register_method

# -- the settings (fedge/common/method_settings.py) ------------------------------------------------
HEADS_ARTIFACT = "heads"  # what the halves exchange, named beside the settings both import


@dataclass(frozen=True)
class HeadAvgSettings(MethodSettings):
    """Only the classifier heads are shared."""

    method: ClassVar[str] = "headavg"
    shares_features: ClassVar[bool] = True  # every head reads the same p features
    # asynchronous mode: how a stale update counts (without it, mode = "async" refuses the method)
    async_rule: ClassVar[str] = "buffered: the heads of a version's buffer, weighted by samples x staleness weight"

    every: int = setting(1, "share the heads every k-th round", minimum=1)

    def shares_in(self, rnd: int) -> bool:
        return rnd % self.every == 0


# -- the device half (fedge/edge/methods/headavg.py) -----------------------------------------------
class HeadAvgDevice(DeviceMethod):
    """Train the whole network locally; upload the head; load the averaged head."""

    settings_type = HeadAvgSettings
    settings: HeadAvgSettings

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [HEADS_ARTIFACT]

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:
        if HEADS_ARTIFACT in artifacts:
            load_arrays(self.ctx.model, artifacts[HEADS_ARTIFACT])

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        ctx = self.ctx
        loss = train_epochs(ctx.model, ctx.train.x, ctx.train.y, ctx.train_cfg, ctx.rng)
        upload = model_arrays(ctx.model, ["head."]) if self.settings.shares_in(info.round) else {}
        return upload, {"loss": loss}


# -- the coordinator half (fedge/coordinator/strategies/headavg.py) --------------------------------
class HeadAvgStrategy(Strategy):
    """Sample-weighted mean of the heads over every device."""

    settings_type = HeadAvgSettings
    settings: HeadAvgSettings

    def begin_round(self, rnd: int) -> None:
        self.heads = WeightedMean()

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        if arrays:  # at.weight: the update's staleness weight in asynchronous mode (1 in synchronous rounds)
            self.heads.add(arrays, float(max(device.num_samples, 1)) * at.weight)

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        return {HEADS_ARTIFACT: self.heads.result()} if self.heads else {}

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        if not self.settings.shares_in(rnd):
            return {}
        c, p = self.num_classes, device.feature_dim
        return {"head.weight": ((c, p), "float"), "head.bias": ((c,), "float")}


# -- the registry line (fedge/fleet/registry.py, in METHODS: MethodEntry(HeadAvgSettings,
#    _E + "headavg:HeadAvgDevice", _C + "headavg:HeadAvgStrategy")); outside fedge:
def register() -> MethodEntry:
    """Register the example (once per process)."""
    if HeadAvgSettings.method in METHODS:
        return METHODS[HeadAvgSettings.method]
    return register_method(MethodEntry(HeadAvgSettings, f"{__name__}:HeadAvgDevice", f"{__name__}:HeadAvgStrategy"))
