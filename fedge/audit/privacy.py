"""``fedge audit privacy RUN_DIR``: how much each generator a run trained memorized its devices' images.

For every device that used a generator (GeFL's image generator, GeFL-F's feature
generator, FedVTC's decoder ψ_k) the audit draws synthetic images and measures
the MND ratio (:mod:`fedge.audit.mnd`) against that device's training images,
in two spaces: pixels ([0, 1], 1×32×32) and the embedding of a fixed network
(:func:`fedge.audit.networks.train_feature_net`) trained on images no device
trained on.

The split, per device (the GeFL article's, where the data allows): up to
``n_train`` (1,000) of the device's training images; up to ``n_val`` (600)
held-out images of the device's classes from one half of the data set's test
split (the feature network is trained on the other half); as many synthetic
samples as held-out ones, with the same labels, so both sets have the same class
mix. Feature-level generators (GeFL-F) are judged in image space through a
:class:`~fedge.audit.networks.FeatureInverter` trained on the device's own
training images through its own (saved) extractor.

A run directory holds what this needs when it was made with ``fedge simulate
CONFIG --out RUN --samples``: ``results.json`` (the config, method and seed:
the device shares are recomputed from them), ``checkpoints/<device>.safetensors``,
and ``checkpoints/generators/`` (each generator, ``index.json`` naming the one
each device used, and FedVTC's latent distribution).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import torch

from fedge.audit.findings import GeneratorAudit
from fedge.audit.mnd import mnd
from fedge.audit.networks import embed, invert, stem_features, train_feature_net, train_inverter
from fedge.audit.report import save_closest
from fedge.edge.data.datasets import Dataset
from fedge.edge.generators.modules import ConditionalGenerator, load_generator
from fedge.edge.models.checkpoint import load_checkpoint
from fedge.edge.models.zoo import FedgeNet
from fedge.errors import ConfigError, DataError
from fedge.fleet.config import FleetConfig, device_ids, load_fleet
from fedge.fleet.devices import load_fleet_data

log = logging.getLogger(__name__)

CLOSEST = 8  # synthetic samples shown in each figure


@dataclass(frozen=True)
class AuditSizes:
    """How many images each set holds at most (the GeFL article's split by default)."""

    n_train: int = 1000
    n_val: int = 600
    seed: int = 0


@dataclass
class Split:
    """One device's training images and the held-out images of its classes, in [0, 1] and normalized."""

    train01: np.ndarray
    train_y: np.ndarray
    val01: np.ndarray
    val_y: np.ndarray
    mean: float
    std: float

    def norm(self, x01: np.ndarray) -> np.ndarray:
        return ((x01 - self.mean) / self.std).astype(np.float32)


def to01(x: np.ndarray, mean: float, std: float) -> np.ndarray:
    return np.clip(x * std + mean, 0.0, 1.0).astype(np.float32)


def audit_samples(name: str, device: str, synthetic01: np.ndarray, split: Split, feature_net: FedgeNet, *,
                  kind: str = "", level: str = "image", roundtrip01: np.ndarray | None = None) -> GeneratorAudit:
    """MND of ``synthetic01`` (N, 1, 32, 32) in [0, 1] against ``split``, in pixels and in features;
    ``roundtrip01``: the held-out images after the same inversion the synthetic ones went through (measured too)."""
    pix, dists, nn = mnd(synthetic01, split.val01, split.train01)
    val_f, train_f = embed(feature_net, split.norm(split.val01)), embed(feature_net, split.norm(split.train01))
    feat, _, _ = mnd(embed(feature_net, split.norm(synthetic01)), val_f, train_f)
    order = np.argsort(dists)[:CLOSEST]
    a = GeneratorAudit(device, name, kind, level, len(split.train01), len(split.val01), len(synthetic01), pix,
                       feat, [(int(i), int(nn[i]), float(dists[i])) for i in order])
    if roundtrip01 is not None:
        a.roundtrip_pixel = mnd(roundtrip01, split.val01, split.train01)[0]
        a.roundtrip_features = mnd(embed(feature_net, split.norm(roundtrip01)), val_f, train_f)[0]
    return a


# -- a run directory --------------------------------------------------------------------------------------

def _run_config(run: Path, results: dict[str, Any], config: str | None, data_dir: str | None) -> FleetConfig:
    src = config or results.get("config")
    candidates = [Path(src)] if src else []
    if src and not Path(src).is_absolute():
        candidates.append(run / src)
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ConfigError(f"{run}/results.json names config {src!r}, which is not found from here",
                          hint="pass the fleet config the run used: fedge audit privacy RUN --config CONFIG.toml")
    cfg = load_fleet(path)
    changes = {"method": results.get("method", cfg.run.method), "seed": results.get("seed", cfg.run.seed),
               "rounds": results.get("rounds", cfg.run.rounds)}
    if data_dir is not None:
        changes["data_dir"] = str(Path(data_dir).resolve())
    elif results.get("data_dir"):
        changes["data_dir"] = results["data_dir"]
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **changes))
    if cfg.own_data:
        raise ConfigError(f"{path}: the audit recomputes device shares of a benchmark data set; this fleet trains "
                          "on its devices' own folders", hint="audit a run of `fedge simulate` on a benchmark set")
    return cfg


