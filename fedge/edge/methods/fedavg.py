"""FedAvg within an architecture group and LG-FedAvg, device halves: upload the weights, load the averages."""

from __future__ import annotations

from typing import Any, ClassVar

from fedge.common.method_settings import FedAvgSettings, LGFedAvgSettings
from fedge.common.rounds import EXTRACTOR_ARTIFACT, RoundInfo, group_artifact
from fedge.common.settings import MethodSettings
from fedge.edge.methods.base import Arrays, DeviceMethod, load_arrays, model_arrays
from fedge.edge.training import train_epochs


class FedAvgDevice(DeviceMethod):
    """FedAvg within an architecture group: upload all weights, get the group average back."""

    settings_type: ClassVar[type[MethodSettings]] = FedAvgSettings

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [group_artifact(self.ctx.model.spec.name)]

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:
        for arrays in artifacts.values():
            load_arrays(self.ctx.model, arrays)

    def upload(self) -> Arrays:
        return model_arrays(self.ctx.model)

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        loss = train_epochs(self.ctx.model, self.ctx.train.x, self.ctx.train.y, self.ctx.train_cfg, self.ctx.rng)
        return self.upload(), {"loss": loss}


class LGFedAvgDevice(FedAvgDevice):
    """LG-FedAvg as fedge defines it: the common extractor is averaged over every device,
    the rest of the network within the architecture group."""

    settings_type: ClassVar[type[MethodSettings]] = LGFedAvgSettings

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        return [EXTRACTOR_ARTIFACT, *super().needed_artifacts(info)]
