"""Running aggregates of statistics in asynchronous mode: every device's latest upload, by version.

FedProto's prototypes and FedVTC's statistics describe classes; a buffer of K updates holds only some
devices, and so only some classes. Asynchronous FedProto and FedVTC therefore aggregate, at every new
version, the latest upload of **every** device that has delivered one, each weighted by its class counts
times the staleness weight of its age now (the version being built minus the version it trained from): a
device's new upload replaces its old one, and an old one fades by the chosen function (docs/async.md). With
every device delivering every version at staleness 0 this is the synchronous aggregate exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fedge.coordinator.strategy import Arrays


class LatestUploads:
    """Device id -> (its latest upload's arrays, the version it trained from); JSON-able for restarts."""

    def __init__(self) -> None:
        self.uploads: dict[str, tuple[Arrays, int]] = {}

    def put(self, device_id: str, arrays: Arrays, version: int) -> None:
        """Keep ``arrays`` as ``device_id``'s latest upload (trained from ``version``)."""
        self.uploads[device_id] = ({k: np.array(v, copy=True) for k, v in arrays.items()}, version)

    def items(self) -> Iterator[tuple[Arrays, int]]:
        """(arrays, version) per device, in device order (a sum in a fixed order repeats to the bit)."""
        for dev in sorted(self.uploads):
            yield self.uploads[dev]

    def state_dict(self) -> dict[str, Any]:
        return {dev: {"version": v, "arrays": {k: {"dtype": str(a.dtype), "shape": list(a.shape),
                                                    "data": a.ravel().tolist()} for k, a in arrays.items()}}
                for dev, (arrays, v) in self.uploads.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.uploads = {
            dev: ({k: np.asarray(a["data"], dtype=a["dtype"]).reshape(a["shape"]) for k, a in e["arrays"].items()},
                  int(e["version"]))
            for dev, e in state.items()}
