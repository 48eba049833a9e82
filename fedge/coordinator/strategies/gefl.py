"""GeFL, coordinator half: average the generator over all devices (per generator shape),
then run LG-FedAvg (or FedAvg within the group) on the target networks.

Phases by round: ``generator`` for rounds 1 … ``gen_rounds`` (published: 100),
``target`` for the rest of ``[run] rounds`` (published: 50, so ``rounds = 150``).
"""

from __future__ import annotations

import logging
from typing import Any

from fedge.common.families import spec_by_name
from fedge.common.generators import DEFAULT_GENERATOR_TIER, IMAGE_LEVEL, GeneratorSpec, check_tier
from fedge.common.method_settings import FedAvgSettings, GeFLSettings, GenerativeSettings, LGFedAvgSettings
from fedge.common.rounds import (
    GENERATOR_PHASE,
    GENERATOR_PREFIX,
    TARGET_PHASE,
    DeviceInfo,
    generator_artifact,
)
from fedge.coordinator.accumulators import GroupedMean
from fedge.coordinator.strategies.fedavg import FedAvgStrategy, LGFedAvgStrategy, weight_spec
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec
from fedge.errors import ConfigError

log = logging.getLogger(__name__)


class GeneratorAverage:
    """Streaming sample-weighted average of generator uploads, one per generator artifact.

    Which artifact (kind, tier, level) a device belongs to is decided from its
    registry record, exactly as the device decides it from its plan: the
    ``[method] generator_tier`` setting if present, else ``generator_tier`` in
    the device's hello (``DeviceInfo.extra``), else the default tier.
    """

    def __init__(self, settings: GenerativeSettings, num_classes: int) -> None:
        self.fleet_tier = settings.generator_tier
        self.kind = settings.generator
        self.level = settings.level
        self.num_classes = num_classes
        self.groups = GroupedMean()
        self._warned: set[str] = set()

    def tier(self, device: DeviceInfo) -> str:
        t = self.fleet_tier or device.extra.get("generator_tier")
        if not t:
            if device.device_id not in self._warned:
                self._warned.add(device.device_id)
                log.warning("%s: no generator_tier in [method] or in its hello; assuming %r (a device whose "
                            "plan says otherwise will be rejected for wrong shapes)", device.device_id,
                            DEFAULT_GENERATOR_TIER)
            t = DEFAULT_GENERATOR_TIER
        return check_tier(str(t))

    def artifact(self, device: DeviceInfo) -> str:
        return generator_artifact(self.kind, self.tier(device), self.level)

    def spec(self, device: DeviceInfo) -> GeneratorSpec:
        arch = spec_by_name(device.arch)
        stem = arch.stem_shape  # (C, H, W): the fleet config refuses a family with another stem at load
        shape = ((arch.in_channels, arch.image_size, arch.image_size) if self.level == IMAGE_LEVEL
                 else (stem[0], stem[1], stem[2]))
        return GeneratorSpec(self.kind, shape, tier=self.tier(device), num_classes=self.num_classes)

    def expected(self, device: DeviceInfo) -> UpdateSpec:
        return {GENERATOR_PREFIX + k: (s, "float") for k, s in self.spec(device).upload_shapes().items()}

    def reset(self) -> None:
        self.groups = GroupedMean()

    def add(self, device: DeviceInfo, arrays: Arrays, weight: float = 1.0) -> None:
        """Fold one upload's generator in, weighted by its samples times ``weight`` (a staleness weight)."""
        gen = {k[len(GENERATOR_PREFIX):]: v for k, v in arrays.items() if k.startswith(GENERATOR_PREFIX)}
        if gen:
            self.groups.add(self.artifact(device), gen, float(max(device.num_samples, 1)) * weight)

    def results(self) -> dict[str, Arrays]:
        return self.groups.results()


def split_generator(arrays: Arrays) -> Arrays:
    """The non-generator entries of an upload."""
    return {k: v for k, v in arrays.items() if not k.startswith(GENERATOR_PREFIX)}


class GeFLStrategy(Strategy):
    """GeFL: generator rounds, then target rounds (see the module docstring)."""

    settings_type = GeFLSettings
    settings: GeFLSettings

    def __init__(self, settings: GeFLSettings | None = None, *, num_classes: int, rounds: int) -> None:
        super().__init__(settings, num_classes=num_classes, rounds=rounds)
        cfg = self.settings
        self.gen_rounds = cfg.gen_rounds
        if self.gen_rounds >= rounds:
            raise ConfigError(
                f"gefl: [run] rounds = {rounds} leaves no target rounds after {self.gen_rounds} generator rounds",
                hint="set [run] rounds = gen_rounds + target rounds (published: 100 + 50 = 150)",
            )
        self.train_gen_in_target = cfg.generator_trains_in_target
        self.avg_extractor = cfg.avg_extractor
        self.gens = GeneratorAverage(cfg, num_classes)
        # The target networks: LG-FedAvg (the published avg_FE = 1) or FedAvg within the group.
        self.weights: FedAvgStrategy = (
            LGFedAvgStrategy(LGFedAvgSettings(), num_classes=num_classes, rounds=rounds) if self.avg_extractor
            else FedAvgStrategy(FedAvgSettings(), num_classes=num_classes, rounds=rounds))
        if isinstance(self.weights, LGFedAvgStrategy):
            self.weights.group_extractor = cfg.guards_extractor

    def phase(self, rnd: int) -> str:
        return GENERATOR_PHASE if rnd <= self.gen_rounds else TARGET_PHASE

    def begin_round(self, rnd: int) -> None:
        self.gens.reset()
        self.weights.begin_round(rnd)

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        self.gens.add(device, arrays, at.weight)
        rest = split_generator(arrays)
        if rest:
            self.weights.accumulate(device, rest, info, at)

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        out = self.gens.results()
        if self.phase(rnd) == TARGET_PHASE:
            out.update(self.weights.finish_round(rnd))
        return out

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        if self.phase(rnd) == GENERATOR_PHASE:
            return self.gens.expected(device)
        spec = weight_spec(device.arch)
        if self.train_gen_in_target:
            spec.update(self.gens.expected(device))
        return spec
