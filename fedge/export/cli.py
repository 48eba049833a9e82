"""``fedge export`` (checkpoint or run → verified ONNX directories) and ``fedge profile probe``.

Heavy imports (torch, onnx) happen inside the handlers. ``fedge infer``, which runs an exported directory,
is the runtime's own command (:mod:`fedge.runtime.cli`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedge.export.quantize import DEFAULT_CALIBRATION_SAMPLES
from fedge.runtime.manifest import QUANTS, Manifest


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fedge export``."""
    ex = sub.add_parser(
        "export", help="export trained models to verified, quantized ONNX for their devices",
        description="Export the extractor, head and fused model of a checkpoint (or of every device of a finished "
                    "run) to ONNX, quantized per the device's plan, verified against PyTorch, with manifest.json.",
    )
    src = ex.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="CKPT", help="a device model checkpoint (.safetensors)")
    src.add_argument("--run", metavar="RESULTS_DIR",
                     help="a finished run's output directory (results.json, checkpoints/)")
    ex.add_argument("--out", required=True, metavar="DIR", help="output directory (replaced atomically)")
    ex.add_argument("--profile", metavar="NAME|PATH",
                    help="device profile whose plan decides the quantization (default: the one the checkpoint records)")
    ex.add_argument("--quant", choices=QUANTS, help="override the plan's inference quantization")
    ex.add_argument("--arch", help="architecture the checkpoint must hold (default: the plan's)")
    ex.add_argument("--dataset", help="data set to calibrate and verify on (default: the one recorded)")
    ex.add_argument("--data-dir", help="directory of the data set files")
    ex.add_argument("--calibration", metavar="FILE.npy",
                    help="preprocessed calibration inputs (N, C, S, S) at the model's input size, e.g. a "
                         "generator's samples")
    ex.add_argument("--calib-samples", type=int, default=DEFAULT_CALIBRATION_SAMPLES,
                    help=f"calibration samples for int8-static (default {DEFAULT_CALIBRATION_SAMPLES})")
    ex.add_argument("--test-samples", type=int, help="verify on the first N test images only (default: all)")
    ex.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    ex.add_argument("--last", action="store_true",
                    help="with --run: ship each device's last model, not its best (the round that scored best on "
                         "its validation fold, the default)")
    ex.add_argument("--signing-key", metavar="FILE",
                    help="sign every manifest with the fleet's Ed25519 key (coordinator/signing.key of `fedge broker "
                         "config --sign`); `fedge infer --fleet-key` then verifies it")
    ex.set_defaults(func=_export)


def _summary(out: str, m: Manifest) -> list[str]:
    acc = m.metrics.get("accuracy", {})
    lat = m.metrics.get("latency_ms", {})
    lines = [f"{out}: {m.arch} as {m.quant}" + (f" for profile {m.profile}" if m.profile else "")]
    files = ", ".join(f"{k} {v.bytes / 1024:.1f} KiB" for k, v in sorted(m.files.items()))
    lines.append(f"  files     {files}")
    lines.append("  accuracy  " + ", ".join(f"{k} {v:.2%}" for k, v in acc.items())
                 + f" on {m.metrics.get('test_set', {}).get('images', '?')} test images")
    lines.append("  latency   " + ", ".join(f"{k} {v:.3f} ms" for k, v in lat.items()) + " (batch 1, 1 thread)")
    decision = m.extra.get("quantization") or {}
    if decision.get("reason"):
        lines.append(f"  quant     {decision['reason']}")
    origin = m.extra.get("checkpoint")
    if origin:
        lines.append("  model     " + _origin_text(origin))
    return lines


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _origin_text(o: dict[str, Any]) -> str:
    """Which round a run's exported checkpoint came from, and its accuracies against the last round's."""
    last = o.get("last") or {}
    head = (f"{o['choice']} checkpoint, round {o['round']}: validation {_pct(o.get('acc_val'))}, "
            f"global test {_pct(o.get('acc_global'))}")
    if o["choice"] == "best" and last:
        head += (f" (the last round, {last.get('round')}: validation {_pct(last.get('acc_val'))}, "
                 f"global test {_pct(last.get('acc_global'))})")
    return head


