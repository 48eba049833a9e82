"""What each device of a fleet is, computed from the fleet config alone — without torch.

A :class:`DeviceSlot` is the device a fleet config describes at one position:
its id, profile and plan, its model architecture and embedding size, its upload
precision and its share of the data. The coordinator checks a device's hello
against its slot; :mod:`fedge.fleet.devices` builds the device (model, method
half) from the same slot, so the two can never disagree.

Only the training labels are loaded (to partition them as every device does);
IDX data sets read just their label file. Imports: common, profiles and the
numpy-only :mod:`fedge.edge.data` — never torch, never the rest of fedge.edge.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fedge.common.archs import arch_by_name
from fedge.common.catalog import CLASS_NAMES
from fedge.common.families import GEFL_FAMILY, FamilyArch, ModelSpec, family_arch, family_tiers
from fedge.common.generators import generatable
from fedge.common.rounds import DeviceInfo
from fedge.edge.data.datasets import load_groups, load_labels
from fedge.edge.data.partition import (
    DeviceSplit,
    by_group,
    dirichlet,
    iid_fraction,
    local_splits,
    shards,
    validation_folds,
)
from fedge.errors import ConfigError
from fedge.fleet.config import FleetConfig, device_ids
from fedge.profiles import Plan, Profile, RunBudget, load_profile, plan


@dataclass(frozen=True)
class DeviceSlot:
    """One device of a fleet as its config describes it (what its hello must announce)."""

    device_id: str
    index: int  # position in fleet order (seeds are derived from it)
    group: int  # index of its [[devices]] table
    profile: str  # the profile's name
    plan: Plan
    spec: ModelSpec  # its model, sized for the fleet's classes (and input, for a family other than the GeFL CNNs)
    upload_precision: str
    generator_tier: str
    num_samples: int  # local training samples
    classes: tuple[int, ...]  # labels present in its training share, ascending
    num_test: int = 0  # its local test split's samples (what it evaluates besides the fleet's test set)

    @property
    def arch(self) -> str:
        """Model architecture name, e.g. ``tier-s`` or ``cnn3-p64``."""
        return self.spec.name

    @property
    def feature_dim(self) -> int:
        """Embedding size p."""
        return self.spec.feature_dim

    @property
    def params(self) -> int:
        """Trainable parameters of its model."""
        return self.spec.num_params()

    def info(self) -> DeviceInfo:
        """The registry record the device announces in its hello."""
        return DeviceInfo(
            device_id=self.device_id,
            arch=self.arch,
            profile=self.profile,
            upload_precision=self.upload_precision,
            num_samples=self.num_samples,
            feature_dim=self.feature_dim,
            # The coordinator sizes generator uploads from the device's planned generator tier.
            extra={"params": self.params, "generator_tier": self.generator_tier},
        )

    def mismatches(self, info: DeviceInfo) -> list[str]:
        """How a hello differs from this slot, one ``"field: expected X, got Y"`` per field (empty: it matches)."""
        expected = self.info()
        return [
            f"{name}: expected {getattr(expected, name)!r}, got {getattr(info, name)!r}"
            for name in ("device_id", "arch", "profile", "upload_precision", "num_samples", "feature_dim")
            if getattr(expected, name) != getattr(info, name)
        ]


def fleet_classes(cfg: FleetConfig) -> tuple[str, ...]:
    """Class names of the fleet's models, in label order: ``[data] classes`` when devices train on their own
    data, else the benchmark data set's."""
    return cfg.data.classes if cfg.own_data else CLASS_NAMES[cfg.run.dataset]


def fleet_data_dir(cfg: FleetConfig) -> str | None:
    """``[run] data_dir`` resolved against the config's directory (None: the data set's default place)."""
    return str(cfg.base_dir / cfg.run.data_dir) if cfg.run.data_dir else None


def fleet_splits(cfg: FleetConfig, labels: np.ndarray) -> list[DeviceSplit]:
    """Each device's local train/test indices into the training set, deterministically by seed."""
    run, part = cfg.run, cfg.partition
    n = cfg.num_devices
    if part.kind == "iid":
        parts = iid_fraction(labels, n, part.fraction, run.seed)
    elif part.kind == "dirichlet":
        parts = dirichlet(labels, n, part.alpha, run.seed, min_size=part.min_size, fraction=part.fraction)
    elif part.kind == "group":  # every speaker / subject on one device
        groups = load_groups(run.dataset, train=True, data_dir=fleet_data_dir(cfg), seed=run.seed)
        if len(groups) != len(labels):
            raise ConfigError(f"{cfg.source}: {len(groups)} speakers/subjects for {len(labels)} labels",
                              hint="partition the training set the fleet config names")
        parts = by_group(groups, n, run.seed)
    else:
        parts = shards(labels, n, part.shards_per_device, run.seed, fraction=part.fraction)
    return validation_folds(local_splits(parts, part.local_test_fraction, run.seed), cfg.train.val_fraction, run.seed)


