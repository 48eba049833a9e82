"""Export for devices: one checkpoint for one profile, or every device of a finished run.

``export_checkpoint`` exports the architecture the checkpoint records (checked
against ``arch`` when given), quantized as decided for that model (see
:mod:`fedge.export.decide`).
``export_run`` reads ``RESULTS_DIR/results.json`` and
``RESULTS_DIR/checkpoints/<device id>.safetensors`` (the layout of
:mod:`fedge.sim`) and exports every device, all or nothing, calibrating each
on its own share of the data when the run's fleet config can rebuild it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.edge.data.datasets import Dataset, load_dataset
from fedge.edge.models.checkpoint import load_checkpoint, read_checkpoint_meta
from fedge.edge.models.split import SplitNet
from fedge.errors import ConfigError, ExportError, FedgeError, ProfileError
from fedge.export.decide import request_quant
from fedge.export.exporter import ExportOptions, export_into, staged_output
from fedge.export.quantize import CalibrationSource
from fedge.runtime.manifest import Manifest, write_manifest

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"


@dataclass(frozen=True)
class Target:
    """What a profile's plan asks of an export."""

    profile: str
    quant: str
    arch: str | None
    plan: dict[str, Any] | None


def resolve_profile(ref: str) -> Target:
    """Load a profile (built-in name or TOML path) and plan it: quantization and architecture."""
    try:
        from fedge.profiles import load_profile, plan
    except ImportError as exc:  # pragma: no cover - the profiles package ships with fedge
        raise ProfileError(f"cannot resolve profile {ref!r}: fedge.profiles is not available ({exc})") from exc
    try:
        prof = load_profile(ref)
        p = plan(prof)
    except FedgeError as exc:
        if ref in exc.message:
            raise
        raise ProfileError(f"profile {ref!r}: {exc.message}", hint=exc.hint) from exc
    d = p.to_dict() if hasattr(p, "to_dict") else dict(vars(p))
    return Target(str(getattr(prof, "name", ref)), str(p.inference_quant), getattr(p, "arch", None), d)


def load_net(checkpoint: str | os.PathLike[str]) -> tuple[SplitNet, dict[str, str]]:
    """A fedge network (:class:`FedgeNet` or a family's :class:`FamilyNet`) and the checkpoint's metadata;
    anything else is an :class:`ExportError`."""
    meta = read_checkpoint_meta(checkpoint)
    # Decided from the metadata before anything is built: a generator's builder is not
    # registered here, and "unknown builder 'CVAE'" would not say what went wrong.
    builder = meta.get("fedge.builder")
    if builder is None:
        raise ExportError(f"{checkpoint} records no fedge.builder: not a checkpoint written by fedge",
                          hint="export a device model checkpoint (RUN/checkpoints/<device id>.safetensors)")
    if builder not in ("FedgeNet", "FamilyNet"):
        from fedge.edge.generators.modules import GENERATOR_BUILDERS

        if builder in GENERATOR_BUILDERS:
            raise ExportError(
                f"{checkpoint} is a generator checkpoint ({builder}), not a classifier: fedge export exports "
                "a device's classifier (FedgeNet)",
                hint="pass the device's model checkpoint, RUN/checkpoints/<device id>.safetensors (generators "
                     "are saved under RUN/checkpoints/generators/ and stay in PyTorch)",
            )
        raise ExportError(f"{checkpoint} holds a {builder}, not a classifier (FedgeNet)",
                          hint="export a device model checkpoint (RUN/checkpoints/<device id>.safetensors)")
    net = load_checkpoint(checkpoint)
    if not isinstance(net, SplitNet):
        raise ExportError(f"{checkpoint} holds a {type(net).__name__}, not a classifier (FedgeNet)",
                          hint="export a device model checkpoint, not a generator's")
    return net, meta


