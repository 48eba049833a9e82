"""Keyword spotting on the synthetic espeak-ng set (issue 41): FedAvg within group vs local vs FedProto, a central
ceiling, and what the exported DS-CNNs (front end inside) weigh and take on this machine.

The fleet: ``--devices`` per profile of four built-in profiles (rpi-zero-2w, rpi4-4gb, jetson-nano, x86-gateway),
each speaker's clips on one device (``[partition] kind = "group"``), the DS-CNN tier of each device chosen by the
planner, tested on the held-out speakers (``testing_list.txt``: voices never heard in training). The set is spoken
once into ``--data-dir`` (a cache; docs/audio.md says what synthetic speech does and does not show). Each method
is one ``fedge simulate`` in process (the library call), one cell of JSON (resumable); the ceiling is the largest
tier the fleet uses trained centrally on the pooled training shares for the same number of epochs. Then each
distinct architecture of the FedAvg run is exported (fp32 and int8-dynamic): file size, accuracy on the test
speakers, median latency at batch 1 (ONNX Runtime, 1 thread) from the export's own measurement.

    python -m benchmarks.kws --seeds 0 --methods fedavg &   # two processes at one torch thread each
    python -m benchmarks.kws --seeds 0 --methods local fedproto
    python -m benchmarks.kws --seeds 0                       # the table of every cell (all cached by then)
    python -m benchmarks.kws --seeds 0 --methods fedavg --rounds 12 --central --zero-diagnosis  # cells *-r12e2
    python -m benchmarks.kws --seeds 0 --methods fedavg --rounds 12 --devices 5 --central      # 20 devices
    python -m benchmarks.kws --latency    # the speed model's per-clip time per built-in profile, measured here

GeFL-F and FedVTC cannot serve the DS-CNN (their generators need a square stem / image): asked for, their rows
say why.

Results: ``benchmarks/results/kws/*.json``, a table on stdout, the figures in docs/audio.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO, RESULTS, cached_cell

OUT = RESULTS / "kws"
PROFILES = ("rpi-zero-2w", "rpi4-4gb", "jetson-nano", "x86-gateway")
METHODS = ("fedavg", "local", "fedproto", "lgfedavg", "geflf", "fedvtc")
DEFAULT_SCHEDULE = (4, 2)  # rounds, local epochs: the first table's cells keep their plain names


def schedule_tag(args: argparse.Namespace) -> str:
    """The suffix of a cell's file and run folder: empty at the default schedule and fleet (8 devices), ``-r12e2``
    at 12 rounds x 2, ``-n20`` with 5 devices per profile."""
    fleet = "" if args.devices == 2 else f"-n{4 * args.devices}"
    default = (args.rounds, args.local_epochs) == DEFAULT_SCHEDULE
    return fleet + ("" if default else f"-r{args.rounds}e{args.local_epochs}")


def fleet_table(method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run": {"name": f"kws-{method}", "method": method, "rounds": args.rounds, "dataset": "espeak_kws",
                "data_dir": str(args.data_dir), "seed": seed, "eval_every": args.eval_every},
        "model": {"family": "dscnn"},
        "partition": {"kind": "group", "local_test_fraction": 0.2},
        "train": {"lr": args.lr, "momentum": 0.9, "local_epochs": args.local_epochs, "batch_size": args.batch_size,
                  "lr_schedule": "constant"},
        "devices": [{"profile": p, "count": args.devices} for p in PROFILES],
        **({"method": geflf_phases(args.rounds)} if method == "geflf" else {}),
    }


def geflf_phases(rounds: int) -> dict[str, int]:
    """GeFL-F's phases scaled to ``rounds`` (published: 20 warm-up + 100 generator + 50 head of 170): a third each
    for warm-up and generator rounds, the rest head rounds."""
    if rounds < 3:
        raise SystemExit(f"geflf needs at least 3 rounds (warm-up, generator, head), not {rounds}")
    return {"warmup_rounds": rounds // 3, "gen_rounds": rounds // 3}


FleetTable = Callable[[str, int, argparse.Namespace], dict[str, Any]]


def run_method(method: str, seed: int, args: argparse.Namespace, table: FleetTable = fleet_table) -> dict[str, Any]:
    """One ``fedge simulate`` of the fleet ``table`` builds for ``method``: its summary and each device's row."""
    from fedge.fleet.config import parse_fleet
    from fedge.sim.report import build_results
    from fedge.sim.simulate import simulate

    cfg = parse_fleet(table(method, seed, args), source=str(REPO / "examples" / "kws-fleet.toml"))
    out = args.work / f"{method}-{seed}{schedule_tag(args)}"
    t0 = time.perf_counter()
    r = build_results(simulate(cfg, out_dir=out))
    devices = [{k: d[k] for k in ("id", "profile", "arch", "num_train", "final_acc_global", "final_acc_local",
                                  "shipped_acc_global", "acc_global", "plan")} for d in r["devices"]]
    return {"method": method, "seed": seed, "rounds": args.rounds, "local_epochs": args.local_epochs,
            "batch_size": args.batch_size,
            "seconds": round(time.perf_counter() - t0, 1), "summary": r["summary"], "devices": devices,
            "tier_trades": r["tier_trades"], "run_dir": str(out)}


