"""The device half of a method, and the context it runs in."""

from __future__ import annotations

import hashlib
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from fedge.common.privacy import Mechanism
from fedge.common.rounds import RoundInfo
from fedge.common.settings import MethodName, MethodSettings
from fedge.edge.best import BestModel
from fedge.edge.data.datasets import Dataset
from fedge.edge.divergence import DivergenceGuard
from fedge.edge.models.split import SplitNet
from fedge.edge.training import TrainConfig, accuracy, held_out_metrics

Arrays = dict[str, np.ndarray]

log = logging.getLogger(__name__)


class GlobalEval:
    """Accuracies on one global test set, shared by every device of one process (issue 30).

    Within an architecture group FedAvg gives every device the same model, and each used to pass
    over the whole global test set with it: N identical passes. A device asks here instead, keyed
    by what decides the answer — how it predicts (``kind``, plus e.g. the prototypes it predicts
    with) and a digest of the model's whole state — so each distinct model is evaluated once per
    process. The cached figure is the one the first device computed, with the same code on the
    same data: the results are those of N separate passes, bit for bit.

    Thread-safe (the MQTT simulation runs a thread per device); two threads missing the same key
    at once both compute it, which costs time, never a different figure.
    """

    def __init__(self, test: Dataset, *, max_entries: int = 1024) -> None:
        self.test = test
        self.max_entries = max_entries
        self.passes = 0  # evaluations actually run
        self.hits = 0  # evaluations answered from the cache
        self._acc: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    def accuracy(self, model: torch.nn.Module, compute: Callable[[], float], *, kind: str = "model",
                 extra: bytes = b"") -> float:
        """``compute()`` (an accuracy of ``model`` on :attr:`test`), or the figure of an identical earlier call."""
        h = hashlib.blake2b(digest_size=20)
        spec = getattr(model, "spec", None)
        # BatchNorm's batch counters differ between devices that trained different numbers of batches, yet
        # an evaluation never reads them (eval mode uses the running statistics): they are not part of the key.
        for part in (kind.encode(), repr(spec).encode(), state_digest(model, counters=False), extra):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        key = h.digest()
        with self._lock:
            if key in self._acc:
                self.hits += 1
                self._acc.move_to_end(key)
                return self._acc[key]
        value = compute()
        with self._lock:
            self.passes += 1
            self._acc[key] = value
            while len(self._acc) > self.max_entries:
                self._acc.popitem(last=False)
        return value


@dataclass
class DeviceContext:
    """Everything a device method may use: its model, its data, its plan's settings."""

    device_id: str
    model: SplitNet
    train: Dataset
    local_test: Dataset
    train_cfg: TrainConfig
    upload_precision: str = "fp32"
    seed: int = 0
    method_config: MethodSettings | None = None  # the parsed [method] table (None: the method's defaults)
    global_test: Dataset | None = None
    profile: str = "custom"
    plan: dict[str, Any] = field(default_factory=dict)
    privacy: Mechanism | None = None  # [privacy]: the agent clips and noises the statistics before upload
    global_eval: GlobalEval | None = None  # accuracies on global_test shared with the other devices of this process
    val: Dataset | None = None  # the validation fold held out of the training share: chooses the model shipped

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.torch_gen = torch.Generator().manual_seed(self.seed)

    @property
    def num_classes(self) -> int:
        return self.model.spec.num_classes