def train_labels(cfg: FleetConfig) -> np.ndarray:
    """The fleet's training labels (the images are not loaded)."""
    return load_labels(cfg.run.dataset, train=True, data_dir=fleet_data_dir(cfg), seed=cfg.run.seed)


def test_labels(cfg: FleetConfig) -> np.ndarray:
    """The labels of the fleet's test set (what every device evaluates on besides its local split)."""
    return load_labels(cfg.run.dataset, train=False, data_dir=fleet_data_dir(cfg), seed=cfg.run.seed)


def device_profile(cfg: FleetConfig, group: int) -> Profile:
    """The profile of a [[devices]] table (a relative .toml path is relative to the config)."""
    ref = cfg.devices[group].profile
    if ref.endswith(".toml") and not ref.startswith("/"):
        ref = str(cfg.base_dir / ref)
    return load_profile(ref)


def family_spec(cfg: FleetConfig, tier: str) -> FamilyArch:
    """The network of ``[model] family`` at ``tier`` for the fleet's input, classes and embedding (measured)."""
    channels, *size = cfg.input_shape
    return family_arch(cfg.family, tier, in_channels=channels, input_size=tuple(size),
                       num_classes=len(fleet_classes(cfg)), embed_dim=cfg.run.embed_dim)


def family_specs(cfg: FleetConfig) -> dict[str, ModelSpec] | None:
    """Tier -> network of the fleet's family, what the planner chooses among (None: the GeFL CNN tiers)."""
    if cfg.model.family == GEFL_FAMILY:
        return None
    specs: dict[str, ModelSpec] = {t: family_spec(cfg, t) for t in family_tiers(cfg.family)}
    check_family_fits_method(cfg, specs)
    return specs


def check_family_fits_method(cfg: FleetConfig, specs: dict[str, ModelSpec]) -> None:
    """Refuse at load a family the method cannot run on, naming why (docs/models.md, "What each method needs")."""
    method = cfg.method_config
    level = getattr(method, "level", None)
    if level == "image" or cfg.run.method == "fedvtc":
        for spec in specs.values():
            spec.image_size  # noqa: B018  (raises, naming the fix, for an input that is not a square image)
    shares_stem = cfg.run.method in ("lgfedavg", "geflf") or level == "feature"
    stems = {t: s.stem_shape for t, s in specs.items()}
    if level == "feature" and not all(generatable(s) for s in stems.values()):
        raise ConfigError(f"{cfg.source}: method {cfg.run.method}'s feature generator imitates a (C, H, W) stem "
                          f"output with H = W a power of two >= 8, but family {cfg.model.family!r}'s stem gives "
                          f"{stems}", hint=f"use fedavg, lgfedavg or fedproto with family {cfg.model.family!r}")
    if shares_stem and len(set(stems.values())) > 1:
        raise ConfigError(f"{cfg.source}: method {cfg.run.method} shares the stem (extractor) across the fleet, but "
                          f"family {cfg.model.family!r}'s stem output differs across tiers: {stems}",
                          hint="make the extractor identical at every tier (widen or deepen only body), or use a "
                               "method that shares no stem (fedavg, fedproto)")


def run_budget(cfg: FleetConfig) -> RunBudget:
    """What the planner weighs each device's model tier against: the run's rounds, ``[run] time_budget_s``,
    ``[coordinator] mode`` and data set (a fleet on its own data has no accuracy curves)."""
    return RunBudget(rounds=cfg.run.rounds, time_budget_s=cfg.run.time_budget_s or None,
                     asynchronous=cfg.asynchronous is not None, task=None if cfg.own_data else cfg.run.dataset)


def pinned_tier(arch_name: str | None, family: dict[str, ModelSpec] | None) -> str | None:
    """The tier a ``[[devices]]`` ``arch`` / ``archs`` entry pins: a GeFL ``tier-*``, or a tier (or network
    name) of ``[model] family`` (``family``: its tiers). None: not pinned, or not a tier (``cnn3``)."""
    if arch_name is None:
        return None
    if family is None:
        return arch_name if arch_name.startswith("tier-") else None
    return arch_name if arch_name in family or any(s.name == arch_name for s in family.values()) else None


def device_arch_spec(cfg: FleetConfig, arch_name: str) -> ModelSpec:
    """The architecture ``arch_name`` as a device of ``cfg`` builds it (the fleet's embedding and classes).

    With a ``[model] family`` other than the GeFL CNNs, ``arch_name`` is a tier of it (``"s"``) or the
    name the plan gave (``"mobilenet-s-96"``)."""
    if cfg.model.family != GEFL_FAMILY:
        tiers = family_tiers(cfg.family)
        tier = arch_name if arch_name in tiers else next(
            (t for t in tiers if family_spec(cfg, t).name == arch_name), None)
        if tier is None:
            raise ConfigError(f"{cfg.source}: arch {arch_name!r} is not a tier of [model] family "
                              f"{cfg.model.family!r}", hint=f"use one of {', '.join(tiers)}")
        return family_spec(cfg, tier)
    # GeFL CNNs carry their embedding in the name (cnn3 = published sizes, cnn3-p64 = shared p).
    spec = arch_by_name(arch_name, embed_dim=cfg.run.embed_dim if arch_name.startswith("tier-") else None)
    return dataclasses.replace(spec, num_classes=len(fleet_classes(cfg)))


