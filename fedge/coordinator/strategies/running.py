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
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fedge.coordinator.strategy import Arrays, JsonDoc, LogDoc

Terms = tuple[np.ndarray, ...]  # what one device's upload adds to a running aggregate, before its weight


def _entry(arrays: Arrays, version: int) -> JsonDoc:
    """One device's upload as JSON: each array's bytes in base64 (little-endian dtype, shape).

    Its text is put together here rather than by ``json.dumps`` (which would scan every base64 string for
    characters to escape): every accepted update of an asynchronous FedProto / FedVTC run makes one, and the
    checkpoint writes it (issue 27's cost). Only the array names need escaping; dtype strings, shapes and
    base64 never do."""
    out = {}
    parts = []
    for k, a in arrays.items():
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        item = out[k] = {"dtype": a.dtype.str, "shape": [int(n) for n in a.shape],
                         "b64": base64.b64encode(a.tobytes()).decode()}
        parts.append(f'{json.dumps(k)}:{{"dtype":"{item["dtype"]}","shape":[{",".join(map(str, item["shape"]))}],'
                     f'"b64":"{item["b64"]}"}}')
    doc = JsonDoc({"version": int(version), "arrays": out})
    doc.preset(f'{{"version":{int(version)},"arrays":{{{",".join(parts)}}}}}')
    return doc


def _array(doc: dict[str, Any]) -> np.ndarray:
    """The array of one :func:`_entry` item; ``data`` (a list of numbers) is how states before base64 held it."""
    if "b64" in doc:
        raw = base64.b64decode(doc["b64"], validate=True)
        return np.frombuffer(raw, dtype=np.dtype(doc["dtype"])).reshape(doc["shape"]).copy()
    return np.asarray(doc["data"], dtype=doc["dtype"]).reshape(doc["shape"])


class LatestUploads:
    """Device id -> (its latest upload's arrays, the version it trained from); JSON-able for restarts.

    Every version's checkpoint holds every device's latest upload, and every version's aggregate weighs every
    device's, while a version changes only the ``buffer_size`` devices that delivered into it. So:

    * each device's JSON entry is made once, when its upload arrives (its arrays' bytes in base64, not lists
      of numbers), and :meth:`state_dict` hands out the kept entries as one :class:`LogDoc`: a checkpoint appends
      only the entries of the devices that delivered since the previous one (``fedge.coordinator.statelog``);
    * :meth:`version_sums` sums the uploads **per version they trained from** (a staleness weight is the same
      for all of them) and keeps those sums, adding a device that joins a group and subtracting one that
      leaves: a version's aggregate then costs one pass over the groups, plus a sum over the devices of the
      groups that formed since the last.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.uploads: dict[str, tuple[Arrays, int]] = {}
        self._entries = LogDoc()  # device id -> its upload as state_dict gives it (JsonDoc)
        self._members: dict[int, set[str]] = {}  # version trained from -> devices whose latest upload it is
        self._terms: dict[str, dict[str, Terms]] = {}  # key -> device id -> its terms (version_sums)
        self._sums: dict[str, dict[int, Terms]] = {}  # key -> version -> the sum of its devices' terms
        self._fns: dict[str, Callable[[Arrays], Terms]] = {}  # key -> its terms function (version_sums)

    def put(self, device_id: str, arrays: Arrays, version: int) -> None:
        """Keep ``arrays`` as ``device_id``'s latest upload (trained from ``version``)."""
        kept = {k: np.array(v, copy=True) for k, v in arrays.items()}
        old = self.uploads.get(device_id)
        if old is not None:
            self._leave(device_id, old[1])
        self.uploads[device_id] = (kept, version)
        self._entries[device_id] = _entry(kept, version)
        self._members.setdefault(version, set()).add(device_id)
        for key, terms in self._terms.items():
            terms.pop(device_id, None)
            total = self._sums[key].get(version)
            if total is not None:  # a group summed before: the newcomer's terms added to it (see _leave)
                mine = terms[device_id] = self._fns[key](kept)
                self._sums[key][version] = tuple(t + x for t, x in zip(total, mine, strict=True))

    def _leave(self, device_id: str, version: int) -> None:
        """``device_id``'s upload from ``version`` is replaced: out of that version's group and its sums.

        A kept sum has the device's terms subtracted (and a newcomer's added, in :meth:`put`) rather than
        being dropped and summed again: every version moves ``buffer_size`` devices between groups, and
        summing the groups they touch again cost a pass over the whole fleet per version (issue 27's cost at
        K = N / 10). Each step rounds (float64, an ulp of the group's sum; a group summed afresh, as after a
        restart, can differ in its last bits); a group that empties is dropped, and a group first summed in
        a version is summed in device order, so a buffer of fresh uploads still equals a synchronous round to
        the bit."""
        group = self._members[version]
        group.discard(device_id)
        if not group:
            del self._members[version]
        for key, sums in self._sums.items():
            total = sums.pop(version, None)
            mine = self._terms[key].get(device_id)
            if total is not None and group and mine is not None:
                sums[version] = tuple(t - x for t, x in zip(total, mine, strict=True))

    def items(self) -> Iterator[tuple[Arrays, int]]:
        """(arrays, version) per device, in device order (a sum in a fixed order repeats to the bit)."""
        for dev in sorted(self.uploads):
            yield self.uploads[dev]

    def version_sums(self, key: str, terms: Callable[[Arrays], Terms]) -> list[tuple[int, Terms]]:
        """(version, the sum of ``terms(arrays)`` over the devices whose latest upload trained from it), oldest
        version first; each group's devices are summed in device order, one after the other (so one group of
        fresh uploads sums to the bit as a synchronous round does). ``key`` names the ``terms`` function: its
        results are kept per device and per group until the group changes."""
        self._fns[key] = terms
        dev_terms = self._terms.setdefault(key, {})
        sums = self._sums.setdefault(key, {})
        out = []
        for version in sorted(self._members):
            total = sums.get(version)
            if total is None:
                acc: list[np.ndarray] | None = None
                for dev in sorted(self._members[version]):
                    t = dev_terms.get(dev)
                    if t is None:
                        t = dev_terms[dev] = terms(self.uploads[dev][0])
                    if acc is None:
                        acc = [np.array(x, copy=True) for x in t]
                    else:
                        for a, x in zip(acc, t, strict=True):
                            a += x
                assert acc is not None
                total = sums[version] = tuple(acc)
            out.append((version, total))
        return out

    def state_dict(self) -> LogDoc:
        """Device id -> {"version", "arrays": {name: {"dtype", "shape", "b64"}}}: the same :class:`LogDoc` at every
        call (the entries are shared: the caller serializes them and must not change them)."""
        return self._entries

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset()
        for dev, e in state.items():
            self.put(dev, {k: _array(a) for k, a in e["arrays"].items()}, int(e["version"]))
