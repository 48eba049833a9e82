"""An over-the-air model update over an emulated device's link (not a test: figures for docs/results.md).

Issue 31's target: an OTA update of a tier-xl model to an emulated Raspberry Pi Zero 2 W over its emulated
link in ``fedge emulate`` takes at most 1.5 x bytes / link rate. This script

1. exports a tier-xl network (trained one epoch on digits) with ``fedge.export`` (``--quant``, default fp32);
2. brings up a one-device fleet of that profile with ``fedge emulate`` and ``--sign`` (its container limited
   to the profile's CPU, memory and link: ``tbf`` at the profile's downlink rate on the ingress it shapes),
   runs its one training round and waits for the coordinator to finish, so that nothing else moves on the
   link and the device's agent idles (``--keep-running``);
3. runs ``fedge deploy`` of the model to the device (the real command, in a child process, with the emulation's
   deploy account and fleet key) ``--repeats`` times, versions 1, 2, ...; each device reports how long its
   download took (the status's ``download``: from subscribing to the package to holding all of it);
4. reads the device's ingress shaper (``tc -s -j qdisc show dev ifb0``) before and after each deploy: the bytes
   that crossed the emulated downlink;

and compares each download's time with bytes x 8 / the profile's downlink rate.

    python -m benchmarks.ota_emulate [--profile rpi-zero-2w] [--model-arch tier-xl] [--quant fp32] [--repeats 2]

Writes benchmarks/results/ota_emulate.json and prints a table. Needs a Docker engine and the fedge images
(built when missing, as ``fedge emulate up`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS
from fedge.emulate import discovery, images, lifecycle, status

FLEET = """
[run]
method = "fedproto"
rounds = 1
dataset = "digits"
fleet = "otabench"
seed = 0

[partition]
fraction = 0.2

[[devices]]
profile = "{profile}"
count = 1
"""

TARGET_RATIO = 1.5  # the bound on time / (bytes / link rate)


def export_tier(arch: str, quant: str, out: Path) -> Path:
    """``arch`` trained one epoch on digits, exported to ``out`` (a ``fedge export`` directory)."""
    import numpy as np
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.zoo import build_model
    from fedge.edge.training import TrainConfig, train_epochs
    from fedge.export.exporter import ExportOptions, export_model

    torch.set_num_threads(1)
    train, test = load_dataset("digits", train=True), load_dataset("digits", train=False)
    torch.manual_seed(0)
    net = build_model(arch, seed=0)
    train_epochs(net, train.x, train.y, TrainConfig(lr=0.02, batch_size=32, momentum=0.9), np.random.default_rng(0),
                 epochs=1)
    export_model(net.eval(), out, quant=quant, test=test, options=ExportOptions(latency_runs=3), overwrite=True)
    return out


def ingress_bytes(container: Any) -> int | None:
    """Bytes the device's downlink shaper (the tbf on ifb0, docker/shape-link.sh) has sent so far."""
    code, out = container.exec_run(["tc", "-s", "-j", "qdisc", "show", "dev", "ifb0"])
    if code != 0:
        return None
    qdiscs = json.loads(out.decode() or "[]")
    tbf = [q for q in qdiscs if q.get("kind") == "tbf"]
    return int(tbf[0]["bytes"]) if tbf else None