def run_central(seed: int, arch: str, epochs: int, args: argparse.Namespace, *,
                profiles: tuple[str, ...] | None = None, table: FleetTable = fleet_table) -> dict[str, Any]:
    """The ceiling: ``arch`` trained on the training shares of the devices of ``profiles`` pooled (every device
    by default), ``epochs`` epochs; accuracy on the test set (unseen speakers / subjects) every
    ``eval_every * local_epochs`` epochs (the federated run's evaluation points) and at the end."""
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.families import build_family_net
    from fedge.edge.training import TrainConfig, train_epochs
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.slots import family_spec, fleet_splits

    cfg = parse_fleet(table("fedavg", seed, args))
    dataset, data_dir = cfg.run.dataset, cfg.run.data_dir
    train = load_dataset(dataset, train=True, data_dir=data_dir, seed=seed)
    test = load_dataset(dataset, train=False, data_dir=data_dir, seed=seed)
    owners = [d.profile for d in cfg.devices for _ in range(d.count)]  # one per device, in the fleet's order
    profiles = tuple(dict.fromkeys(owners)) if profiles is None else profiles
    splits = fleet_splits(cfg, train.y)
    pooled = np.sort(np.concatenate([s.train for s, p in zip(splits, owners, strict=True) if p in profiles]))
    net = build_family_net(family_spec(cfg, arch.split("-")[1]), seed=seed)
    rng = np.random.default_rng(seed)
    step = args.eval_every * args.local_epochs
    curve: dict[int, float] = {}
    t0 = time.perf_counter()
    done = 0
    while done < epochs:
        n = min(step, epochs - done)
        tc = TrainConfig(lr=args.lr, batch_size=args.batch_size, local_epochs=n, momentum=0.9)
        net.train()
        train_epochs(net, train.x[pooled], train.y[pooled], tc, rng)
        done += n
        net.eval()
        with torch.no_grad():
            pred = np.concatenate([net(torch.from_numpy(test.x[i : i + 256])).argmax(1).numpy()
                                   for i in range(0, len(test), 256)])
        curve[done] = float((pred == test.y).mean())
        print(f"  central {arch} on {'+'.join(profiles)}: epoch {done} acc {100 * curve[done]:.1f}", flush=True)
    return {"seed": seed, "arch": arch, "epochs": epochs, "samples": len(pooled), "profiles": list(profiles),
            "acc_global": curve[epochs], "curve": {str(k): v for k, v in curve.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


def run_exports(cell: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each distinct architecture of a run, exported fp32 and int8-dynamic: size, accuracy, latency."""
    from fedge.errors import ExportError
    from fedge.export.fleet import export_checkpoint

    rows: list[dict[str, Any]] = []
    for arch in sorted({d["arch"] for d in cell["devices"]}):
        dev = next(d for d in cell["devices"] if d["arch"] == arch)
        ckpt = Path(cell["run_dir"]) / "checkpoints" / f"{dev['id']}.safetensors"
        for quant in ("fp32", "int8-dynamic"):
            out = args.work / "exports" / f"{dev['id']}-{quant}"
            try:
                m = export_checkpoint(ckpt, out, profile=dev["profile"], data_dir=args.data_dir, quant=quant,
                                      overwrite=True)
            except ExportError as exc:  # refused by the export's own checks (accuracy drop): say so in the row
                rows.append({"arch": arch, "device": dev["id"], "quant": quant, "refused": exc.message})
                continue
            rows.append({"arch": arch, "device": dev["id"], "quant": quant,
                         "model_bytes": (out / "model.onnx").stat().st_size,
                         "accuracy": m.metrics["accuracy"].get(quant, m.metrics["accuracy"].get("fp32")),
                         "accuracy_fp32": m.metrics["accuracy"]["fp32"],
                         "latency_ms": m.metrics["latency_ms"].get(quant)})
    return rows


def numpy_mfcc(x: np.ndarray) -> np.ndarray:
    """The front end written in numpy (strided frames, rFFT, the same filterbank and DCT): (16000,) -> (49, 10)."""
    from fedge.edge.models.frontend import DEFAULT_MFCC as S
    from fedge.edge.models.frontend import dct_matrix, mel_filterbank

    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(S.window) / S.window)
    frames = np.lib.stride_tricks.sliding_window_view(x, S.window)[:: S.hop] * hann
    power = np.abs(np.fft.rfft(frames, axis=1)[:, : S.bins]) ** 2
    return np.log(power @ mel_filterbank(S) + S.floor) @ dct_matrix(S.mels, S.coefficients)


def frontend_cell(args: argparse.Namespace) -> dict[str, Any]:
    """Median time of the front end alone on one clip: the ONNX graph (what ships) against numpy, and how far
    apart their features are."""
    import io

    import onnxruntime as ort
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.frontend import Mfcc
    from fedge.export.verify import median_ms

    clip = load_dataset("espeak_kws", train=False, data_dir=args.data_dir).x[:1]  # (1, 1, 16000)
    buf = io.BytesIO()
    torch.onnx.export(Mfcc(16_000).eval(), (torch.from_numpy(clip),), buf,  # type: ignore[arg-type]
                      dynamo=False, opset_version=17,
                      input_names=["audio"], output_names=["mfcc"])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
    graph = sess.run(None, {"audio": clip})[0][0, 0]
    ref = numpy_mfcc(clip[0, 0].astype(np.float32))
    return {"graph_ms": median_ms(lambda: sess.run(None, {"audio": clip}), runs=300),
            "numpy_ms": median_ms(lambda: numpy_mfcc(clip[0, 0]), runs=300),
            "max_abs_diff": float(np.abs(graph - ref).max())}


def latency_cell(args: argparse.Namespace) -> dict[str, Any]:
    """Per clip, for each DS-CNN tier the planner gives a KWS fleet (xs, l): the speed model's forward-pass time on
    every built-in profile (forward MACs ÷ the model's MAC rate at batch 1, on one core and on all cores) beside
    the time measured here (ONNX Runtime, one thread, batch 1, the exported graph with its front end), and the
    speed model of this machine (one core at its clock, the x86 fallback microarchitecture) for the check."""
    import io

    import onnxruntime as ort
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.families import build_family_net
    from fedge.export.verify import median_ms
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.slots import family_spec
    from fedge.profiles.loader import builtin_dir, load_profile
    from fedge.profiles.speed import SpeedModel, speed_model
    from fedge.profiles.uarch import uarch_of

    cfg = parse_fleet(fleet_table("fedavg", 0, args))
    clip = load_dataset("espeak_kws", train=False, data_dir=args.data_dir).x[:1]
    mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("cpu MHz")]
    uarch, found = uarch_of("x86_64", "this host")
    host = SpeedModel("this host", 1, mhz[0] / 1000 if mhz else 2.5, uarch, found)
    rows = []
    for tier in ("xs", "l"):
        spec = family_spec(cfg, tier)
        buf = io.BytesIO()
        torch.onnx.export(build_family_net(spec, seed=0).eval(), (torch.from_numpy(clip),), buf,  # type: ignore[arg-type]
                          dynamo=False, opset_version=17, input_names=["audio"], output_names=["logits"])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
        measured = median_ms(partial(sess.run, None, {"audio": clip}), runs=300)
        macs = spec.macs()
        predicted = {}
        for path in sorted(builtin_dir().glob("*.toml")):
            m = speed_model(load_profile(path.stem))
            rate = m.mac_rate(spec, 1)
            predicted[path.stem] = {"one_core_ms": 1e3 * macs * m.cores / rate, "all_cores_ms": 1e3 * macs / rate,
                                    "cores": m.cores}
        rows.append({"arch": spec.name, "macs": macs, "measured_ms_here": measured,
                     "predicted_here_ms": 1e3 * macs / host.mac_rate(spec, 1), "predicted": predicted})
    return {"rows": rows, "host": host.describe()}


def latency_table(cell: dict[str, Any]) -> str:
    lines = ["| profile | " + " | ".join(f"{r['arch']} 1 core / all cores (ms)" for r in cell["rows"]) + " |",
             "|---|" + "---:|" * len(cell["rows"])]
    for prof in cell["rows"][0]["predicted"]:
        lines.append(f"| {prof} (speed model) | " + " | ".join(
            f"{r['predicted'][prof]['one_core_ms']:.2f} / {r['predicted'][prof]['all_cores_ms']:.2f}"
            for r in cell["rows"]) + " |")
    lines.append("| this machine (speed model, 1 core) | " + " | ".join(
        f"{r['predicted_here_ms']:.2f}" for r in cell["rows"]) + " |")
    lines.append("| this machine (measured, ONNX Runtime, 1 thread) | " + " | ".join(
        f"{r['measured_ms_here']:.2f}" for r in cell["rows"]) + " |")
    lines.append("forward MACs per clip: " + ", ".join(f"{r['arch']} {r['macs']:,}" for r in cell["rows"]))
    return "\n".join(lines)


def export_cell(cell: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return {"rows": run_exports(cell, args), "rounds": args.rounds, "local_epochs": args.local_epochs,
            "batch_size": args.batch_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--devices", type=int, default=2, help="devices per profile (4 profiles)")
    ap.add_argument("--data-dir", type=Path, default=REPO / "runs" / "espeak-kws")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "kws-bench")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "local", "fedproto"], choices=METHODS,
                    help="default: the first table's three")
    ap.add_argument("--central", action="store_true", help="also train the ceiling (costs one method's time)")
    ap.add_argument("--zero-diagnosis", action="store_true",
                    help="central runs that explain the Pi Zero group: its tier on everyone's data, the largest "
                         "tier and its own tier on the Zero devices' data only")
    ap.add_argument("--latency", action="store_true",
                    help="only the per-clip latency table: the speed model per built-in profile, measured here")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    from fedge.edge.data.espeak import make_keyword_set
    from fedge.errors import ConfigError

    t0 = time.perf_counter()
    make_keyword_set(args.data_dir)
    print(f"keyword set in {args.data_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    if args.latency:
        print(latency_table(cached_cell(OUT / "latency.json", partial(latency_cell, args), force=args.force)))
        return 0
    settings = {"rounds": args.rounds, "local_epochs": args.local_epochs, "batch_size": args.batch_size}
    tag = schedule_tag(args)
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    exports: dict[str, Any] = {"rows": []}
    tiers = ["xs", "s", "m", "l"]
    epochs = args.rounds * args.local_epochs
    for seed in args.seeds:  # FedAvg, its exports, then the rest: the most telling figures first
        for method in args.methods:
            print(f"{method} seed {seed} ...", flush=True)
            try:
                cells[(method, seed)] = cached_cell(OUT / f"{method}-{seed}{tag}.json",
                                                    partial(run_method, method, seed, args),
                                                    force=args.force, expect=settings)
            except ConfigError as exc:  # a method the DS-CNN cannot serve (geflf, fedvtc): its row says why
                print(f"  {method} refused: {exc}", flush=True)
                cells[(method, seed)] = {"refused": str(exc).splitlines()[0]}
                continue
            if method == "fedavg" and seed == args.seeds[0] and not tag:  # exports: the first table's schedule
                front = cached_cell(OUT / "frontend.json", partial(frontend_cell, args), force=args.force)
                print(f"front end on one clip: ONNX graph {front['graph_ms']:.3f} ms, numpy {front['numpy_ms']:.3f} ms "
                      f"(max |diff| {front['max_abs_diff']:.2g})", flush=True)
                exports = cached_cell(OUT / "exports.json", partial(export_cell, cells[(method, seed)], args),
                                      force=args.force, expect=settings)
        if "devices" not in cells.get(("fedavg", seed), {}):
            continue
        archs = {d["profile"]: d["arch"] for d in cells[("fedavg", seed)]["devices"]}
        largest = max(archs.values(), key=lambda a: tiers.index(a.split("-")[1]))
        runs: list[tuple[str, str, tuple[str, ...] | None]] = []
        if args.central:
            runs.append(("central", largest, None))
        if args.zero_diagnosis:
            zero = archs["rpi-zero-2w"]
            runs += [("central-zero-tier", zero, None), ("central-zero-data", largest, ("rpi-zero-2w",)),
                     ("central-zero-both", zero, ("rpi-zero-2w",))]
        for name, arch, profiles in runs:
            print(f"{name} {arch} seed {seed} ...", flush=True)
            cells[(name, seed)] = cached_cell(OUT / f"{name}-{seed}{tag}.json",
                                              partial(run_central, seed, arch, epochs, args, profiles=profiles),
                                              force=args.force, expect={"epochs": epochs})
    print(table(cells, exports["rows"], args))
    return 0


def device_curve(cell: dict[str, Any]) -> str:
    """Mean device accuracy on the unseen speakers at each evaluated round, and the Pi Zero group's, in %."""
    devices = cell["devices"]
    if not devices or "acc_global" not in devices[0]:
        return ""
    rounds = [i for i, a in enumerate(devices[0]["acc_global"]) if a is not None]
    mean = [np.mean([d["acc_global"][i] for d in devices if d["acc_global"][i] is not None]) for i in rounds]
    zero = [np.mean([d["acc_global"][i] for d in devices if d["profile"] == "rpi-zero-2w"
                     and d["acc_global"][i] is not None] or [np.nan]) for i in rounds]
    return (", ".join(f"{100 * m:.1f}" for m in mean) + " (Zero group: " +
            ", ".join(f"{100 * z:.1f}" for z in zero) + ")")


def table(cells: dict[tuple[str, int], dict[str, Any]], exports: list[dict[str, Any]],
          args: argparse.Namespace) -> str:
    lines = [f"keyword spotting, espeak-ng set, {4 * args.devices} devices by speaker, {args.rounds} rounds x "
             f"{args.local_epochs} epoch(s); accuracy % on unseen speakers",
             "| method | seed | mean device acc (global test) | min device | mean local acc | s | "
             "curve (mean device / central, every eval) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for (method, seed), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if method.startswith("central"):
            curve = ", ".join(f"{100 * v:.1f}" for v in c.get("curve", {}).values())
            lines.append(f"| {method} ({c['arch']} on {'+'.join(c.get('profiles', PROFILES))}: {c['samples']} clips)"
                         f" | {seed} | {100 * c['acc_global']:.1f} | | | {c['seconds']:.0f} | {curve} |")
            continue
        if "refused" in c:
            lines.append(f"| {method} | {seed} | refused: {c['refused']} | | | | |")
            continue
        accs = [d["final_acc_global"] for d in c["devices"]]
        lines.append(f"| {method} | {seed} | {100 * np.mean(accs):.1f} | {100 * min(accs):.1f} | "
                     f"{100 * c['summary']['mean_final_acc_local']:.1f} | {c['seconds']:.0f} | {device_curve(c)} |")
    lines += ["", "| export | quant | model.onnx | accuracy % | latency ms (batch 1, 1 thread) |",
              "|---|---|---:|---:|---:|"]
    for r in exports:
        if "refused" in r:
            lines.append(f"| {r['arch']} | {r['quant']} | refused: {r['refused']} | | |")
            continue
        lat = f"{r['latency_ms']:.2f}" if r["latency_ms"] is not None else "-"
        lines.append(f"| {r['arch']} | {r['quant']} | {r['model_bytes'] / 1024:.0f} KiB | {100 * r['accuracy']:.1f} | "
                     f"{lat} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())


