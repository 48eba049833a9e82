"""The round descriptor and the registry record shared by both halves of every method."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FINAL_PHASE = "final"


@dataclass(frozen=True)
class RoundInfo:
    """What the coordinator announces at the start of a round.

    Rounds are numbered from 1. After the last training round the coordinator
    announces one more round with ``phase == "final"``: devices apply the last
    global state, evaluate, and upload metrics only.
    """

    round: int
    phase: str
    method: str
    deadline: float = 0.0  # unix seconds; 0 = none (in-process)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_final(self) -> bool:
        return self.phase == FINAL_PHASE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoundInfo:
        return cls(**d)


@dataclass(frozen=True)
class DeviceInfo:
    """A registered device as the coordinator knows it (from its hello)."""

    device_id: str
    arch: str
    profile: str
    upload_precision: str = "fp32"
    num_samples: int = 0
    feature_dim: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str:
        """Architecture group: devices that can average weights with each other."""
        return self.arch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceInfo:
        return cls(**d)


def group_artifact(arch: str) -> str:
    """Artifact holding the weights averaged within an architecture group."""
    return f"group-{arch}"


EXTRACTOR_ARTIFACT = "extractor"
PROTOTYPES_ARTIFACT = "prototypes"
