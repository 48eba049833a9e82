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
5. with ``--rotate``, rotates the fleet key (``fedge broker rotate-fleet-key``) before every deploy after the
   first: ``fedge deploy`` signs with the new key and publishes the key chain, and the device must follow it
   (its ``/var/lib/fedge/fleet-key.json`` is read back) to install the version;

and compares each download's time with bytes x 8 / the profile's downlink rate.

    python -m benchmarks.ota_emulate [--profile rpi-zero-2w] [--model-arch tier-xl] [--quant fp32] [--repeats 2]
                                     [--rotate]

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


def memory(container: Any) -> dict[str, Any]:
    """The device container's memory: the agent's (PID 1) resident, anonymous (its heap: what the kernel cannot
    reclaim) and peak resident MiB, the cgroup's anonymous memory and its usage and peak (page cache included, so
    they sit at the limit once files were read), and whether the kernel killed something for memory (the
    container then exits)."""
    container.reload()
    out: dict[str, Any] = {"state": container.status, "oom_killed": container.attrs["State"].get("OOMKilled")}
    if container.status != "running":
        return out
    names = {"VmRSS": "agent_rss_mb", "VmHWM": "agent_peak_rss_mb", "RssAnon": "agent_anon_mb"}
    code, raw = container.exec_run(["sh", "-c", "grep -E 'VmRSS|VmHWM|RssAnon' /proc/1/status"])
    if code == 0:
        for line in raw.decode().splitlines():
            key, value = line.split(":", 1)
            out[names[key]] = int(value.split()[0]) / 1024
    stats = container.stats(stream=False).get("memory_stats", {})
    out["cgroup_mb"], out["cgroup_peak_mb"] = stats.get("usage", 0) / 2**20, stats.get("max_usage", 0) / 2**20
    inner = stats.get("stats", {})
    out["cgroup_anon_mb"] = inner.get("total_rss", inner.get("anon", 0)) / 2**20
    return out


def device_fleet_key(container: Any) -> str | None:
    """The fleet key the device trusts after a rotation (its state directory's fleet-key.json), or None."""
    code, out = container.exec_run(["cat", "/var/lib/fedge/fleet-key.json"])
    return str(json.loads(out.decode())["key"]) if code == 0 else None


