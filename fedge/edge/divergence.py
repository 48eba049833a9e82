"""A divergence guard for the rounds themselves (issue 45): a round that makes a device's model clearly worse on its
validation fold is undone, and the device trains the next round from the model it had before.

Every time a device evaluates (the start of a round, after that round's global state is applied), it scores its
model on its validation fold — the fold that also chooses the model it ships (:mod:`fedge.edge.best`), held out of
its training share, never a test split. :class:`DivergenceGuard` compares that score with the score of the model
the guard last *kept*. When it fell by more than ``[train] divergence_margin`` points (and by at least
:data:`MIN_DROP_IMAGES` images of the fold) while the fold's cross-entropy rose, the device loads the kept model
back, reports the round
(``rolled_back`` = 1 in its metrics, with ``diverged_acc_val`` / ``diverged_acc_global``: what the undone model
scored) and trains from the kept model; otherwise the new model becomes the kept one. The synthetic-knowledge
guard (:mod:`fedge.edge.methods.personal`) does the same for one round's synthetic samples.

What "previous" means, and why not the best: the kept model is the one of the device's previous evaluation that
the guard accepted — the model it trained its last round from. The best model so far is the maximum of noisy
scores (a fold holds 13-26 images on issue 45's fleet: one image is 4-8 points), so a comparison with it would
undo rounds that are merely average and could pin a device to one lucky round for the rest of the run; the
previous model's score is one draw, like the new one's, on the same images.

Noise, and why the loss must agree: a device's fold is part of its label-skewed share, so an untrained model that
predicts one class can score 44 % on it (issue 45's fleet, seed 1), and the first rounds of learning the other
classes lower that accuracy while they lower the loss. Measured on that fleet with an accuracy-only rule (margin
20), one device undid every round from its first and stayed at chance. A divergence makes the model worse by both
measures; learning that trades a few images of a majority class for the rest lowers the loss. And the guard never
holds a device longer than :data:`MAX_UNDONE_IN_A_ROW` rounds in a row: after that the round stands, and its model
becomes the kept one (the fleet has moved on; a guard that disagrees with it for longer is holding the device back).

Over MQTT a device run with ``--state-dir`` keeps the kept model in ``STATE_DIR/kept.safetensors`` (written
atomically, with its round, scores and undone rounds in a row as metadata), so a device restarted mid-run judges its
next round against the model it kept before the restart, not against nothing. A kept model from a later round than
the one the device evaluates belongs to an earlier run (a new run counts from round 1 again): it is set aside.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fedge.errors import CheckpointError

log = logging.getLogger(__name__)

KEPT_CHECKPOINT = "kept.safetensors"
_META = "fedge.kept"

# A drop of a single image is never a divergence, however small the fold (on a fold of 4, one image is 25 points).
MIN_DROP_IMAGES = 2
# Rounds in a row a device may undo; the next one stands whatever it scores.
MAX_UNDONE_IN_A_ROW = 2


def diverged(kept: float, new: float, n_val: int, margin: float) -> bool:
    """Whether a validation accuracy of ``new`` after ``kept`` (both in [0, 1], on the same ``n_val`` images) is a
    divergence: more than ``margin`` points lower, and at least :data:`MIN_DROP_IMAGES` images fewer right."""
    drop = kept - new
    # 1e-9: a drop of exactly the margin (0.8 - 0.7 is 0.1000...09 in floating point) is not more than it
    return 100.0 * drop > margin + 1e-9 and round(drop * n_val) >= MIN_DROP_IMAGES


@dataclass
class DivergenceGuard:
    """Keeps the model of the last accepted evaluation; undoes a round whose model scores clearly worse."""

    margin: float
    """Points of validation accuracy a round may lose before it is undone (> 0)."""
    kept_acc: float | None = None
    """Validation accuracy of the kept model (None: nothing kept yet)."""
    kept_loss: float = math.inf
    """Validation cross-entropy of the kept model."""
    rollbacks: list[int] = field(default_factory=list)
    """Rounds at whose start the device went back to its kept model."""
    in_a_row: int = 0
    """Rounds undone since the kept model was kept."""
    path: Path | None = None
    """Where the kept model is kept on disk (``STATE_DIR/kept.safetensors``; None: in memory only)."""
    kept_round: int | None = None
    """The round whose model is kept."""
    restored: bool = False
    """The kept model came from :attr:`path` (a restart) and no round has been judged since."""
    _state: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.margin <= 100:
            raise ValueError(f"divergence margin must be in (0, 100] points, got {self.margin}")

    def judge(self, round_: int, model: nn.Module, acc_val: float, loss_val: float, n_val: int) -> bool:
        """Judge ``model`` (as of the start of ``round_``), which scored ``acc_val`` with cross-entropy ``loss_val`` on
        ``n_val`` validation images.

        Returns True when it diverged: ``model`` then holds the kept model again. Otherwise it becomes the kept one.
        """
        if math.isnan(acc_val) or n_val <= 0:
            return False
        if self.restored and self.kept_round is not None and round_ < self.kept_round:
            log.info("round %d: the kept model on disk is of round %d, an earlier run's: set aside", round_,
                     self.kept_round)
            self._state, self.kept_acc, self.kept_loss, self.in_a_row = None, None, math.inf, 0
        self.restored = False
        if (self._state is not None and self.kept_acc is not None and self.in_a_row < MAX_UNDONE_IN_A_ROW
                and diverged(self.kept_acc, acc_val, n_val, self.margin) and loss_val > self.kept_loss):
            model.load_state_dict(self._state)
            self.rollbacks.append(round_)
            self.in_a_row += 1
            log.info("round %d: validation accuracy %.1f %% is more than %g points below the kept model's %.1f %% "
                     "(cross-entropy %.3f after %.3f): the round is undone, training goes on from the kept model",
                     round_, 100 * acc_val, self.margin, 100 * self.kept_acc, loss_val, self.kept_loss)
            self._persist(model)
            return True
        self.kept_acc, self.kept_loss, self.in_a_row, self.kept_round = acc_val, loss_val, 0, round_
        self._state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._persist(model)
        return False

    def keep_in(self, state_dir: str | Path, model: nn.Module) -> bool:
        """Keep the kept model in ``state_dir`` from now on, and take back the one an earlier start kept there (its
        weights must fit ``model``); returns whether one was taken back."""
        self.path = Path(state_dir) / KEPT_CHECKPOINT
        if not self.path.is_file():
            return False
        from fedge.edge.models.checkpoint import load_checkpoint, read_checkpoint_meta

        meta = read_checkpoint_meta(self.path)
        try:
            vals = {k: json.loads(meta[f"{_META}.{k}"]) for k in ("round", "acc_val", "loss_val", "in_a_row")}
            round_, acc, loss, in_a_row = (int(vals["round"]), float(vals["acc_val"]), float(vals["loss_val"]),
                                           int(vals["in_a_row"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.path} is not a divergence guard's kept model ({exc})",
                                  hint="remove it; the device keeps its model there again from its next round") from exc
        state = load_checkpoint(self.path).state_dict()
        try:
            copy.deepcopy(model).load_state_dict(state)
        except RuntimeError as exc:
            raise CheckpointError(f"{self.path} does not fit this device's model ({exc})",
                                  hint="the fleet changed this device's architecture: remove the state file") from exc
        self._state = {k: v.clone() for k, v in state.items()}
        self.kept_round, self.kept_acc, self.kept_loss, self.in_a_row = round_, acc, loss, in_a_row
        self.restored = True
        log.info("divergence guard: kept model of round %d (validation accuracy %.1f %%) restored from %s", round_,
                 100 * acc, self.path)
        return True

    def _persist(self, model: nn.Module) -> None:
        """Write the kept model and its record to :attr:`path` (atomically; a crash keeps the previous one)."""
        if self.path is None or self._state is None or self.kept_round is None:
            return
        from fedge.edge.models.checkpoint import save_checkpoint

        kept = copy.deepcopy(model)
        kept.load_state_dict(self._state)
        meta = {f"{_META}.{k}": json.dumps(v) for k, v in
                (("round", self.kept_round), ("acc_val", self.kept_acc), ("loss_val", self.kept_loss),
                 ("in_a_row", self.in_a_row))}
        save_checkpoint(kept, self.path, extra=meta)