def split_test(test: Dataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the test split's two halves: (feature network's, held-out pool)."""
    perm = np.random.default_rng(seed + 7).permutation(len(test))
    half = len(test) // 2
    return np.sort(perm[:half]), np.sort(perm[half:])


def device_split(train: Dataset, test: Dataset, pool: np.ndarray, sizes: AuditSizes, rng: np.random.Generator) -> Split:
    """Up to ``n_train`` of the device's images and up to ``n_val`` held-out images of its classes."""
    mean, std = train.norm.mean, train.norm.std
    ti = rng.permutation(len(train))[: sizes.n_train]
    classes = np.unique(train.y)
    cand = pool[np.isin(test.y[pool], classes)]
    vi = rng.permutation(cand)[: sizes.n_val]
    if len(ti) < 2 or len(vi) < 2:
        raise DataError(f"too few images to audit: {len(ti)} training, {len(vi)} held-out")
    return Split(to01(train.x[ti], mean, std), train.y[ti], to01(test.x[vi], mean, std), test.y[vi], mean, std)


def sample_generator(gen: ConditionalGenerator, labels: np.ndarray, *, seed: int, split: Split,
                     model: FedgeNet | None, latents: dict[str, np.ndarray] | None, full_train01: np.ndarray,
                     full_train_norm: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Synthetic images in [0, 1] with ``labels``: decoded (FedVTC), sampled (GeFL) or sampled and inverted
    (GeFL-F, through an inverter trained on the device's own images and extractor). Second: for GeFL-F, the
    held-out images of ``split`` through the extractor and the same inverter (None otherwise)."""
    g = torch.Generator().manual_seed(seed)
    lab = torch.from_numpy(labels.astype(np.int64))
    gen.eval()
    with torch.no_grad():
        if gen.spec.kind == "vtc":
            assert latents is not None
            protos = torch.from_numpy(latents["protos"])
            sigma = torch.from_numpy(latents["sigma"])
            v = protos[lab] + sigma * torch.randn((len(lab), protos.shape[1]), generator=g)
            return gen(v).numpy(), None
        out = torch.cat([gen.sample(lab[i : i + 256], g) for i in range(0, len(lab), 256)]).numpy()
    if gen.spec.out_shape == (1, 32, 32):
        return out, None
    assert model is not None
    inv = train_inverter(stem_features(model, full_train_norm), full_train01, seed=seed)
    return invert(inv, out), invert(inv, stem_features(model, split.norm(split.val01)))


def audit_run(run_dir: str | Path, *, config: str | None = None, data_dir: str | None = None,
              sizes: AuditSizes = AuditSizes(), out_dir: str | Path | None = None) -> dict[str, Any]:
    """Audit every generator of a run directory; writes ``privacy.json`` and one figure per device and generator
    into ``out_dir`` (default ``RUN_DIR/audit``) and returns the report."""
    run = Path(run_dir)
    res_path = run / "results.json"
    if not res_path.is_file():
        raise DataError(f"{run} holds no results.json", hint="pass the --out directory of a `fedge simulate` run")
    try:
        results = json.loads(res_path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{res_path} is not JSON: {exc}") from exc
    gen_dir = run / "checkpoints" / "generators"
    index_path = gen_dir / "index.json"
    if not index_path.is_file():
        raise DataError(f"{run} holds no generator checkpoints ({index_path} is missing)",
                        hint="only gefl, geflf and fedvtc train generators; run `fedge simulate CONFIG --out RUN "
                             "--samples` to save them")
    index: dict[str, str] = json.loads(index_path.read_text())
    cfg = _run_config(run, results, config, data_dir)
    data = load_fleet_data(cfg)
    ids = [i for i, _ in device_ids(cfg)]
    unknown = sorted(set(index) - set(ids))
    if unknown:
        raise DataError(f"{index_path} names devices {unknown} that the fleet config does not have",
                        hint="pass the config the run used with --config")
    feat_idx, pool = split_test(data.test, sizes.seed)
    log.info("training the audit's feature network on %d held-out test images", len(feat_idx))
    feature_net, feat_acc = train_feature_net(data.test.x[feat_idx], data.test.y[feat_idx], cfg.num_classes,
                                              seed=sizes.seed)
    out = Path(out_dir) if out_dir is not None else run / "audit"
    audits: list[GeneratorAudit] = []
    gens: dict[str, ConditionalGenerator] = {}
    for di, dev in enumerate(ids):
        if dev not in index:
            continue
        key = index[dev]
        if key not in gens:
            gens[key] = load_generator(gen_dir / f"{key}.safetensors")
        gen = gens[key]
        train = data.train.subset(data.splits[di].train)
        rng = np.random.default_rng(sizes.seed * 1000 + di)
        split = device_split(train, data.test, pool, sizes, rng)
        latents = None
        if gen.spec.kind == "vtc":
            latents = safetensors.numpy.load_file(str(gen_dir / f"{key}.latents.safetensors"))
        model = None
        level = "image" if gen.spec.out_shape == (1, 32, 32) else "feature"
        if level == "feature":
            model = load_checkpoint(run / "checkpoints" / f"{dev}.safetensors", expect=FedgeNet)
        syn, roundtrip = sample_generator(gen, split.val_y, seed=sizes.seed + di, split=split, model=model,
                                          latents=latents, full_train01=to01(train.x, split.mean, split.std),
                                          full_train_norm=train.x)
        a = audit_samples(key, dev, syn, split, feature_net, kind=gen.spec.kind, level=level, roundtrip01=roundtrip)
        a.figure = str(save_closest(out / f"closest-{key}-{dev}.png", syn, split.train01, a))
        log.info("%s / %s: MND ratio pixels %.3f, features %.3f", dev, key, a.pixel.ratio, a.features.ratio)
        audits.append(a)
    report = {
        "run": str(run), "method": cfg.run.method, "dataset": cfg.run.dataset,
        "split": {"n_train_max": sizes.n_train, "n_val_max": sizes.n_val,
                  "synthetic": "as many as held-out, same labels",
                  "held_out": f"half of the {cfg.run.dataset} test split ({len(pool)} images), the device's classes",
                  "seed": sizes.seed},
        "feature_network": {"arch": "cnn5", "trained_on": f"the other half of the test split ({len(feat_idx)} "
                                                          "images), disjoint from every device's training share",
                            "train_accuracy": feat_acc},
        "audits": [a.to_dict() for a in audits],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "privacy.json").write_text(json.dumps(report, indent=1))
    return report