class DeviceMethod(ABC):
    """What one device does in each round of a method.

    The agent calls, per round: :meth:`needed_artifacts`, :meth:`apply_global`
    with the decoded artifacts, then (unless the round is final)
    :meth:`train_round`, whose arrays are uploaded at the plan's precision.
    """

    name = MethodName()  # the [run] method name, read from settings_type (written once, there)
    settings_type: ClassVar[type[MethodSettings]]  # the method's [method] descriptor
    settings: MethodSettings  # subclasses narrow the type

    def __init__(self, ctx: DeviceContext) -> None:
        self.ctx = ctx
        self.settings = self.settings_type.given(ctx.method_config, type(self).__name__)
        self._eval_cache: tuple[bytes, dict[str, float]] | None = None  # (state digest, metrics)
        self.best = BestModel()  # the model this device ships (fedge.edge.best); the agent feeds it
        margin = ctx.train_cfg.divergence_margin
        # undoes a round that made the model clearly worse on the validation fold (fedge.edge.divergence)
        self.guard = DivergenceGuard(margin) if margin > 0 and ctx.val is not None and len(ctx.val.y) else None
        self._lr_base: tuple[TrainConfig, TrainConfig] | None = None  # (unscheduled, as last scheduled)
        torch.manual_seed(ctx.seed)

    def schedule(self, info: RoundInfo) -> float:
        """Set ``ctx.train_cfg``'s learning rate to round ``info.round``'s under its ``lr_schedule``, over the
        descriptor's ``rounds`` (the coordinator's total) or, when it says none, the device's own; returns it.

        The unscheduled settings are kept beside: a ``train_cfg`` replaced since the last call (by a test, a
        benchmark) becomes the new base."""
        cur = self.ctx.train_cfg
        base = self._lr_base[0] if self._lr_base is not None and cur is self._lr_base[1] else cur
        self.ctx.train_cfg = base.at_round(info.round, info.rounds)
        self._lr_base = (base, self.ctx.train_cfg)
        if self.ctx.train_cfg.lr != base.lr:
            log.debug("%s: round %d trains at lr %.4g (%s from %g over %d rounds)", self.ctx.device_id, info.round,
                      self.ctx.train_cfg.lr, base.lr_schedule, base.lr, info.rounds or base.rounds)
        return self.ctx.train_cfg.lr

    def data_changed(self) -> None:
        """``ctx.train`` / ``ctx.local_test`` were replaced (a device's own data folder grew between
        rounds): drop everything derived from them. Subclasses that cache data extend this."""
        self._eval_cache = None

    def keep_best(self, round_: int, metrics: dict[str, float]) -> None:
        """Score the model on the validation fold (``metrics["acc_val"]``) and keep it if it is the best yet; with
        the divergence guard, undo the last round if the score fell by more than its margin.

        ``metrics`` (this round's evaluation) is updated in place: after an undone round it holds the kept model's
        figures, with ``rolled_back`` = 1 and the undone model's ``diverged_acc_val`` / ``diverged_acc_global``;
        ``rolled_back`` = 0 after a round the guard accepted.
        """
        val = self.ctx.val
        acc = self.best.observe(round_, self.ctx.model, None if val is None else val.x,
                                None if val is None else val.y, metrics)
        if acc is None:
            return
        metrics["acc_val"] = acc
        if self.guard is None or val is None:
            return
        _, loss = held_out_metrics(self.ctx.model, val.x, val.y)
        if not self.guard.judge(round_, self.ctx.model, acc, loss, len(val.y)):
            metrics["rolled_back"] = 0.0
            return
        undone = dict(metrics)
        metrics.clear()
        metrics.update(self.evaluate())  # the model the device holds now, the one it trains from
        metrics.update(acc_val=float(self.guard.kept_acc or 0.0), rolled_back=1.0, diverged_acc_val=acc)
        if "acc_global" in undone:
            metrics["diverged_acc_global"] = undone["acc_global"]

    def needed_artifacts(self, info: RoundInfo) -> list[str]:
        """Global artifacts this device needs at the start of ``info``'s round."""
        return []

    def apply_global(self, info: RoundInfo, artifacts: dict[str, Arrays]) -> None:  # noqa: B027
        """Load global state into the local model (default: nothing to load)."""

    @abstractmethod
    def train_round(self, info: RoundInfo) -> tuple[Arrays, dict[str, Any]]:
        """Train locally; return (arrays to upload, JSON-able info)."""

    def evaluate(self) -> dict[str, float]:
        """Accuracy of the current model on the global test set and the local test split
        (each only where that set is not empty).

        Cached on a digest of the model's state: rounds that leave the model untouched (the
        generator phases of GeFL and GeFL-F) cost no second pass over the test sets.
        """
        ctx = self.ctx
        digest = state_digest(ctx.model)
        if self._eval_cache is not None and self._eval_cache[0] == digest:
            return dict(self._eval_cache[1])
        # A metric that does not exist is left out, never sent as NaN: the coordinator refuses
        # NaN in a message (JSON has no NaN), and a fleet with local_test_fraction = 0 has no local split.
        out: dict[str, float] = {}
        if len(ctx.local_test.y):
            out["acc_local"] = accuracy(ctx.model, ctx.local_test.x, ctx.local_test.y)
        if ctx.global_test is not None and len(ctx.global_test.y):
            test = ctx.global_test
            out["acc_global"] = self.global_accuracy(lambda: accuracy(ctx.model, test.x, test.y))
        self._eval_cache = (digest, dict(out))
        return out

    def global_accuracy(self, compute: Callable[[], float], *, kind: str = "model", extra: bytes = b"") -> float:
        """An accuracy of this device's model on ``ctx.global_test``: through the process's shared
        :class:`GlobalEval` when there is one for that test set, else ``compute()`` itself."""
        shared = self.ctx.global_eval
        if shared is None or shared.test is not self.ctx.global_test:
            return compute()
        return shared.accuracy(self.ctx.model, compute, kind=kind, extra=extra)


# -- state-dict <-> arrays ------------------------------------------------------------------

def is_buffer_counter(name: str) -> bool:
    """BatchNorm's ``num_batches_tracked`` is a counter, not a weight: never averaged or sent."""
    return name.endswith("num_batches_tracked")


def model_arrays(model: torch.nn.Module, prefixes: Iterable[str] | None = None,
                 exclude: Iterable[str] = ()) -> Arrays:
    """float32 copies of the state-dict entries under ``prefixes`` (all if None)."""
    pre = tuple(prefixes) if prefixes is not None else None
    exc = tuple(exclude)
    return {
        k: v.detach().cpu().numpy().astype(np.float32, copy=True)
        for k, v in model.state_dict().items()
        if not is_buffer_counter(k)
        and (pre is None or k.startswith(pre))
        and not (exc and k.startswith(exc))
    }


def state_digest(model: torch.nn.Module, *, counters: bool = True) -> bytes:
    """A digest of every state-dict entry (weights and BN statistics): equal iff the model is unchanged.
    ``counters=False`` leaves BatchNorm's batch counters out (what a prediction depends on)."""
    h = hashlib.blake2b(digest_size=16)
    for k, v in model.state_dict().items():
        if not counters and is_buffer_counter(k):
            continue
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def load_arrays(model: torch.nn.Module, arrays: Arrays) -> None:
    """Copy ``arrays`` into matching state-dict entries (shapes must agree)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in arrays.items():
            state[k].copy_(torch.from_numpy(np.asarray(v)).reshape(state[k].shape))
