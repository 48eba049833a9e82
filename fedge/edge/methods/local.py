"""Local, device half: no federation, each device trains on its own data only."""

from __future__ import annotations

from typing import Any

from fedge.common.method_settings import LocalSettings
from fedge.common.rounds import RoundInfo
from fedge.edge.methods.base import Arrays, DeviceMethod
from fedge.edge.training import train_epochs


class LocalDevice(DeviceMethod):
    """No federation: train on local data only; uploads nothing but the sample count."""

    settings_type = LocalSettings

    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        loss = train_epochs(self.ctx.model, self.ctx.train.x, self.ctx.train.y, self.ctx.train_cfg, self.ctx.rng)
        return {}, {"loss": loss}