def input_of(net: SplitNet) -> dict[str, int]:
    """``load_dataset``'s image size and channels for ``net``'s input (what it was trained on)."""
    shape = tuple(net.spec.input_shape)
    if len(shape) == 2:  # a 1-D data set keeps its own shape (load_dataset ignores these)
        return {"channels": int(shape[0]), "image_size": int(shape[1])}
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ExportError(f"{net.spec.name} takes {'x'.join(map(str, shape))} inputs, not square images: the "
                          "benchmark data sets cannot test it", hint="export it with your own test data (export_into)")
    return {"channels": int(shape[0]), "image_size": int(shape[1])}


def check_arch(net: SplitNet, expected: str | None, *, source: str, why: str) -> None:
    """The checkpoint must hold the architecture the device is meant to run."""
    if expected is not None and net.spec.name != expected:
        raise ExportError(
            f"{source} holds architecture {net.spec.name!r}, but {why} {expected!r}",
            hint=f"export the checkpoint trained for it, or pass --arch {net.spec.name} "
                 "if the fleet assigned this device that architecture",
        )


def checkpoint_origin(meta: dict[str, str]) -> dict[str, Any] | None:
    """Which round a run's checkpoint holds and how it scored (``manifest.json``'s ``checkpoint``), from the
    metadata :func:`fedge.sim.simulate.save_device_checkpoints` writes; None for a checkpoint without it."""
    from fedge.edge.best import BestRecord

    best, last = BestRecord.from_meta(meta), BestRecord.from_meta(meta, "fedge.last")
    kind = meta.get("fedge.checkpoint")
    if kind is None or (best is None and last is None):
        return None
    chosen = best if kind == "best" and best is not None else last
    assert chosen is not None
    return {"choice": kind, "round": chosen.round, "acc_val": chosen.acc_val, "acc_global": chosen.acc_global,
            "last": None if last is None else {"round": last.round, "acc_val": last.acc_val,
                                               "acc_global": last.acc_global}}


def _with_origin(out: Path, manifest: Manifest, meta: dict[str, str]) -> Manifest:
    """``manifest`` with the checkpoint's origin (round, accuracies), rewritten into ``out``."""
    origin = checkpoint_origin(meta)
    if origin is not None:
        manifest.extra["checkpoint"] = origin
        write_manifest(out, manifest)
    return manifest


