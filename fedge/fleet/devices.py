"""Turn a fleet config into devices: data shares, models, method halves. Needs torch.

What each device *is* (profile, plan, model spec, data share) comes from its
torch-free :class:`~fedge.fleet.slots.DeviceSlot`; this module adds what only a
device has: its data, its model and its method's device half. The torch-free
part of the fleet layer never imports this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.common.initseeds import device_seed, init_seeds
from fedge.common.rounds import DeviceInfo
from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.data.partition import DeviceSplit
from fedge.edge.methods import DeviceContext, DeviceMethod
from fedge.edge.methods.base import GlobalEval
from fedge.edge.models.zoo import build_seeded
from fedge.edge.training import TrainConfig
from fedge.fleet.config import FleetConfig, device_ids
from fedge.fleet.registry import method_entry
from fedge.fleet.slots import DeviceSlot, check_feature_dims, device_slot, fleet_data_dir, fleet_splits

log = logging.getLogger(__name__)


@dataclass
class FleetData:
    train: Dataset
    test: Dataset
    splits: list[DeviceSplit]


@dataclass
class SimDevice:
    """One simulated device: its registry record and its method's device half."""

    info: DeviceInfo
    method: DeviceMethod
    plan: dict[str, Any]


def load_fleet_data(cfg: FleetConfig) -> FleetData:
    """Load the data set and partition it over the fleet, deterministically by seed."""
    run = cfg.run
    channels, size = cfg.input_shape[0], cfg.input_shape[-1]  # a 1-D data set keeps its own shape
    train = load_dataset(run.dataset, train=True, data_dir=fleet_data_dir(cfg), seed=run.seed, image_size=size,
                         channels=channels)
    test = load_dataset(run.dataset, train=False, data_dir=fleet_data_dir(cfg), seed=run.seed, image_size=size,
                        channels=channels)
    return FleetData(train, test, fleet_splits(cfg, train.y))


def build_devices(cfg: FleetConfig, data: FleetData) -> list[SimDevice]:
    """Build every device's model and method half from its profile's plan.

    The devices share one :class:`GlobalEval`, so a model several of them hold (FedAvg's group) is
    evaluated on the global test set once.
    """
    shared = GlobalEval(data.test)
    devices = [build_device(cfg, data, idx, global_eval=shared) for idx in range(cfg.num_devices)]
    _check_feature_dims(cfg, devices)
    return devices


def show_global_test(devices: list[SimDevice], test: Dataset) -> None:
    """Give every device ``test`` as its global test set (a benchmark's slice of the dataset's test split), with
    one :class:`GlobalEval` over it shared by them all: a model several devices hold is still scored once. A
    device whose ``global_test`` alone were replaced would bypass the shared cache, which answers only for
    the set it was made for, and every device would pass over the images itself."""
    shared = GlobalEval(test)
    for d in devices:
        d.method.ctx.global_test = test
        d.method.ctx.global_eval = shared


def build_device(cfg: FleetConfig, data: FleetData, idx: int, *, global_eval: GlobalEval | None = None) -> SimDevice:
    """Build device number ``idx`` (fleet order) alone, as a real device does from the fleet config."""
    split = data.splits[idx]
    slot = device_slot(cfg, idx, data.train.y, split)
    return device_from_slot(cfg, slot, data.train.subset(split.train), data.train.subset(split.test), data.test,
                            global_eval=global_eval, val=data.train.subset(split.val))


def device_from_slot(cfg: FleetConfig, slot: DeviceSlot, train: Dataset, local_test: Dataset,
                     global_test: Dataset | None, *, global_eval: GlobalEval | None = None,
                     val: Dataset | None = None) -> SimDevice:
    """The device of ``slot`` on its data share (``train``, ``local_test``, the validation fold ``val``) — all a
    worker process needs to build the same device the driver would (``fedge simulate --backend process``)."""
    entry = method_entry(cfg.run.method)
    idx = slot.index
    p = slot.plan
    # Every part the method averages starts where the other devices' start (fedge.common.initseeds).
    seeds = init_seeds(cfg.method_config.shared_start(), run_seed=cfg.run.seed, index=idx, arch=slot.spec.name)
    model = build_seeded(slot.spec, seeds)
    tc = TrainConfig(
        lr=cfg.train.lr or p.lr,
        lr_schedule=cfg.train.lr_schedule or p.lr_schedule,
        rounds=cfg.run.rounds,
        batch_size=cfg.train.batch_size or p.batch_size,
        local_epochs=cfg.train.local_epochs or p.local_epochs,
        momentum=cfg.train.momentum,
        weight_decay=cfg.train.weight_decay,
        min_tail=cfg.train.min_tail or p.min_tail,
        divergence_margin=cfg.train.guard_margin(),
    )
    ctx = DeviceContext(
        device_id=slot.device_id,
        model=model,
        train=train,
        local_test=local_test,
        train_cfg=tc,
        upload_precision=slot.upload_precision,
        seed=device_seed(cfg.run.seed, idx),
        method_config=cfg.method_config,
        global_test=global_test,
        profile=slot.profile,
        plan=p.to_dict(),
        privacy=cfg.privacy_mechanism,
        global_eval=global_eval,
        val=val,
    )
    return SimDevice(slot.info(), entry.build_device(ctx), p.to_dict())


def _check_feature_dims(cfg: FleetConfig, devices: list[SimDevice]) -> None:
    check_feature_dims(cfg, (d.info.feature_dim for d in devices),
                       shares_features=method_entry(cfg.run.method).shares_features)


def class_histograms(cfg: FleetConfig, data: FleetData) -> list[tuple[str, np.ndarray, np.ndarray, int]]:
    """(device id, train histogram, local-test histogram, validation fold size) per device."""
    c = data.train.num_classes
    return [
        (dev_id, np.bincount(data.train.y[s.train], minlength=c), np.bincount(data.train.y[s.test], minlength=c),
         len(s.val))
        for (dev_id, _), s in zip(device_ids(cfg), data.splits, strict=True)
    ]
