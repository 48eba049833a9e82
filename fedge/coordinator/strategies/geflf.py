"""GeFL-F, coordinator half: LG-FedAvg warm-up, feature-generator averaging, then
head averaging within each architecture group.

Phases by round: ``warmup`` for rounds 1 … ``warmup_rounds`` (published: 20),
``generator`` for the next ``gen_rounds`` (published: 100), ``head`` for the rest of
``[run] rounds`` (published: 50, so ``rounds = 170``).
"""

from __future__ import annotations

from typing import Any

from fedge.common.method_settings import FedAvgSettings, GeFLFSettings, LGFedAvgSettings
from fedge.common.rounds import EXTRACTOR_PREFIX, GENERATOR_PHASE, HEAD_PHASE, WARMUP_PHASE, DeviceInfo
from fedge.coordinator.strategies.fedavg import FedAvgStrategy, LGFedAvgStrategy, weight_spec
from fedge.coordinator.strategies.gefl import GeneratorAverage, split_generator
from fedge.coordinator.strategy import FRESH, Arrays, Contribution, Strategy, UpdateSpec
from fedge.errors import ConfigError


class GeFLFStrategy(Strategy):
    """GeFL-F: see the module docstring."""

    settings_type = GeFLFSettings
    settings: GeFLFSettings

    def __init__(self, settings: GeFLFSettings | None = None, *, num_classes: int, rounds: int) -> None:
        super().__init__(settings, num_classes=num_classes, rounds=rounds)
        self.warmup_rounds = self.settings.warmup_rounds
        self.gen_rounds = self.settings.gen_rounds
        if self.warmup_rounds + self.gen_rounds >= rounds:
            raise ConfigError(
                f"geflf: [run] rounds = {rounds} leaves no head rounds after {self.warmup_rounds} warm-up and "
                f"{self.gen_rounds} generator rounds",
                hint="set [run] rounds = warmup_rounds + gen_rounds + head rounds (published: 20 + 100 + 50 = 170)",
            )
        self.gens = GeneratorAverage(self.settings, num_classes)
        self.warmup = LGFedAvgStrategy(LGFedAvgSettings(), num_classes=num_classes, rounds=rounds)
        self.heads = FedAvgStrategy(FedAvgSettings(), num_classes=num_classes, rounds=rounds)

    def phase(self, rnd: int) -> str:
        if rnd <= self.warmup_rounds:
            return WARMUP_PHASE
        return GENERATOR_PHASE if rnd <= self.warmup_rounds + self.gen_rounds else HEAD_PHASE

    def begin_round(self, rnd: int) -> None:
        self.gens.reset()
        self.warmup.begin_round(rnd)
        self.heads.begin_round(rnd)

    def accumulate(self, device: DeviceInfo, arrays: Arrays, info: dict[str, Any], at: Contribution = FRESH) -> None:
        self.gens.add(device, arrays, at.weight)
        rest = split_generator(arrays)
        if not rest:
            return
        if any(k.startswith(EXTRACTOR_PREFIX) for k in rest):
            self.warmup.accumulate(device, rest, info, at)
        else:
            self.heads.accumulate(device, rest, info, at)

    def finish_round(self, rnd: int) -> dict[str, Arrays]:
        phase = self.phase(rnd)
        if phase == WARMUP_PHASE:
            return self.warmup.finish_round(rnd)
        if phase == GENERATOR_PHASE:
            return self.gens.results()
        return self.heads.finish_round(rnd)

    def expected_update(self, device: DeviceInfo, rnd: int) -> UpdateSpec | None:
        phase = self.phase(rnd)
        if phase == WARMUP_PHASE:
            return weight_spec(device.arch)
        if phase == GENERATOR_PHASE:
            return self.gens.expected(device)
        return {k: v for k, v in weight_spec(device.arch).items() if not k.startswith(EXTRACTOR_PREFIX)}