def _subsample(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    if len(x) <= n:
        return x
    return x[np.sort(np.random.default_rng(seed).choice(len(x), n, replace=False))]


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    profile: str | None = None,
    dataset: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    calibration: CalibrationSource | None = None,
    quant: str | None = None,
    arch: str | None = None,
    test_samples: int | None = None,
    options: ExportOptions | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Export one checkpoint for one profile.

    ``profile`` and ``dataset`` default to what the checkpoint's metadata records
    (the simulator stores both). ``quant`` overrides the plan's quantization;
    ``arch``, when given, is the architecture the checkpoint must hold (by
    default the checkpoint's own architecture is exported, whatever the
    profile's standalone plan names). Without ``calibration``,
    int8-static calibrates on the data set's training split.
    """
    opt = options or ExportOptions()
    net, meta = load_net(checkpoint)
    profile = profile or meta.get("fedge.profile")
    if not profile:
        raise ConfigError(f"{checkpoint} does not record a profile", hint="pass --profile NAME")
    target = resolve_profile(profile)
    # The checkpoint is self-describing: its architecture is what gets exported. The
    # profile's plan names the tier it would give a standalone device; a fleet may
    # assign another (`archs`), so only an explicit --arch is a requirement.
    check_arch(net, arch, source=str(checkpoint), why="--arch asks for")
    if target.arch is not None and target.arch != net.spec.name:
        log.info("%s holds %s; profile %s plans %s for a standalone device: exporting %s", checkpoint,
                 net.spec.name, target.profile, target.arch, net.spec.name)
    request = request_quant(net.spec.name, override=quant, profile=profile, plan=target.plan)
    dataset = dataset or meta.get("fedge.dataset")
    if not dataset:
        raise ConfigError(f"{checkpoint} does not record its data set", hint="pass --dataset NAME (fmnist, digits, …)")
    test = load_dataset(dataset, train=False, data_dir=data_dir, **input_of(net))
    if test_samples is not None:
        test = test.subset(np.arange(min(test_samples, len(test))))
    label = "caller-supplied inputs"
    if calibration is None and request.quant == "int8-static":
        train = load_dataset(dataset, train=True, data_dir=data_dir, **input_of(net))
        calibration = _subsample(train.x, opt.calibration_samples, opt.seed)
        label = f"{dataset} training split ({len(train)} images, {len(calibration)} sampled)"
    with staged_output(out, overwrite=overwrite) as stage:
        m = export_into(net, stage, quant=request, test=test, calibration=calibration, calibration_label=label,
                        profile=target.profile, plan=target.plan, options=opt)
        return _with_origin(stage, m, meta)


# -- runs ------------------------------------------------------------------------------------
def read_results(results_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``results.json`` of a run, with a non-empty ``devices`` list of objects with an ``id``."""
    path = Path(results_dir) / "results.json"
    if not path.is_file():
        raise ExportError(f"{results_dir} has no results.json", hint="pass the --out directory of a finished run")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON: {exc}") from exc
    devices = results.get("devices") if isinstance(results, dict) else None
    if not isinstance(devices, list) or not devices:
        raise ExportError(f"{path} lists no devices", hint="the run must have finished and written its results")
    for i, d in enumerate(devices):
        if not isinstance(d, dict) or not d.get("id"):
            raise ExportError(f"{path}: devices[{i}] has no id")
    return results


class _DeviceData:
    """Each device's own training share, rebuilt from the run's fleet config when possible."""

    def __init__(self, results: dict[str, Any], data_dir: str | os.PathLike[str] | None) -> None:
        self._results = results
        self._data_dir = data_dir
        self._shares: dict[str, np.ndarray] | None = None
        self._why = ""

    def _rebuild(self) -> dict[str, np.ndarray]:
        config = self._results.get("config")
        if not config or not Path(str(config)).is_file():
            self._why = f"the run's fleet config {config!r} is not available"
            return {}
        try:
            from fedge.fleet.config import device_ids, load_fleet
            from fedge.fleet.slots import fleet_data_dir, fleet_splits

            cfg = load_fleet(str(config))
            train = load_dataset(cfg.run.dataset, train=True, data_dir=fleet_data_dir(cfg), seed=cfg.run.seed,
                                 image_size=cfg.input_shape[-1], channels=cfg.input_shape[0])
            return {dev: train.x[split.train]
                    for (dev, _), split in zip(device_ids(cfg), fleet_splits(cfg, train.y), strict=True)}
        except (FedgeError, ImportError, OSError, AttributeError, TypeError, ValueError) as exc:
            self._why = f"rebuilding the fleet's partition failed ({exc})"
            return {}

    def share(self, device_id: str) -> np.ndarray | None:
        if self._shares is None:
            self._shares = self._rebuild()
        share = self._shares.get(device_id)
        if share is None:
            log.warning("%s: calibrating on the data set's training split: %s", device_id,
                        self._why or "the device is not in the fleet config")
        return share


def _checkpoint_of(root: Path, dev_id: str, *, last: bool) -> Path:
    """The checkpoint a device ships: ``checkpoints/<device>.safetensors`` (its best), or ``.last`` with ``last``."""
    if Path(dev_id).name != dev_id or dev_id in (".", ".."):
        raise ExportError(f"results.json: device id {dev_id!r} is not a plain name")
    ckpt = root / "checkpoints" / f"{dev_id}{'.last' if last else ''}.safetensors"
    if not ckpt.is_file():
        raise ExportError(f"device {dev_id}: no checkpoint {ckpt}",
                          hint="the run must have been started with an output directory"
                               + (" (runs before issue 45 kept only one: export without --last)" if last else ""))
    return ckpt


def _plan_of(dev: dict[str, Any], meta: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """(profile, plan) a device's quantization is decided from: the plan results.json records, else its
    profile planned again."""
    plan = dev.get("plan") if isinstance(dev.get("plan"), dict) else None
    profile = str(dev.get("profile") or meta.get("fedge.profile") or "")
    if plan is None or "inference_quant" not in plan:
        if not profile:
            raise ExportError(f"device {dev['id']}: results.json records neither a plan nor a profile")
        plan = resolve_profile(profile).plan or {}
    return profile, plan


def export_run(
    results_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    data_dir: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    quant: str | None = None,
    test_samples: int | None = None,
    options: ExportOptions | None = None,
    overwrite: bool = False,
    last: bool = False,
) -> dict[str, Manifest]:
    """Export every device of a finished run into ``out/<device id>/``, all or nothing.

    Each device ships its best checkpoint, the round that scored best on its validation fold
    (``checkpoints/<device>.safetensors``, :mod:`fedge.edge.best`); ``last`` ships the last round's
    (``<device>.last.safetensors``). The manifest's ``checkpoint`` names the round and its accuracies.

    Each device's quantization is decided for its own model (see
    :mod:`fedge.export.decide`) from its profile's measured table or the plan
    recorded in results.json (or, failing that, planning its profile again);
    ``quant`` overrides it.
    ``out/index.json`` lists the devices and their manifests' key figures.
    """
    opt = options or ExportOptions()
    root = Path(results_dir)
    results = read_results(root)
    dataset = dataset or results.get("dataset")
    if not dataset:
        raise ConfigError(f"{root / 'results.json'} does not name its data set", hint="pass --dataset NAME")
    tests: dict[tuple[int, ...], Dataset] = {}  # one per input shape (a fleet's family has one)

    def test_for(net: SplitNet) -> Dataset:
        shape = tuple(net.spec.input_shape)
        if shape not in tests:
            t = load_dataset(str(dataset), train=False, data_dir=data_dir, **input_of(net))
            tests[shape] = t if test_samples is None else t.subset(np.arange(min(test_samples, len(t))))
        return tests[shape]

    shares = _DeviceData(results, data_dir)
    train: list[Dataset] = []  # the data set's training split, loaded once if a device's share is missing

    def calibration_for(net: SplitNet, dev_id: str) -> tuple[np.ndarray, str]:
        share = shares.share(dev_id)
        if share is not None:
            return share, f"device {dev_id}'s own training share ({len(share)} images)"
        if not train:
            train.append(load_dataset(str(dataset), train=True, data_dir=data_dir, **input_of(net)))
        return train[0].x, f"{dataset} training split (the device's own share was not available)"

    manifests: dict[str, Manifest] = {}
    with staged_output(out, overwrite=overwrite) as stage:
        for dev in results["devices"]:
            dev_id = str(dev["id"])
            ckpt = _checkpoint_of(root, dev_id, last=last)
            net, meta = load_net(ckpt)
            check_arch(net, dev.get("arch"), source=str(ckpt), why=f"results.json says device {dev_id} runs")
            profile, plan = _plan_of(dev, meta)
            request = request_quant(net.spec.name, override=quant, profile=profile or None, plan=plan)
            calibration, label = calibration_for(net, dev_id) if request.quant == "int8-static" else (None, "")
            (stage / dev_id).mkdir()
            try:
                manifests[dev_id] = _with_origin(stage / dev_id, export_into(
                    net, stage / dev_id, quant=request, test=test_for(net), calibration=calibration,
                    calibration_label=label, profile=profile or None, plan=plan, options=opt), meta)
            except FedgeError as exc:
                raise type(exc)(f"device {dev_id}: {exc.message}", hint=exc.hint) from exc
        index = {
            "run": str(root),
            "dataset": dataset,
            "devices": [
                {"id": k, "dir": k, "arch": m.arch, "quant": m.quant, "profile": m.profile,
                 "accuracy": m.metrics.get("accuracy"), "latency_ms": m.metrics.get("latency_ms"),
                 "checkpoint": m.extra.get("checkpoint")}
                for k, m in manifests.items()
            ],
        }
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return manifests
