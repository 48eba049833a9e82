"""Turn a fleet config into devices: data shares, profiles, plans, models, method halves."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.common.archs import arch_by_name
from fedge.common.rounds import DeviceInfo
from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.data.partition import DeviceSplit, dirichlet, iid_fraction, local_splits, shards
from fedge.edge.methods import DeviceContext, DeviceMethod
from fedge.edge.models.zoo import build_model
from fedge.edge.training import TrainConfig
from fedge.errors import ConfigError
from fedge.fleet.config import FleetConfig, device_ids
from fedge.fleet.methods import method_entry
from fedge.profiles import load_profile, plan

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
    run, part = cfg.run, cfg.partition
    data_dir = str(cfg.base_dir / run.data_dir) if run.data_dir else None
    train = load_dataset(run.dataset, train=True, data_dir=data_dir, seed=run.seed)
    test = load_dataset(run.dataset, train=False, data_dir=data_dir, seed=run.seed)
    n = cfg.num_devices
    if part.kind == "iid":
        parts = iid_fraction(train.y, n, part.fraction, run.seed)
    elif part.kind == "dirichlet":
        parts = dirichlet(train.y, n, part.alpha, run.seed, min_size=part.min_size, fraction=part.fraction)
    else:
        parts = shards(train.y, n, part.shards_per_device, run.seed, fraction=part.fraction)
    return FleetData(train, test, local_splits(parts, part.local_test_fraction, run.seed))


def build_devices(cfg: FleetConfig, data: FleetData) -> list[SimDevice]:
    """Build every device's model and method half from its profile's plan."""
    devices = [build_device(cfg, data, idx) for idx in range(cfg.num_devices)]
    _check_feature_dims(cfg, devices)
    return devices


def build_device(cfg: FleetConfig, data: FleetData, idx: int) -> SimDevice:
    """Build device number ``idx`` (fleet order) alone, as a real device does from the fleet config."""
    entry = method_entry(cfg.run.method)
    ids = device_ids(cfg)
    dev_id, gi = ids[idx]
    group = cfg.devices[gi]
    k = sum(1 for _, g in ids[:idx] if g == gi)  # position within its group
    profile_ref = group.profile
    if profile_ref.endswith(".toml") and not profile_ref.startswith("/"):
        profile_ref = str(cfg.base_dir / profile_ref)
    profile = load_profile(profile_ref)
    split = data.splits[idx]
    p = plan(profile, embed_dim=cfg.run.embed_dim, samples=max(1, len(split.train)))
    arch_name = group.arch or (group.archs[k % len(group.archs)] if group.archs else p.arch)
    # GeFL CNNs carry their embedding in the name (cnn3 = published sizes, cnn3-p64 = shared p).
    spec = arch_by_name(arch_name, embed_dim=cfg.run.embed_dim if arch_name.startswith("tier-") else None)
    model = build_model(spec, seed=cfg.run.seed * 1000 + idx, num_classes=data.train.num_classes)
    tc = TrainConfig(
        lr=cfg.train.lr,
        batch_size=cfg.train.batch_size or p.batch_size,
        local_epochs=cfg.train.local_epochs or p.local_epochs,
        momentum=cfg.train.momentum,
        weight_decay=cfg.train.weight_decay,
    )
    ctx = DeviceContext(
        device_id=dev_id,
        model=model,
        train=data.train.subset(split.train),
        local_test=data.train.subset(split.test),
        train_cfg=tc,
        upload_precision=p.upload_precision,
        seed=cfg.run.seed * 1000 + idx,
        method_config=cfg.method_config,
        global_test=data.test,
        profile=profile.name,
        plan=p.to_dict(),
    )
    info = DeviceInfo(
        device_id=dev_id,
        arch=model.spec.name,
        profile=profile.name,
        upload_precision=p.upload_precision,
        num_samples=len(split.train),
        feature_dim=model.spec.feature_dim,
        # The coordinator sizes generator uploads from the device's planned generator tier.
        extra={"params": model.spec.num_params(), "generator_tier": p.generator_tier},
    )
    return SimDevice(info, entry.build_device(ctx), p.to_dict())


def _check_feature_dims(cfg: FleetConfig, devices: list[SimDevice]) -> None:
    if method_entry(cfg.run.method).shares_features:
        dims = {d.info.feature_dim for d in devices}
        if len(dims) > 1:
            raise ConfigError(
                f"{cfg.source}: method {cfg.run.method} shares features, but the devices' feature sizes "
                f"differ ({sorted(dims)})",
                hint="use architectures with a common embedding, e.g. cnn3-p64 instead of cnn3",
            )


def class_histograms(cfg: FleetConfig, data: FleetData) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(device id, train histogram, local-test histogram) per device."""
    c = data.train.num_classes
    return [
        (dev_id, np.bincount(data.train.y[s.train], minlength=c), np.bincount(data.train.y[s.test], minlength=c))
        for (dev_id, _), s in zip(device_ids(cfg), data.splits, strict=True)
    ]
