"""A device installing a new model version: verify, check, switch in atomically, or roll back by itself.

:class:`ModelUpdater` takes a package that already passed the fleet's signature check (:mod:`fedge.mqtt.ota`)
and, in order:

1. refuses a version that is not newer than the one in use, or that was rolled back here before;
2. installs it beside the current one (:class:`~fedge.runtime.store.ModelStore`: whole or not at all);
3. runs the smoke test in a child process (:func:`fedge.runtime.checks.smoke_test`);
4. measures its accuracy on the device's own validation split and compares it with the current model's (in
   the same child process: the agent never loads a model itself): more than ``threshold`` lower (2 points by
   default, the order's ``threshold``) fails;
5. switches it in, the old one kept as ``previous``, the new one on trial (repeated crashes of whoever uses
   it roll it back: :meth:`ModelStore.open_current`).

A failed check discards the new version and keeps the current one in use: the device *rolls back* without
ever serving the bad model; the status says which check failed, with the figures.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedge.runtime.checks import smoke_test
from fedge.runtime.package import unpack
from fedge.runtime.store import ModelStore, StoreError

log = logging.getLogger(__name__)


class ModelUpdater:
    """Applies model packages to ``store``; ``validation`` = (x, y), the device's preprocessed local split."""

    def __init__(self, store: ModelStore, validation: tuple[np.ndarray, np.ndarray] | None, *,
                 max_bytes: int = 256 * 1024 * 1024, smoke_timeout_s: float = 120.0) -> None:
        self.store = store
        self.validation = validation
        self.max_bytes = max_bytes
        self.smoke_timeout_s = smoke_timeout_s

    def apply(self, data: bytes, *, version: int, fleet: str, threshold: float) -> dict[str, Any]:
        """Install the package ``data`` (the order's ``version`` for ``fleet``); returns the status fields."""
        package = unpack(data, max_bytes=self.max_bytes)
        if package.version != version or package.fleet != fleet:
            raise StoreError(f"the package holds version {package.version} of fleet {package.fleet!r}, the order "
                             f"says version {version} of {fleet!r}: nothing changed")
        self.store.check_new(version)
        path = self.store.install(package)
        current = self.store.current  # version 0 is the flashed model: compare with `is not None`
        compare = self.validation is not None and current is not None
        smoke = smoke_test(path, timeout_s=self.smoke_timeout_s, validation=self.validation if compare else None,
                           current=self.store.path(current) if compare and current is not None else None)
        fields: dict[str, Any] = {"smoke": smoke.to_dict()}
        if not smoke.ok:
            reason = f"smoke test failed: {smoke.error}"
            self.store.discard(version, reason)
            return {**fields, "state": "rolled-back", "reason": reason}
        if compare:
            assert self.validation is not None
            y = self.validation[1]
            acc = smoke.accuracy or {}
            new, cur = (float("nan") if acc.get(k) is None else float(acc[k]) for k in ("new", "current"))
            fields["accuracy"] = {"new": new, "current": cur, "threshold": threshold, "samples": len(y)}
            if not new >= cur - threshold:  # NaN fails too
                reason = (f"local accuracy {new:.1%} is more than {threshold:.1%} below the current model's "
                          f"{cur:.1%} (on {len(y)} local samples)")
                self.store.discard(version, reason)
                log.warning("model version %d refused: %s", version, reason)
                return {**fields, "state": "rolled-back", "reason": reason}
        self.store.activate(version)
        return {**fields, "state": "installed", "reason": ""}
