"""The device half of a method, and the context it runs in."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from fedge.common.privacy import Mechanism
from fedge.common.rounds import RoundInfo
from fedge.common.settings import MethodName, MethodSettings
from fedge.edge.data.datasets import Dataset
from fedge.edge.models.zoo import FedgeNet
from fedge.edge.training import TrainConfig, accuracy

Arrays = dict[str, np.ndarray]


@dataclass
class DeviceContext:
    """Everything a device method may use: its model, its data, its plan's settings."""

    device_id: str
    model: FedgeNet
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
        torch.manual_seed(ctx.seed)

    def data_changed(self) -> None:
        """``ctx.train`` / ``ctx.local_test`` were replaced (a device's own data folder grew between
        rounds): drop everything derived from them. Subclasses that cache data extend this."""
        self._eval_cache = None

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
            out["acc_global"] = accuracy(ctx.model, ctx.global_test.x, ctx.global_test.y)
        self._eval_cache = (digest, dict(out))
        return out


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


def state_digest(model: torch.nn.Module) -> bytes:
    """A digest of every state-dict entry (weights and BN statistics): equal iff the model is unchanged."""
    h = hashlib.blake2b(digest_size=16)
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def load_arrays(model: torch.nn.Module, arrays: Arrays) -> None:
    """Copy ``arrays`` into matching state-dict entries (shapes must agree)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in arrays.items():
            state[k].copy_(torch.from_numpy(np.asarray(v)).reshape(state[k].shape))
