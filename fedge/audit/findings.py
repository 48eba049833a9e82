"""What the audit found about one generator: :class:`GeneratorAudit`, read by the report and the figures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fedge.audit.mnd import MND


@dataclass
class GeneratorAudit:
    """The audit of one generator against one device's data."""

    device: str
    generator: str
    kind: str  # cvae, dcgan, ddpm, vtc
    level: str  # image, feature
    n_train: int
    n_val: int
    n_synthetic: int
    pixel: MND
    features: MND
    closest: list[tuple[int, int, float]] = field(default_factory=list)  # (synthetic i, train j, pixel dist)
    figure: str | None = None
    # Feature-level generators only: the held-out images' own round trip (extractor, then the same inverter),
    # measured like the synthetic samples: MND of the inverted held-out images, ratio to the raw held-out ones.
    # An inverter fitted on the device's images pulls everything it decodes towards them; this is its share.
    roundtrip_pixel: MND | None = None
    roundtrip_features: MND | None = None

    def to_dict(self) -> dict[str, Any]:
        skip = ("pixel", "features", "closest", "roundtrip_pixel", "roundtrip_features")
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        out = {**d, "pixel": self.pixel.to_dict(), "features": self.features.to_dict(),
               "closest": [{"synthetic": i, "train": j, "distance": dist} for i, j, dist in self.closest]}
        if self.roundtrip_pixel is not None and self.roundtrip_features is not None:
            out["roundtrip"] = {"pixel": self.roundtrip_pixel.to_dict(), "features": self.roundtrip_features.to_dict(),
                                "ratio_synthetic_to_roundtrip": {
                                    "pixel": self.pixel.synthetic / self.roundtrip_pixel.synthetic,
                                    "features": self.features.synthetic / self.roundtrip_features.synthetic}}
        return out