class SlotParts:
    """What every slot of one fleet config shares, computed once for a caller that builds many slots.

    Per device, :func:`device_ids` is O(fleet), a profile is a file read, and a plan (``plan``: its tier search,
    ~3 ms) and an architecture spec depend only on the group, the sample count and the arch name: built afresh
    for each of 20,000 devices they took minutes (a relay or coordinator of a large fleet starts by building every
    slot). Plans and specs are frozen dataclasses, so sharing them is safe.
    """

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.ids = device_ids(cfg)
        # first fleet index of each group (groups are contiguous in fleet order)
        self.starts = list(itertools.accumulate((g.count for g in cfg.devices[:-1]), initial=0))
        self.profiles = [device_profile(cfg, gi) for gi in range(len(cfg.devices))]
        self._plans: dict[tuple[int, int, str | None], Plan] = {}
        self._specs: dict[str, ModelSpec] = {}
        self.family = family_specs(cfg)
        self.run = run_budget(cfg)

    def plan(self, group: int, samples: int, pin: str | None = None) -> Plan:
        key = (group, samples, pin)
        if key not in self._plans:
            self._plans[key] = plan(self.profiles[group], embed_dim=self.cfg.run.embed_dim, samples=samples,
                                    specs=self.family, run=self.run, pin=pin)
        return self._plans[key]

    def spec(self, arch_name: str) -> ModelSpec:
        if arch_name not in self._specs:
            self._specs[arch_name] = device_arch_spec(self.cfg, arch_name)
        return self._specs[arch_name]


def device_slot(cfg: FleetConfig, index: int, labels: np.ndarray, split: DeviceSplit, *,
                parts: SlotParts | None = None) -> DeviceSlot:
    """The slot of device number ``index`` (fleet order), whose share of ``labels`` is ``split``
    (``parts``: the fleet's shared parts, when the caller builds many slots)."""
    parts = SlotParts(cfg) if parts is None else parts
    dev_id, gi = parts.ids[index]
    group = cfg.devices[gi]
    k = index - parts.starts[gi]  # position within its group
    profile = parts.profiles[gi]
    pinned = group.arch or (group.archs[k % len(group.archs)] if group.archs else None)
    p = parts.plan(gi, max(1, len(split.train)), pinned_tier(pinned, parts.family))
    if group.upload_precision is not None:
        p = dataclasses.replace(p, upload_precision=group.upload_precision,
                                reasons={**p.reasons, "upload_precision": "set by the fleet config's [[devices]]"})
    arch_name = pinned or p.arch
    spec = parts.spec(arch_name)
    return DeviceSlot(
        device_id=dev_id,
        index=index,
        group=gi,
        profile=profile.name,
        plan=p,
        spec=spec,
        upload_precision=p.upload_precision,
        generator_tier=p.generator_tier,
        num_samples=len(split.train),
        classes=tuple(int(c) for c in np.unique(labels[split.train])),
        num_test=len(split.test),
    )


def device_slots(cfg: FleetConfig, labels: np.ndarray | None = None) -> list[DeviceSlot]:
    """Every device's slot, in fleet order (``labels``: the training labels, loaded when not given)."""
    labels = train_labels(cfg) if labels is None else labels
    splits = fleet_splits(cfg, labels)
    parts = SlotParts(cfg)
    return [device_slot(cfg, i, labels, s, parts=parts) for i, s in enumerate(splits)]


def checked_slots(cfg: FleetConfig) -> list[DeviceSlot]:
    """The slots a coordinator checks hellos against, in fleet order.

    On benchmark data every field is known (:func:`device_slots`). A device on its own data
    chooses its model and upload precision from a sample count only it knows, so its slot is
    built from a one-sample stand-in share: only its id, profile and embedding size mean
    anything (the coordinator checks only those; see ``fedge.coordinator.config.OWN_DATA_FIELDS``).
    """
    if not cfg.own_data:
        return device_slots(cfg)
    one = DeviceSplit(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    parts, zero = SlotParts(cfg), np.zeros(1, dtype=np.int64)
    return [device_slot(cfg, i, zero, one, parts=parts) for i in range(cfg.num_devices)]


def check_feature_dims(cfg: FleetConfig, dims: Iterable[int], *, shares_features: bool) -> None:
    """A method that shares features (prototypes, statistics) needs one embedding size (``dims``: each
    device's) across the fleet."""
    distinct = set(dims)
    if shares_features and len(distinct) > 1:
        raise ConfigError(
            f"{cfg.source}: method {cfg.run.method} shares features, but the devices' feature sizes "
            f"differ ({sorted(distinct)})",
            hint="use architectures with a common embedding, e.g. cnn3-p64 instead of cnn3",
        )
