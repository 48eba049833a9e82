"""Why a personal fit cannot always reach Local (issue 17): table 2's fleet, one method, α and seed.

Two experiments, each one simulation of the row's fleet (``--row``, default ``fedvtc-pers``) and then,
per device, several personal predictors measured on the device's local test split:

* ``leaky`` — the design as shipped: the federated model trains on all of the device's data, and the
  held-out 20 % that chooses between the federated model and its fine-tuned copy is part of it.
  Candidates: the federated model, the shipped rule (``evaluate()``), fine-tunes of 100 / 300 /
  1000 SGD steps on all the data, and early stopping (epochs chosen on the held-out 20 %, up to
  1000 steps, then refitted on all the data). The held-out accuracies of every epoch are kept.
* ``clean`` — the held-out 20 % never trains the federated model (the fleet trains on the other
  80 %). Candidates: the federated model, its fine-tuned copy (on the 80 %), and a Local model
  trained alone from the same initial weights for Local's budget (rounds × local epochs) on the
  80 %; chosen by held-out accuracy (ties: lower held-out loss) among the first two or all three,
  then refitted on all the data (the federated model cannot be).

Each device's Local figure is the table-2 Local cell's (``benchmarks.generative table2 --methods local``);
the shipped row's figure is its table-2 cell's. Results: ``benchmarks/results/personal_fit/``.

    python -m benchmarks.personal_fit leaky --seed 1 --alpha 0.1
    python -m benchmarks.personal_fit clean --seed 1 --alpha 0.1
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, mean_std, text_table
from benchmarks.generative.rows import build_config, table2_methods
from fedge.edge.methods.personal import held_out_metrics, holdout, personal_fit_epochs
from fedge.edge.training import train_epochs
from fedge.fleet.devices import SimDevice
from fedge.sim.simulate import build_fleet, run_rounds

OUT = RESULTS / "personal_fit"
T2 = RESULTS / "generative" / "table2"
VAL = 0.2  # the rows' val_fraction


def acc(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    return 100 * held_out_metrics(model, x, y)[0]


def fitted(model: Any, x: np.ndarray, y: np.ndarray, ctx: Any, epochs: int, state: dict | None = None) -> Any:
    """A copy of ``model`` (loaded with ``state`` if given) after ``epochs`` of the device's SGD on x, y."""
    mine = copy.deepcopy(model)
    if state is not None:
        mine.load_state_dict(state)
    train_epochs(mine, x, y, ctx.train_cfg, np.random.default_rng(ctx.seed), epochs=epochs)
    return mine


