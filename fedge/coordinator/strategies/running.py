"""Running aggregates of statistics in asynchronous mode: every device's latest upload, by version.

FedProto's prototypes and FedVTC's statistics describe classes; a buffer of K updates holds only some
devices, and so only some classes. Asynchronous FedProto and FedVTC therefore aggregate, at every new
version, the latest upload of **every** device that has delivered one, each weighted by its class counts
times the staleness weight of its age now (the version being built minus the version it trained from): a
device's new upload replaces its old one, and an old one fades by the chosen function (docs/async.md). With
every device delivering every version at staleness 0 this is the synchronous aggregate exactly.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np

from fedge.coordinator.strategy import Arrays


def _entry(arrays: Arrays, version: int) -> dict[str, Any]:
    """One device's upload as JSON: each array's bytes in base64 (little-endian dtype, shape)."""
    out = {}
    for k, a in arrays.items():
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        out[k] = {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}
    return {"version": version, "arrays": out}


def _array(doc: dict[str, Any]) -> np.ndarray:
    """The array of one :func:`_entry` item; ``data`` (a list of numbers) is how states before base64 held it."""
    if "b64" in doc:
        raw = base64.b64decode(doc["b64"], validate=True)
        return np.frombuffer(raw, dtype=np.dtype(doc["dtype"])).reshape(doc["shape"]).copy()
    return np.asarray(doc["data"], dtype=doc["dtype"]).reshape(doc["shape"])


class LatestUploads:
    """Device id -> (its latest upload's arrays, the version it trained from); JSON-able for restarts.

    Every version's checkpoint holds every device's latest upload, while a version changes only the
    ``buffer_size`` devices that delivered into it: each device's JSON entry is therefore made once, when its
    upload arrives (its arrays' bytes in base64, not lists of numbers: about 7 times cheaper to write and
    read back), and :meth:`state_dict` hands out the kept entries.
    """

    def __init__(self) -> None:
        self.uploads: dict[str, tuple[Arrays, int]] = {}
        self._entries: dict[str, dict[str, Any]] = {}  # device id -> its upload as state_dict gives it

    def put(self, device_id: str, arrays: Arrays, version: int) -> None:
        """Keep ``arrays`` as ``device_id``'s latest upload (trained from ``version``)."""
        kept = {k: np.array(v, copy=True) for k, v in arrays.items()}
        self.uploads[device_id] = (kept, version)
        self._entries[device_id] = _entry(kept, version)

    def items(self) -> Iterator[tuple[Arrays, int]]:
        """(arrays, version) per device, in device order (a sum in a fixed order repeats to the bit)."""
        for dev in sorted(self.uploads):
            yield self.uploads[dev]

    def state_dict(self) -> dict[str, Any]:
        """Device id -> {"version", "arrays": {name: {"dtype", "shape", "b64"}}} (the entries are shared: the
        caller serializes them and must not change them)."""
        return dict(self._entries)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.uploads = {dev: ({k: _array(a) for k, a in e["arrays"].items()}, int(e["version"]))
                        for dev, e in state.items()}
        self._entries = {dev: _entry(arrays, v) for dev, (arrays, v) in self.uploads.items()}
