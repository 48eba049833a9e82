"""The model a device ships is its best one (issue 45): the checkpoint that scored best on its validation fold.

Every time the device evaluates (the start of a round, after the global state is applied, and the final
round), :class:`BestModel` scores the model on the device's validation fold — samples held out of its
training share (``[train] val_fraction``), never its local test split nor the global test set — and keeps
a copy of the model when it beats every earlier round (a tie goes to the later round: the same validation
score after more federation). The simulator writes that copy as ``checkpoints/<device>.safetensors`` (and
the last model as ``<device>.last.safetensors``), which ``fedge export`` ships; a device run with
``--state-dir`` keeps it in ``STATE_DIR/best.safetensors``, so a restart neither forgets it nor lets a worse
model replace it.

A device without a validation fold (``val_fraction = 0``, or a share too small to hold one out) has nothing
to choose by: its best model is its last one, and the record says so (``acc_val`` is None).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedge.edge.training import accuracy
from fedge.errors import CheckpointError

log = logging.getLogger(__name__)

BEST_CHECKPOINT = "best.safetensors"


@dataclass(frozen=True)
class BestRecord:
    """Where the kept model came from and how it scored."""

    round: int
    acc_val: float | None
    """Accuracy on the device's validation fold (None: no fold, the last model is kept)."""
    acc_global: float | None = None
    """Its accuracy on the global test set when that round evaluated it (reported, never used to choose)."""
    acc_local: float | None = None

    def meta(self, prefix: str = "fedge.best") -> dict[str, str]:
        """The record as checkpoint metadata (``<prefix>.round`` ... as JSON strings)."""
        return {f"{prefix}.{k}": json.dumps(v) for k, v in asdict(self).items()}

    @classmethod
    def from_meta(cls, meta: dict[str, str], prefix: str = "fedge.best") -> BestRecord | None:
        """The record a checkpoint's metadata holds under ``prefix``, or None (a checkpoint written without one)."""
        if f"{prefix}.round" not in meta:
            return None
        try:
            vals = {k: json.loads(meta[f"{prefix}.{k}"]) for k in ("round", "acc_val", "acc_global", "acc_local")
                    if f"{prefix}.{k}" in meta}
            return cls(**vals)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"checkpoint metadata {prefix}.* is malformed: {exc}") from exc


class BestModel:
    """Keeps a device's best model by validation accuracy; with ``state_dir``, on disk as well."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.record: BestRecord | None = None
        self.state: dict[str, torch.Tensor] | None = None  # None with a record: the model on disk
        self.checks = 0

    @property
    def path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / BEST_CHECKPOINT

    def load(self, model: nn.Module) -> BestRecord | None:
        """Restore the record and weights kept in ``state_dir`` (a restart), if any; the weights must fit ``model``."""
        path = self.path
        if path is None or not path.is_file():
            return None
        from fedge.edge.models.checkpoint import load_checkpoint, read_checkpoint_meta

        meta = read_checkpoint_meta(path)
        record = BestRecord.from_meta(meta)
        if record is None:
            raise CheckpointError(f"{path} records no fedge.best.round: not a best-model checkpoint",
                                  hint="remove it; the device keeps its best model there again from the next round")
        kept = load_checkpoint(path)
        try:
            copy.deepcopy(model).load_state_dict(kept.state_dict())
        except RuntimeError as exc:
            raise CheckpointError(f"{path} does not fit this device's model ({exc})",
                                  hint="the fleet changed this device's architecture: remove the state file") from exc
        self.record, self.state = record, {k: v.clone() for k, v in kept.state_dict().items()}
        log.info("best model restored from %s: round %d, validation accuracy %s", path, record.round, record.acc_val)
        return record

    def observe(self, round_: int, model: nn.Module, val_x: np.ndarray | None, val_y: np.ndarray | None,
                metrics: dict[str, float]) -> float | None:
        """Score ``model`` (as of ``round_``) on the validation fold and keep it if it is the best so far.

        Returns its validation accuracy (None without a fold). ``metrics``: that round's other figures, kept
        with the record for the report.
        """
        self.checks += 1
        acc = accuracy(model, val_x, val_y) if val_x is not None and val_y is not None and len(val_y) else None
        rec = self.record
        better = (rec is None or acc is None or rec.acc_val is None
                  or acc >= rec.acc_val)  # a tie goes to the later round
        if better:
            self.record = BestRecord(round_, acc, metrics.get("acc_global"), metrics.get("acc_local"))
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self._persist(model)
        return acc

    def model(self, like: nn.Module) -> nn.Module:
        """A copy of ``like`` holding the kept weights (``like`` itself when nothing was kept yet)."""
        if self.state is None:
            return like
        best = copy.deepcopy(like)
        best.load_state_dict(self.state)
        return best

    def _persist(self, model: nn.Module) -> None:
        path = self.path
        if path is None or self.record is None:
            return
        from fedge.edge.models.checkpoint import save_checkpoint

        # atomic (a crash keeps the previous best); the record travels in the checkpoint's own metadata
        save_checkpoint(self.model(model), path, extra=self.record.meta())

    def to_dict(self) -> dict[str, Any] | None:
        return None if self.record is None else asdict(self.record)
