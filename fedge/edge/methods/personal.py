"""No device ends worse off than alone (issue 17): a personal head and a guard on synthetic knowledge.

Both decide on data the device holds out from its own training set, never on a test split:

* **Personal head** (``[method] personalize``): FedRoD's two heads (Chen & Chao, ICLR 2022),
  the personal one fitted as FedBABU does (Oh et al., ICLR 2022: fine-tune on local data after
  federated training). At every evaluation the device fits a copy of its federated model
  (``personal_part = "model"``) or only of its head on the frozen features (``"head"``) on its
  real data minus a held-out split — ``personal_epochs`` epochs, and at least ``personal_min_steps``
  SGD steps, so a device with one batch of data is not left with a handful of steps — compares
  it with the federated model on that split (a tie goes to the personal one), refits the winner
  on all its real data, and answers its own distribution with it. The federated model keeps
  serving the global test set and the federation itself: no bytes, no change for the other devices.
* **Guard** (``[method] guard``): each round the device trains twice from the same start — once
  as the method does with this round's synthetic samples, once without them, both followed by
  one epoch on its real data minus a held-out fold — and keeps the synthetic branch only if its
  held-out accuracy is not lower (``guard_tolerance`` points of slack, the held-out loss breaks a
  tie). A round that hurts also halves the device's synthetic weight (the share of synthetic
  samples it draws in later rounds); only a round that helps doubles it again, up to 1 — so
  samples whose harm a real epoch merely hides (a tie) stay down-weighted. The fold rotates with
  the round, so over the rounds every real sample trains. GeFL's guard also judges the fleet's
  averaged extractor against the group's own, by the same rule (``guard_extractor``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedge.common.method_settings import GuardedSettings, PersonalSettings
from fedge.edge.methods.base import DeviceMethod, state_digest
from fedge.edge.training import Forward, held_out_metrics, train_epochs

log = logging.getLogger(__name__)


def holdout(n: int, fraction: float, seed: int, fold: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of ``n`` samples: fold ``fold`` of ``round(1 / fraction)``.

    The permutation depends on ``seed`` only, so fold 0 is the same split at every call and
    successive folds cover every sample. Fewer than two samples: nothing is held out.
    """
    if n < 2:
        return np.arange(n), np.zeros(0, dtype=np.int64)
    k = max(2, round(1.0 / fraction))
    perm = np.random.default_rng(seed).permutation(n)
    val = np.sort(perm[fold % k :: k])
    if len(val) == 0:  # n < k: hold out one sample
        val = perm[:1]
    return np.setdiff1d(np.arange(n), val), val


def personal_fit_epochs(n: int, batch_size: int, epochs: int, min_steps: int) -> int:
    """Epochs of a personal fit on ``n`` samples: ``epochs``, or more until ``min_steps`` SGD steps.

    Counted in epochs alone, a fit gives a device with one batch of data one step per epoch
    (5 steps for 15 images), while training alone it would have taken one per epoch of every
    round; the floor gives every device at least ``min_steps`` steps, whatever its size.
    """
    if n == 0:
        return epochs
    per_epoch = -(-n // batch_size)  # ceil
    return max(epochs, -(-min_steps // per_epoch))


@torch.no_grad()
def _features(model: Any, x: np.ndarray, batch_size: int = 1024) -> torch.Tensor:
    model.eval()
    if len(x) == 0:
        return torch.zeros((0, model.spec.feature_dim))
    return torch.cat([model.features(torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size])))
                      for i in range(0, len(x), batch_size)])


@dataclass(frozen=True)
class PersonalChoice:
    """The two predictors a device compared and which one answers its own distribution."""

    personal: bool  # the personal predictor won on the held-out split
    val_generic: float  # held-out accuracy of the federated model
    val_personal: float  # held-out accuracy of the personal one (fitted without the held-out split)


Predict = Callable[[np.ndarray], np.ndarray]  # inputs -> predicted labels