def deploy(emu: Any, broker_ip: str, model: Path, version: int, device: str, status_file: Path,
           container: Any) -> dict[str, Any]:
    """``fedge deploy`` of ``model`` as ``version`` to ``device`` (a child process); its status and wall time.
    Stopped early (``died``) when the device's container stops meanwhile (killed for memory, say)."""
    broker = emu.out / "broker"
    cmd = [sys.executable, "-m", "fedge", "deploy", "--config", str(emu.out / "fleet.toml"), "--model", str(model),
           "--version", str(version), "--devices", device, "--canary", "0", "--threshold", "1",
           "--broker", f"mqtt://{broker_ip}:1883", "--username", "fedge-deploy",
           "--password-file", str(broker / "deploy" / "password"),
           "--signing-key", str(broker / "coordinator" / "signing.key"), "--timeout", "1800",
           "--status-file", str(status_file)]
    t0 = time.perf_counter()
    repo = Path(__file__).resolve().parents[1]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(repo)}) as proc:
        while proc.poll() is None:
            time.sleep(2.0)
            container.reload()
            if container.status != "running":
                proc.terminate()
                proc.wait(30)
                return {"command": " ".join(cmd), "wall_s": time.perf_counter() - t0, "died": container.status,
                        "status": None}
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if not status_file.is_file():  # exit 10 (the device rolled the model back) still writes it
        raise SystemExit(f"fedge deploy failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    report = json.loads(status_file.read_text())
    return {"command": " ".join(cmd), "wall_s": wall, "stdout": stdout.strip(),
            "status": report["statuses"][device], "order_to_final_s": report["seconds"].get(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="rpi-zero-2w")
    ap.add_argument("--model-arch", default="tier-xl")
    ap.add_argument("--quant", default="fp32", help="the exported model's quantization (fp32, fp16, int8-dynamic)")
    ap.add_argument("--repeats", type=int, default=2, help="deployments, versions 1 ... N (default 2)")
    ap.add_argument("--rotate", action="store_true",
                    help="rotate the fleet key before every deploy after the first (the device follows the chain)")
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
            rotated = None
            if args.rotate and version > 1:
                from fedge.broker.fleetkey import rotate_fleet_key

                rotated = rotate_fleet_key(emu.out / "broker", emu.fleet).new
            before = ingress_bytes(container)
            run = deploy(emu, broker_ip, model, version, device, work / f"status-{version}.json", container)
            run["memory"] = memory(container)
            if run["memory"]["state"] != "running":  # recorded, and the end of this run
                run.update(version=version, state=f"device {run['memory']['state']}", ok=False,
                           device_log_tail=status.logs(emu, client, device, tail=10))
                runs.append(run)
                print(f"version {version}: the device's container {run['memory']['state']} (killed for memory: "
                      f"{run['memory']['oom_killed']})", file=sys.stderr)
                break
            after = ingress_bytes(container)
            dl = (run["status"] or {}).get("download") or {}
            if not dl:  # no download figure: the device never had the whole package
                raise SystemExit(f"version {version}: no download reported: {run['status']}")
            expected = dl["bytes"] * 8 / rate_bps
            run.update(version=version, state=run["status"].get("state"), rotated_to=rotated,
                       device_fleet_key=device_fleet_key(container), package_bytes=dl["bytes"],
                       received_bytes=dl["bytes_received"],
                       download_s=dl["seconds"], expected_s=expected, ratio=dl["seconds"] / expected,
                       ratio_received=dl["seconds"] / (dl["bytes_received"] * 8 / rate_bps),
                       shaped_bytes=(after - before) if before is not None and after is not None else None,
                       ok=dl["seconds"] <= TARGET_RATIO * expected)
            runs.append(run)
            if rotated is not None and run["device_fleet_key"] != rotated:
                raise SystemExit(f"version {version}: the device trusts {run['device_fleet_key']}, not the rotated "
                                 f"key {rotated}")
            mem = run["memory"]
            print(f"version {version}: {dl['bytes']:,} bytes in {dl['seconds']:.1f} s "
                  f"(bytes / rate {expected:.1f} s, x{run['ratio']:.2f}); {run['state']}; agent "
                  f"{mem.get('agent_anon_mb', 0):.0f} MiB anonymous, container "
                  f"{mem.get('cgroup_anon_mb', 0):.0f} MiB anonymous of {lim['mem_limit_mb']} MiB"
                  + (f"; the device follows the rotated key {rotated}" if rotated else ""), file=sys.stderr)
        device_log = status.logs(emu, client, device, tail=40)
    finally:
        lifecycle.down(emu)
    result = {
        "command": "python -m benchmarks.ota_emulate " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(), "profile": args.profile, "model_arch": args.model_arch, "quant": args.quant,
        "model_dir_bytes": model_bytes, "device": device, "cpus": lim["cpus"], "downlink_kbit": lim["downlink_kbit"],
        "uplink_kbit": lim["uplink_kbit"], "delay_ms": lim["delay_ms"], "mem_limit_mb": lim["mem_limit_mb"],
        "project": emu.project,
        "images": tags.device, "target_ratio": TARGET_RATIO, "runs": runs, "device_log_tail": device_log,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'version':>7} {'package B':>11} {'shaped B':>11} {'download s':>10} {'bytes/rate s':>12} {'ratio':>6} "
          f"{'order->final s':>14}  state      device's key")
    for r in runs:
        if "download_s" not in r:
            print(f"{r['version']:>7} {r['state']} (killed for memory: {r['memory'].get('oom_killed')})")
            continue
        print(f"{r['version']:>7} {r['package_bytes']:>11,} {r['shaped_bytes'] or 0:>11,} {r['download_s']:>10.1f} "
              f"{r['expected_s']:>12.1f} {r['ratio']:>6.2f} {r['order_to_final_s'] or float('nan'):>14.1f}  "
              f"{r['state']:<10} {r['device_fleet_key'] or 'bundle'}{' (rotated)' if r['rotated_to'] else ''}")
    print(f"{args.model_arch} {args.quant} to {args.profile} (downlink {lim['downlink_kbit']} kbit/s, cpus "
          f"{lim['cpus']:g}); target: download <= {TARGET_RATIO} x bytes / rate: "
          f"{'met' if runs and all(r['ok'] for r in runs) else 'NOT met'}")
    print(f"load average (1/5/15 min) at start {result['loadavg_start']}, at end {result['loadavg_end']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