def _export(args: argparse.Namespace) -> int:
    import numpy as np

    from fedge.common.signing import Signer
    from fedge.export.exporter import ExportOptions
    from fedge.export.fleet import export_checkpoint, export_run
    from fedge.runtime.inputs import read_npy
    from fedge.runtime.signature import sign_manifest

    signer = Signer.from_file(args.signing_key) if args.signing_key else None  # a bad key fails before exporting
    opt = ExportOptions(calibration_samples=args.calib_samples)
    if args.last and not args.run:
        raise _usage("--last chooses among a run's checkpoints: give --run RESULTS_DIR",
                     hint="with --checkpoint, pass RUN/checkpoints/<device>.last.safetensors itself")
    if args.run:
        if args.profile or args.arch or args.calibration:
            raise _usage("--profile, --arch and --calibration apply to --checkpoint; a run records them per device")
        manifests = export_run(args.run, args.out, data_dir=args.data_dir, dataset=args.dataset, quant=args.quant,
                               test_samples=args.test_samples, options=opt, overwrite=args.force, last=args.last)
        for dev, m in manifests.items():
            if signer is not None:
                sign_manifest(Path(args.out) / dev, signer)
            print("\n".join(_summary(str(Path(args.out) / dev), m)))
        print(f"exported {len(manifests)} devices into {args.out} (index.json lists them)")
        return 0
    calibration = np.asarray(read_npy(args.calibration), dtype=np.float32) if args.calibration else None
    m = export_checkpoint(args.checkpoint, args.out, profile=args.profile, dataset=args.dataset,
                          data_dir=args.data_dir, calibration=calibration, quant=args.quant, arch=args.arch,
                          test_samples=args.test_samples, options=opt, overwrite=args.force)
    if signer is not None:
        sign_manifest(args.out, signer)
        print(f"signed {Path(args.out) / 'manifest.json'} with key {signer.key_id}")
    print("\n".join(_summary(args.out, m)))
    return 0


def _usage(message: str, hint: str | None = None) -> Exception:
    from fedge.errors import ConfigError

    return ConfigError(message, hint=hint)


def add_probe_parser(psub: argparse._SubParsersAction) -> None:
    """Register ``probe`` under ``fedge profile`` (called from :mod:`fedge.cli`, which may import both areas)."""
    from fedge.common.archs import TIERS

    pr = psub.add_parser(
        "probe", help="measure inference latency on this machine and write a measured profile",
        description="Train each model tier briefly, export it at every quantization level, time batch-1 "
                    "inference with ONNX Runtime (median of repeated runs) and write a profile whose [measured] "
                    "table lets the planner choose int8 only where it is faster and within the accuracy bound.",
    )
    pr.add_argument("--out", required=True, metavar="FILE.toml", help="where to write the measured profile")
    pr.add_argument("--base", metavar="NAME|PATH",
                    help="profile to copy hardware, network and budgets from (default: detect this machine)")
    pr.add_argument("--name", help="name of the written profile")
    pr.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated tiers (default {','.join(TIERS)})")
    pr.add_argument("--quants", default=",".join(QUANTS), help=f"comma-separated levels (default {','.join(QUANTS)})")
    pr.add_argument("--runs", type=int, default=200, help="timed runs per measurement (default 200)")
    pr.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (default 1)")
    pr.add_argument("--dataset", default="digits", help="data set the tiers are trained and tested on (default digits)")
    pr.add_argument("--data-dir", help="directory of the data set files")
    pr.add_argument("--epochs", type=int, default=3, help="training epochs per tier (default 3)")
    pr.add_argument("--train-batches", default="16,64", metavar="B,B",
                    help="also time training of each tier at these batch sizes, for the speed model's "
                         "[measured] train_gmac_s (default 16,64; '' to skip)")
    pr.add_argument("--train-threads", type=int, help="threads for the training timing (default: every core)")
    pr.set_defaults(func=_probe)


def _batches(text: str) -> list[int]:
    from fedge.errors import ConfigError

    try:
        return [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--train-batches {text!r} is not a list of batch sizes", hint="e.g. 16,64") from None


def _probe(args: argparse.Namespace) -> int:
    from fedge.export.probe import probe, write_measured_profile

    result = probe(tiers=[t.strip() for t in args.tiers.split(",") if t.strip()],
                   quants=[q.strip() for q in args.quants.split(",") if q.strip()],
                   runs=args.runs, threads=args.threads, dataset=args.dataset, data_dir=args.data_dir,
                   epochs=args.epochs, train_batches=_batches(args.train_batches), train_threads=args.train_threads)
    path = write_measured_profile(result, args.out, base=args.base, name=args.name)
    quants = sorted({k.split("/")[1] for k in result.latency_ms}, key=QUANTS.index)
    print(f"{'tier':8s}  " + "  ".join(f"{q:>18s}" for q in quants))
    for arch, accs in result.accuracy.items():
        cells = [f"{result.latency_ms[f'{arch}/{q}']:8.3f} ms {accs[q]:6.1%}" for q in quants]
        print(f"{arch:8s}  " + "  ".join(f"{c:>18s}" for c in cells))
    drops = ", ".join(f"{q} {d:+.2f}" for q, d in result.accuracy_drop.items())
    print(f"worst accuracy drop vs fp32 (points): {drops or 'none measured'}")
    if result.train_gmac_s:
        print(f"training on {result.train_threads} thread(s), GMAC/s: "
              + ", ".join(f"{k} {v:.3f}" for k, v in result.train_gmac_s.items()))
    print(f"wrote {path}; `fedge profile plan {path}` shows what the planner chooses from it")
    return 0