@torch.no_grad()
def _predict_with(model: Any, head: nn.Module | None = None) -> Predict:
    """Labels from ``model`` (its own head, or ``head`` on its features), in eval mode."""
    def predict(x: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.zeros(0, dtype=np.int64)
        feats = _features(model, x)
        h = head if head is not None else model.head
        h.eval()
        return h(feats).argmax(1).numpy()
    return predict


def _accuracy(predict: Predict, x: np.ndarray, y: np.ndarray) -> float:
    return float((predict(x) == y).mean()) if len(y) else float("nan")


class PersonalMixin:
    """``evaluate`` with a personal head or model (``[method] personalize``); put it before
    :class:`DeviceMethod`."""

    settings: Any

    def _personal_settings(self) -> PersonalSettings | None:
        s = self.settings
        return s if isinstance(s, PersonalSettings) and s.personalize else None

    def _fit(self, idx: np.ndarray, feats: torch.Tensor) -> Predict:
        """A personal predictor fitted from the federated one on the real samples ``idx``."""
        dm: DeviceMethod = self  # type: ignore[assignment]
        cfg = self._personal_settings()
        assert cfg is not None
        ctx = dm.ctx
        model: Any = ctx.model
        rng = np.random.default_rng(ctx.seed)
        epochs = personal_fit_epochs(len(idx), ctx.train_cfg.batch_size, cfg.personal_epochs, cfg.personal_min_steps)
        if cfg.personal_part == "model":
            mine = copy.deepcopy(model)
            train_epochs(mine, ctx.train.x[idx], ctx.train.y[idx], ctx.train_cfg, rng, epochs=epochs)
            return _predict_with(mine)
        head = copy.deepcopy(model.head)

        def forward(fb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return head(fb), fb

        train_epochs(head, feats[idx].numpy(), ctx.train.y[idx], ctx.train_cfg, rng, epochs=epochs,
                     forward=forward)
        return _predict_with(model, head)

    def personal_predictor(self) -> tuple[Predict, PersonalChoice]:
        """What answers this device's own distribution, and how it was chosen."""
        dm: DeviceMethod = self  # type: ignore[assignment]
        cfg = self._personal_settings()
        assert cfg is not None
        ctx = dm.ctx
        feats = _features(ctx.model, ctx.train.x) if cfg.personal_part == "head" else torch.zeros(0)
        rest, val = holdout(len(ctx.train), cfg.val_fraction, ctx.seed)
        generic = _predict_with(ctx.model)
        candidate = self._fit(rest, feats)
        xv, yv = ctx.train.x[val], ctx.train.y[val]
        # a tie goes to the personal one: it has seen this device's distribution, and nothing else
        choice = PersonalChoice(bool(_accuracy(candidate, xv, yv) >= _accuracy(generic, xv, yv)),
                                _accuracy(generic, xv, yv), _accuracy(candidate, xv, yv))
        if not choice.personal:
            return generic, choice
        # The held-out split chose the personal one; it is then fitted on every real sample.
        return self._fit(np.arange(len(ctx.train)), feats), choice

    def evaluate(self) -> dict[str, float]:
        """The federated model's accuracies, plus (``personalize``) the personal predictor's.

        ``acc_local`` is the chosen predictor's on the device's local split, ``acc_global`` the
        federated model's on the global test set; ``acc_local_generic`` and
        ``acc_global_personal`` are the two other pairings, so nothing is hidden.
        """
        cfg = self._personal_settings()
        if cfg is None:
            return super().evaluate()  # type: ignore[misc]
        dm: DeviceMethod = self  # type: ignore[assignment]
        ctx = dm.ctx
        digest = state_digest(ctx.model)
        cached = getattr(self, "_personal_cache", None)
        if cached is not None and cached[0] == digest:
            return dict(cached[1])
        mine, choice = self.personal_predictor()
        generic = _predict_with(ctx.model)
        out = {"acc_local": _accuracy(mine, ctx.local_test.x, ctx.local_test.y),
               "acc_local_generic": _accuracy(generic, ctx.local_test.x, ctx.local_test.y),
               "personal": float(choice.personal),
               "val_gain_personal": 100.0 * (choice.val_personal - choice.val_generic)}
        if ctx.global_test is not None:
            test = ctx.global_test
            # the federated model's figure: the same for every device holding this model (FedAvg's group)
            out["acc_global"] = dm.global_accuracy(lambda: _accuracy(generic, test.x, test.y), kind="features-head")
            out["acc_global_personal"] = (_accuracy(mine, ctx.global_test.x, ctx.global_test.y) if choice.personal
                                          else out["acc_global"])
        out = {k: v for k, v in out.items() if not np.isnan(v)}
        self._personal_cache = (digest, dict(out))
        return out


# -- the guard ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GuardDecision:
    """One round's verdict on the synthetic samples, measured on the held-out fold."""

    used: bool
    effect: float  # held-out accuracy with − without the synthetic samples, points
    loss_effect: float  # held-out cross-entropy with − without

    def info(self, weight: float | None = None, prefix: str = "guard") -> dict[str, Any]:
        """The keys a round's update carries (``results.json`` per device and round): ``weight`` is the
        synthetic weight this round's samples were drawn at; ``prefix`` names the knowledge judged
        (``guard_stem``: the fleet's extractor, which has no weight)."""
        out: dict[str, Any] = {f"{prefix}_used": self.used, f"{prefix}_effect": round(self.effect, 3),
                               f"{prefix}_loss_effect": round(self.loss_effect, 5)}
        if weight is not None:
            out[f"{prefix}_weight"] = weight
        return out

    def next_weight(self, weight: float) -> float:
        """The synthetic weight of the next round: halved after harm, doubled (at most 1) after help."""
        if not self.used:
            return weight / 2
        return min(1.0, weight * 2) if self.effect > 0 else weight


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def guarded_step(model: nn.Module, with_synthetic: Callable[[], None], without: Callable[[], None],
                 val_x: np.ndarray, val_y: np.ndarray, tolerance: float,
                 forward: Forward | None = None) -> GuardDecision:
    """Run ``without`` and ``with_synthetic`` from the same state; keep the better on the held-out data.

    The synthetic branch is kept unless its held-out accuracy is more than ``tolerance`` points
    below the other branch's; at exactly the tolerance, the lower held-out loss wins.
    """
    start = _snapshot(model)
    without()
    acc_r, loss_r = held_out_metrics(model, val_x, val_y, forward)
    plain = _snapshot(model)
    model.load_state_dict(start)
    with_synthetic()
    acc_s, loss_s = held_out_metrics(model, val_x, val_y, forward)
    effect = 100.0 * (acc_s - acc_r)
    margin = effect + tolerance
    used = margin > 1e-9 or (abs(margin) <= 1e-9 and loss_s <= loss_r)
    if not used:
        model.load_state_dict(plain)
    return GuardDecision(used, effect, loss_s - loss_r)


def guard_settings(settings: Any) -> GuardedSettings | None:
    """``settings`` if the guard is on, else None."""
    return settings if isinstance(settings, GuardedSettings) and settings.guard else None


__all__ = ["GuardDecision", "PersonalChoice", "PersonalMixin", "Predict", "guard_settings", "guarded_step",
           "held_out_metrics", "holdout", "personal_fit_epochs"]