def leaky(devices: list[SimDevice]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in devices:
        dm, ctx = d.method, d.method.ctx
        x, y, n, bs = ctx.train.x, ctx.train.y, len(ctx.train), ctx.train_cfg.batch_size
        xl, yl = ctx.local_test.x, ctx.local_test.y
        row: dict[str, Any] = {"n": n, "federated": acc(ctx.model, xl, yl), "shipped": 100 * dm.evaluate()["acc_local"]}
        for steps in (100, 300, 1000):
            row[f"fit{steps}"] = acc(fitted(ctx.model, x, y, ctx, personal_fit_epochs(n, bs, 1, steps)), xl, yl)
        rest, val = holdout(n, VAL, ctx.seed)
        per_epoch = -(-len(rest) // bs)
        mine, rng = copy.deepcopy(ctx.model), np.random.default_rng(ctx.seed)
        vals = [acc(mine, x[val], y[val])]
        for _ in range(max(5, -(-1000 // per_epoch))):
            train_epochs(mine, x[rest], y[rest], ctx.train_cfg, rng, epochs=1)
            vals.append(acc(mine, x[val], y[val]))
        best = max(i for i, v in enumerate(vals) if v >= max(vals))  # ties: the longest fit
        row["held_out_by_epoch"] = [round(v, 1) for v in vals]
        row["early_stop_epochs"] = best
        row["early_stop"] = row["federated"] if best == 0 else acc(
            fitted(ctx.model, x, y, ctx, max(1, -(-best * per_epoch // -(-n // bs)))), xl, yl)
        out[d.info.device_id] = row
        print(d.info.device_id, {k: v for k, v in row.items() if k != "held_out_by_epoch"}, flush=True)
    return out


def clean_device(d: SimDevice, data: Any, rest: np.ndarray, val: np.ndarray, init: dict, budget: int,
                 ) -> dict[str, Any]:
    """One device of the ``clean`` experiment (its federated model trained without ``val``)."""
    ctx = d.method.ctx
    xl, yl = ctx.local_test.x, ctx.local_test.y
    bs = ctx.train_cfg.batch_size

    def fine_tuned(idx: np.ndarray) -> Any:
        return fitted(ctx.model, data.x[idx], data.y[idx], ctx, personal_fit_epochs(len(idx), bs, 5, 100))

    def alone(idx: np.ndarray) -> Any:
        return fitted(ctx.model, data.x[idx], data.y[idx], ctx, budget, init)

    cands = {"federated": ctx.model, "fine_tuned": fine_tuned(rest), "local": alone(rest)}
    held = {k: held_out_metrics(m, data.x[val], data.y[val]) for k, m in cands.items()}
    row: dict[str, Any] = {"n": len(data), **{k: acc(m, xl, yl) for k, m in cands.items()},
                           "held_out": {k: [round(100 * a, 2), round(lo, 5)] for k, (a, lo) in held.items()}}
    everything = np.arange(len(data))
    for tag, names in (("of2", ("federated", "fine_tuned")), ("of3", ("federated", "fine_tuned", "local"))):
        pick = min(names, key=lambda k: (-held[k][0], held[k][1]))
        row[f"chosen_{tag}"], row[f"choice_{tag}"] = row[pick], pick
        # refitted on all the data; the federated model cannot be
        row[f"chosen_{tag}_refit"] = (row[pick] if pick == "federated" else
                                      acc((fine_tuned if pick == "fine_tuned" else alone)(everything), xl, yl))
    if ctx.global_test is not None:
        row["global_federated"] = acc(ctx.model, ctx.global_test.x, ctx.global_test.y)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["leaky", "clean"])
    rows_ = table2_methods(20)
    ap.add_argument("--row", default="fedvtc-pers", help="a table-2 row with personalize = true",
                    choices=[k for k, r in rows_.items() if r.config.get("personalize")])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    m = rows_[args.row]
    cfg = build_config(m, args.seed, devices=20, alpha=args.alpha, fraction=0.2, eval_every=m.rounds)
    # The references are read after a long run: check them first.
    refs = [T2 / f"local-a{args.alpha}-s{args.seed}-r20.json",
            T2 / f"{args.row}-a{args.alpha}-s{args.seed}-r{m.rounds}.json"]
    if missing := [p.name for p in refs if not p.is_file()]:
        ap.error(f"no table-2 cell {', '.join(missing)} under {T2}: run `python -m benchmarks.generative table2 "
                 f"--seeds {args.seed} --alphas {args.alpha} --methods local {args.row}` first")
    t0 = time.perf_counter()
    devices, strat = build_fleet(cfg)
    if args.mode == "leaky":
        run_rounds(cfg, devices, strat)
        rows = leaky(devices)
    else:
        full, folds, init = {}, {}, {}
        for d in devices:
            ctx = d.method.ctx
            full[d.info.device_id], folds[d.info.device_id] = ctx.train, holdout(len(ctx.train), VAL, ctx.seed)
            init[d.info.device_id] = copy.deepcopy(ctx.model.state_dict())
            ctx.train = ctx.train.subset(folds[d.info.device_id][0])
            d.method.data_changed()
        run_rounds(cfg, devices, strat)
        rows = {}
        for d in devices:
            dev = d.info.device_id
            budget = d.method.ctx.train_cfg.local_epochs * cfg.run.rounds  # what Local trains
            rows[dev] = clean_device(d, full[dev], *folds[dev], init[dev], budget)
            print(dev, {k: v for k, v in rows[dev].items() if k != "held_out"}, flush=True)
    local, shipped = (json.loads(p.read_text())["per_device"] for p in refs)
    for dev, row in rows.items():
        row["Local"], row["row_cell"] = 100 * local[dev]["final_acc_local"], 100 * shipped[dev]["final_acc_local"]
    cols = [k for k, v in next(iter(rows.values())).items() if isinstance(v, float) and k != "n"]
    means = {k: mean_std([r[k] for r in rows.values()])[0] for k in cols}
    result = {"mode": args.mode, "row": args.row, "seed": args.seed, "alpha": args.alpha,
              "wall_seconds": time.perf_counter() - t0, "mean_local_acc": means, "per_device": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{args.mode}-{args.row}-a{args.alpha}-s{args.seed}.json"
    path.write_text(json.dumps(result, indent=1))
    print(text_table(["candidate", "mean local acc (%)", "− Local"],
                     [[k, f"{v:.2f}", f"{v - means['Local']:+.2f}"] for k, v in means.items()]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