def deploy(emu: Any, broker_ip: str, model: Path, version: int, device: str, status_file: Path) -> dict[str, Any]:
    """``fedge deploy`` of ``model`` as ``version`` to ``device`` (a child process); its status and wall time."""
    broker = emu.out / "broker"
    cmd = [sys.executable, "-m", "fedge", "deploy", "--config", str(emu.out / "fleet.toml"), "--model", str(model),
           "--version", str(version), "--devices", device, "--canary", "0", "--threshold", "1",
           "--broker", f"mqtt://{broker_ip}:1883", "--username", "fedge-deploy",
           "--password-file", str(broker / "deploy" / "password"),
           "--signing-key", str(broker / "coordinator" / "signing.key"), "--timeout", "1800",
           "--status-file", str(status_file)]
    t0 = time.perf_counter()
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    wall = time.perf_counter() - t0
    if not status_file.is_file():  # exit 10 (the device rolled the model back) still writes it
        raise SystemExit(f"fedge deploy failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    report = json.loads(status_file.read_text())
    return {"command": " ".join(cmd), "wall_s": wall, "stdout": proc.stdout.strip(),
            "status": report["statuses"][device], "order_to_final_s": report["seconds"].get(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="rpi-zero-2w")
    ap.add_argument("--model-arch", default="tier-xl")
    ap.add_argument("--quant", default="fp32", help="the exported model's quantization (fp32, fp16, int8-dynamic)")
    ap.add_argument("--repeats", type=int, default=2, help="deployments, versions 1 ... N (default 2)")
    ap.add_argument("--images-hash", metavar="H", help="use the images built for fedge source hash H")
    ap.add_argument("--work", default="runs/bench-ota-emulate")
    ap.add_argument("--out", default=str(RESULTS / "ota_emulate.json"))
    args = ap.parse_args()

    client = discovery.docker_client()
    tags = images.image_tags("amd64", args.images_hash) if args.images_hash else images.ensure_images(client, "amd64")
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    load_start, t_start = os.getloadavg(), time.time()
    model = export_tier(args.model_arch, args.quant, work / "model")
    model_bytes = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    fleet = work / "fleet.toml"
    fleet.write_text(FLEET.format(profile=args.profile))
    emu = lifecycle.prepare(fleet, work / "emu", images=tags, device_args=("--keep-running",), sign=True)
    (device,) = emu.devices
    lim = emu.limits[device]
    rate_bps = lim["downlink_kbit"] * 1000
    runs: list[dict[str, Any]] = []
    try:
        lifecycle.start(emu, client, online_timeout=1800)
        code = lifecycle.wait_exited(emu, client, "coordinator", timeout=3600)
        if code != 0:
            raise SystemExit(status.logs(emu, client, "coordinator", tail=30))
        container = emu.containers(client)[device]
        broker_ip = lifecycle.broker_address(emu, client)
        for version in range(1, args.repeats + 1):
            before = ingress_bytes(container)
            run = deploy(emu, broker_ip, model, version, device, work / f"status-{version}.json")
            after = ingress_bytes(container)
            dl = (run["status"] or {}).get("download") or {}
            if not dl:  # no download figure: the device never had the whole package
                raise SystemExit(f"version {version}: no download reported: {run['status']}")
            expected = dl["bytes"] * 8 / rate_bps
            run.update(version=version, state=run["status"].get("state"), package_bytes=dl["bytes"],
                       received_bytes=dl["bytes_received"],
                       download_s=dl["seconds"], expected_s=expected, ratio=dl["seconds"] / expected,
                       ratio_received=dl["seconds"] / (dl["bytes_received"] * 8 / rate_bps),
                       shaped_bytes=(after - before) if before is not None and after is not None else None,
                       ok=dl["seconds"] <= TARGET_RATIO * expected)
            runs.append(run)
            print(f"version {version}: {dl['bytes']:,} bytes in {dl['seconds']:.1f} s "
                  f"(bytes / rate {expected:.1f} s, x{run['ratio']:.2f}); {run['state']}", file=sys.stderr)
        device_log = status.logs(emu, client, device, tail=40)
    finally:
        lifecycle.down(emu)
    result = {
        "command": "python -m benchmarks.ota_emulate " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(), "profile": args.profile, "model_arch": args.model_arch, "quant": args.quant,
        "model_dir_bytes": model_bytes, "device": device, "cpus": lim["cpus"], "downlink_kbit": lim["downlink_kbit"],
        "uplink_kbit": lim["uplink_kbit"], "delay_ms": lim["delay_ms"], "project": emu.project,
        "images": tags.device, "target_ratio": TARGET_RATIO, "runs": runs, "device_log_tail": device_log,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'version':>7} {'package B':>11} {'shaped B':>11} {'download s':>10} {'bytes/rate s':>12} {'ratio':>6} "
          f"{'order->final s':>14}  state")
    for r in runs:
        print(f"{r['version']:>7} {r['package_bytes']:>11,} {r['shaped_bytes'] or 0:>11,} {r['download_s']:>10.1f} "
              f"{r['expected_s']:>12.1f} {r['ratio']:>6.2f} {r['order_to_final_s'] or float('nan'):>14.1f}  "
              f"{r['state']}")
    print(f"{args.model_arch} {args.quant} to {args.profile} (downlink {lim['downlink_kbit']} kbit/s, cpus "
          f"{lim['cpus']:g}); target: download <= {TARGET_RATIO} x bytes / rate: "
          f"{'met' if all(r['ok'] for r in runs) else 'NOT met'}")
    print(f"load average (1/5/15 min) at start {result['loadavg_start']}, at end {result['loadavg_end']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
