"""How much do GeFL's synthetic samples help a target network, and how should they be scheduled?

A cheap proxy of GeFL's target phase (minutes instead of hours), used to choose table 1's
generator budget in ``benchmarks.generative``. Under the GeFL protocol's IID split, a
federated generator averaged over the 10 devices approximates one trained on their pooled
data, so this script:

1. trains one conditional generator (CVAE or DCGAN, a given tier) for ``--gen-epochs`` on
   the pooled 6,000 training images of the protocol's 10 devices (IID 10 %, seed 0);
2. for three devices (CNN-1, CNN-5, CNN-8 on their own 600 images) runs 20 target rounds
   without federation (FedAvg within group is local training here) under each schedule:

   * ``local``: T_r = 5 real epochs per round, no synthetic data;
   * ``seq:R``: GeFL's published order, T_s = 1 epoch on R×600 fresh synthetic samples, then
     T_r = 5 real epochs; ``seq2:R`` with T_s = 2;
   * ``mix:R``: T_r = 5 epochs over the union of R×600 fresh synthetic and the real samples;
   * ``oracle:R``: ``seq:R`` with a perfect generator — the R×600 samples are drawn afresh from the
     pooled *real* 6,000 (in the generator's space), the ceiling any generator could reach;

3. reports each schedule's mean (over the three models) of the best accuracy on the first
   3,000 test images, evaluated every 4 rounds, plus a synthetic-only check: CNN-5 trained
   10 epochs on 6,000 generated images alone (and, for scale, on 6,000 draws from the pooled real ones).

    python -m benchmarks.synthetic_schedule --kind cvae --tier tiny --gen-epochs 40 \\
        --schedules local seq:1 seq:3 seq2:1 mix:1

``--level feature`` is the same proxy for GeFL-F: a stem (the 3×16×16 extractor every CNN-K
shares) is trained for 5 epochs on the pooled images and frozen, as GeFL-F's warm-up would leave
it; the generator (CVAE-F, DCGAN-F or DDPM-F) trains on its pooled features; each device then
trains only its head (``FedgeNet.from_stem``) on features. ``local`` there is GeFL-F without a
generator. DDPM samples with ``--ddpm-steps`` DDIM steps and guidance ``--ddpm-guidance``.

    python -m benchmarks.synthetic_schedule --level feature --kind ddpm --tier small \\
        --gen-epochs 40 --schedules local seq:1

``--federated R:E`` trains the generator as the fleet does instead of on the pool: each of the
10 devices trains E local epochs on its own 600 samples (or features) from the global weights,
the sample-weighted mean is the new global generator, R rounds — to tell how much of the pooled
generator's benefit survives federated averaging (table 1's budget is ``30:10``).

Results go to ``benchmarks/results/synthetic_schedule/<kind>-<tier>-e<epochs>-wd<wd>.json``
(``feature-`` prefixed at the feature level); a later run with the same generator settings adds
its schedules to that file (the generator is retrained identically from the same seeds).
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, text_table
from fedge.common.generators import GeneratorSpec
from fedge.coordinator.accumulators import WeightedMean
from fedge.edge.data.datasets import load_dataset
from fedge.edge.data.partition import iid_fraction
from fedge.edge.generators.modules import ConditionalDDPM, ConditionalGenerator, build_generator
from fedge.edge.generators.train import GeneratorTrainer, sample_dataset
from fedge.edge.methods.base import load_arrays, model_arrays
from fedge.edge.methods.geflf import stem_features
from fedge.edge.models.zoo import EXTRACTOR, FedgeNet, build_model
from fedge.edge.training import TrainConfig, accuracy, train_epochs

DEVICES = ((0, "cnn1"), (4, "cnn5"), (7, "cnn8"))  # (device index, architecture)


def parse_schedule(text: str) -> tuple[str, int, float]:
    """``local`` | ``seq:R`` | ``seqK:R`` | ``mix:R`` | ``oracle:R`` -> (mode, synthetic epochs, ratio)."""
    if text == "local":
        return "local", 0, 0.0
    mode, _, ratio = text.partition(":")
    try:
        r = float(ratio)
    except ValueError:
        raise SystemExit(f"bad schedule {text!r}: expected local, seq:R, seqK:R, mix:R or oracle:R") from None
    if mode in ("mix", "oracle"):
        return mode, int(mode == "oracle"), r
    if mode.startswith("seq") and (mode[3:] == "" or mode[3:].isdigit()):
        return "seq", int(mode[3:] or 1), r
    raise SystemExit(f"bad schedule {text!r}: expected local, seq:R, seqK:R, mix:R or oracle:R")


def parse_federated(text: str) -> tuple[int, int]:
    """``R:E`` -> (rounds, local epochs)."""
    try:
        r, e = (int(v) for v in text.split(":"))
    except ValueError:
        raise SystemExit(f"bad --federated {text!r}: expected ROUNDS:EPOCHS, e.g. 30:10") from None
    if r < 1 or e < 1:
        raise SystemExit(f"bad --federated {text!r}: rounds and epochs must be at least 1")
    return r, e


def federated_fit(gen: ConditionalGenerator, shards: list[tuple[np.ndarray, np.ndarray]], rounds: int,
                  epochs: int, make_trainer: Callable[[ConditionalGenerator], GeneratorTrainer]) -> float:
    """Train ``gen`` as the fleet would: each shard's copy trains ``epochs`` from the global weights
    (keeping its own optimizer state, as GeFL's clients do), the sample-weighted mean becomes the
    global generator; ``rounds`` times. Returns the last round's mean loss."""
    clients = [copy.deepcopy(gen) for _ in shards]
    trainers = [make_trainer(c) for c in clients]
    rngs = [(np.random.default_rng(k), torch.Generator().manual_seed(k)) for k in range(len(shards))]
    loss = float("nan")
    for _ in range(rounds):
        mean, losses = WeightedMean(), []
        weights = model_arrays(gen)
        for client, trainer, (x, y), (rng, tg) in zip(clients, trainers, shards, rngs, strict=True):
            load_arrays(client, weights)
            losses.append(trainer.fit(x, y, epochs=epochs, batch_size=64, rng=rng, gen=tg))
            mean.add(model_arrays(client), len(y))
        load_arrays(gen, mean.result())
        loss = float(np.mean(losses))
    return loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["cvae", "dcgan", "ddpm"], default="cvae")
    ap.add_argument("--level", choices=["image", "feature"], default="image")
    ap.add_argument("--ddpm-steps", type=int, default=20)
    ap.add_argument("--ddpm-guidance", type=float, default=0.0)
    ap.add_argument("--tier", choices=["tiny", "small", "paper"], default="tiny")
    ap.add_argument("--gen-epochs", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=None, help="generator weight decay (default: published)")
    ap.add_argument("--gen-lr", type=float, default=None, help="generator learning rate (default: the kind's)")
    ap.add_argument("--kl-weight", type=float, default=1.0, help="CVAE β: loss = sum-MSE + β KL (published: 1)")
    ap.add_argument("--federated", metavar="R:E",
                    help="train the generator federated over the 10 devices' shards (R rounds of E local epochs, "
                         "FedAvg) instead of on the pool; --gen-epochs is then ignored")
    ap.add_argument("--schedules", nargs="+", default=["local", "seq:1", "mix:1"])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    schedules = {s: parse_schedule(s) for s in args.schedules}

    train, test = load_dataset("fmnist", train=True), load_dataset("fmnist", train=False)
    parts = iid_fraction(train.y, 10, 0.1, 0)
    pool = np.concatenate(parts)
    pool_y = train.y[pool]  # the pooled labels, in the order of gen_x and the shards
    mean, std = float(train.norm.mean), float(train.norm.std)
    x_test, y_test = test.x[:3000], test.y[:3000]
    cfg = TrainConfig()
    feature = args.level == "feature"
    stem: FedgeNet | None = None
    if feature:  # the frozen common extractor GeFL-F's warm-up would leave: here trained on the pool
        stem = build_model("cnn5", seed=0)
        train_epochs(stem, train.x[pool], pool_y, cfg, np.random.default_rng(0), epochs=5)
        gen_x = stem_features(stem, train.x[pool])
    else:
        gen_x = np.clip(train.x[pool] * std + mean, 0, 1).astype(np.float32)
    gen = build_generator(GeneratorSpec(args.kind, tuple(gen_x.shape[1:]), tier=args.tier, num_classes=10), seed=0)
    if isinstance(gen, ConditionalDDPM):
        gen.sample_steps, gen.guidance = args.ddpm_steps, args.ddpm_guidance
    t0 = time.perf_counter()
    if args.federated:
        rounds_e = parse_federated(args.federated)
        sizes = np.cumsum([0, *(len(p) for p in parts)])
        shards = [(gen_x[a:b], pool_y[a:b]) for a, b in itertools.pairwise(sizes)]
        gen_loss = federated_fit(gen, shards, *rounds_e, lambda m: GeneratorTrainer(
            m, lr=args.gen_lr, weight_decay=args.weight_decay, kl_weight=args.kl_weight))
    else:
        trainer = GeneratorTrainer(gen, lr=args.gen_lr, weight_decay=args.weight_decay, kl_weight=args.kl_weight)
        gen_loss = trainer.fit(gen_x, pool_y, epochs=args.gen_epochs, batch_size=64,
                               rng=np.random.default_rng(0), gen=torch.Generator().manual_seed(0))
    gen_seconds = time.perf_counter() - t0

    def synthetic(g: ConditionalGenerator | None, n: int, tg: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        if g is None:  # the perfect generator: real pooled samples
            pick = torch.randint(0, len(pool), (n,), generator=tg).numpy()
            xs, ys = gen_x[pick], pool_y[pick]
        else:
            xs, ys = sample_dataset(g, n, np.arange(10), tg)
        return (xs if feature else ((xs - mean) / std)).astype(np.float32), ys

    def target(arch: str) -> tuple[FedgeNet, Callable[..., float], Callable[[np.ndarray], np.ndarray]]:
        """A device's model, its training function and the map from images to its training inputs."""
        model = build_model(arch, seed=0)
        if stem is None:
            return model, functools.partial(train_epochs, model), lambda x: x
        load_arrays(model, model_arrays(stem, [EXTRACTOR]))
        heads = [p for n, p in model.named_parameters() if not n.startswith(EXTRACTOR)]

        def fwd(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = model.from_stem(z)
            return logits, logits

        return (model, functools.partial(train_epochs, model, params=heads, forward=fwd),
                lambda x: stem_features(model, x))

    probe, probe_train, _ = target("cnn5")
    t0 = time.perf_counter()
    xs, ys = synthetic(gen, 6000, torch.Generator().manual_seed(0))
    sample_seconds_600 = (time.perf_counter() - t0) / 10
    probe_train(xs, ys, cfg, np.random.default_rng(0), epochs=10)
    synthetic_only = accuracy(probe, x_test, y_test)
    # The same probe on 6,000 draws (with replacement) from the pooled real samples: what
    # "synthetic-only" would reach if the generator were perfect.
    probe, probe_train, _ = target("cnn5")
    probe_train(*synthetic(None, 6000, torch.Generator().manual_seed(0)), cfg, np.random.default_rng(0), epochs=10)
    real_only = accuracy(probe, x_test, y_test)

    results: dict[str, Any] = {}
    for name, (mode, syn_epochs, ratio) in schedules.items():
        t0 = time.perf_counter()
        best = []
        for idx, arch in DEVICES:
            model, fit, inputs = target(arch)
            rng, tg = np.random.default_rng(1), torch.Generator().manual_seed(1)
            x, y = inputs(train.x[parts[idx]]), train.y[parts[idx]]
            top = 0.0
            for rnd in range(args.rounds):
                if mode == "local":
                    fit(x, y, cfg, rng)
                else:
                    xs, ys = synthetic(None if mode == "oracle" else gen, round(ratio * len(y)), tg)
                    if mode in ("seq", "oracle"):
                        fit(xs, ys, cfg, rng, epochs=syn_epochs)
                        fit(x, y, cfg, rng)
                    else:
                        fit(np.concatenate([xs, x]), np.concatenate([ys, y]), cfg, rng)
                if rnd % 4 == 3:
                    top = max(top, accuracy(model, x_test, y_test))
            best.append(top)
        results[name] = {"per_model_best": dict(zip([a for _, a in DEVICES], best, strict=True)),
                         "mean_best": float(np.mean(best)), "seconds": time.perf_counter() - t0}
        print(f"{name}: {np.round(best, 3).tolist()} mean {np.mean(best):.4f}", flush=True)

    wd = "pub" if args.weight_decay is None else f"{args.weight_decay:g}"
    out = {"level": args.level, "kind": args.kind, "tier": args.tier, "gen_epochs": args.gen_epochs,
           "federated": args.federated,
           "weight_decay": wd, "gen_lr": args.gen_lr, "gen_params": gen.spec.num_params(), "gen_loss": gen_loss,
           "gen_seconds": gen_seconds,
           "sample_seconds_600": sample_seconds_600, "synthetic_only_cnn5": synthetic_only,
           "pooled_real_only_cnn5": real_only,
           "rounds": args.rounds, "schedules": results}
    budget = f"fed{args.federated.replace(':', 'x')}" if args.federated else f"e{args.gen_epochs}"
    name = f"{args.kind}-{args.tier}-{budget}-wd{wd}" + (f"-lr{args.gen_lr:g}" if args.gen_lr else "")
    if args.kind == "cvae" and args.kl_weight != 1.0:
        out["kl_weight"] = args.kl_weight
        name += f"-b{args.kl_weight:g}"
    if args.kind == "ddpm":
        out["ddpm"] = {"steps": args.ddpm_steps, "guidance": args.ddpm_guidance}
        name += f"-s{args.ddpm_steps}-w{args.ddpm_guidance:g}"
    path = RESULTS / "synthetic_schedule" / f"{'feature-' if feature else ''}{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # same generator, other schedules: keep the schedules measured before
        results = {**json.loads(path.read_text()).get("schedules", {}), **results}
        out["schedules"] = results
    path.write_text(json.dumps(out, indent=1))
    local = results.get("local", {}).get("mean_best")
    rows = [[k, f"{100 * v['mean_best']:.2f}", f"{100 * (v['mean_best'] - local):+.2f}" if local else "-"]
            for k, v in results.items()]
    trained = (f"federated {args.federated} (rounds:local epochs)" if args.federated
               else f"{args.gen_epochs} pooled epochs")
    print(f"{args.level} {args.kind}/{args.tier}, {trained} ({gen_seconds:.0f} s; 600 samples "
          f"in {sample_seconds_600:.1f} s): synthetic-only CNN-5 {100 * synthetic_only:.1f} % "
          f"(on 6,000 draws from the pooled real samples instead: {100 * real_only:.1f} %)")
    print(text_table(["schedule", "mean best acc (%)", "vs local"], rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
