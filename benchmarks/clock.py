"""The speed model's size curve and the sampling target of issue 27 (figures for docs/results.md, not tests).

``curve``: how much of a core's GEMM rate training the zoo's tiers reaches, per SIMD width. One thread of
this host trains each tier at each batch (training MACs per CPU second, as ``fedge emulate`` calibrates,
:func:`fedge.emulate.calibrate.host_mac_rate`) and multiplies two 512 x 512 fp32 matrices; the ratio is
the fraction of the GEMM rate the tier reaches. Each SIMD width is measured in a child process whose
oneDNN, MKL and ATen kernels are limited to that width (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``,
``ATEN_CPU_CAPABILITY``): 4 fp32 lanes (SSE4.1, the width of ARM's 128-bit NEON) and 8 (AVX2). The
median over ``--repeats`` runs is what :data:`fedge.profiles.speed.SIZE_CURVE` holds.

``order``: every built-in profile's speed-model rate on its own plan (model and batch), next to the published
figure behind it, and the CPU quota ``fedge emulate`` gives it on this host (the host's rate measured as
``fedge emulate up`` measures it): the issue's "the emulation's CPU quotas follow the published order", without
Docker.

``honest``: issue 27's "the clock is honest" target, on the Docker-emulated 3-profile fleet (N100 gateway, Pi 4,
Pi Zero 2 W): each device's measured time per round (its ``train_s`` in the coordinator's reports, under its CPU
quota) against the virtual clock's compute time for the same rounds, and each round's wall time against the clock's
round, both within 0.67-1.5x. The same reports timed by :func:`fedge.sim.clocked.replay_clock`.

``deployed``: the same devices as ``honest``, each deployed on this host without a quota (``fedge coordinator
run`` and ``fedge edge run`` on one thread over a Mosquitto on loopback): the device process's CPU seconds per round
(the difference between a long and a short run, from ``/proc``) against what the virtual clock's compute time for
that round is in host CPU seconds (× the device's speed-model rate ÷ the host core's measured rate on its model, as
``fedge emulate`` sets its quota). What the clock's model misses on the host itself, with no CFS quota in between.

``sampling``: 10 % of a 200-device fleet per round against full participation at equal device compute
(the same number of device-rounds of training), accuracy and bytes per round.

    python -m benchmarks.clock curve [--repeats 3]
    python -m benchmarks.clock order                      # the built-ins' speeds and their emulation quotas
    python -m benchmarks.clock sampling [--devices 200] [--sample 0.1] [--rounds 3] [--equal-rounds]
    python -m benchmarks.clock honest [--rounds 4]        # needs Docker: emulated time vs the virtual clock
    python -m benchmarks.clock deployed [--rounds 2 12]   # needs Mosquitto: a deployed device's CPU vs the clock

Writes benchmarks/results/clock-curve.json / clock-sampling.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, text_table

# SIMD width (fp32 lanes) -> the environment that limits torch's kernels to it.
ISA_ENV: dict[int, dict[str, str]] = {
    4: {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
    8: {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
BATCHES = (8, 16, 32, 64)


def gemm_rate(n: int = 512, seconds: float = 1.5) -> float:
    """fp32 multiply-accumulates per CPU second of one thread multiplying n x n matrices."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    steps, t0 = 0, time.process_time()
    while (elapsed := time.process_time() - t0) < seconds or steps < 3:
        a @ b
        steps += 1
    return n**3 * steps / elapsed


def measure_once(seconds: float) -> dict[str, Any]:
    """One run in this process: the GEMM rate and every tier's training rate at every batch."""
    from fedge.common.archs import TIERS
    from fedge.emulate.calibrate import host_mac_rate

    gemm = gemm_rate(seconds=seconds)
    rates = {f"tier-{t}@{b}": host_mac_rate(f"tier-{t}", b, seconds=seconds) for t in TIERS for b in BATCHES}
    gemm = (gemm + gemm_rate(seconds=seconds)) / 2  # before and after: the host's load drifts
    return {"gemm_mac_s": gemm, "train_mac_s": rates, "fraction": {k: r / gemm for k, r in rates.items()}}


def curve(repeats: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": repeats, "seconds": seconds, "widths": {}}
    for lanes, env in ISA_ENV.items():
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-m", "benchmarks.clock", "_once", "--seconds", str(seconds)],
                                  env={**os.environ, **env}, capture_output=True, text=True, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        keys = runs[0]["fraction"]
        out["widths"][str(lanes)] = {
            "env": env,
            "gemm_gmac_s": [r["gemm_mac_s"] / 1e9 for r in runs],
            "fraction": {k: round(statistics.median(r["fraction"][k] for r in runs), 3) for k in keys},
        }
    return out


def print_curve(res: dict[str, Any]) -> None:
    from fedge.common.archs import TIERS

    for lanes, w in res["widths"].items():
        gemm = ", ".join(f"{g:.1f}" for g in w["gemm_gmac_s"])
        print(f"\n{lanes} fp32 lanes ({w['env']['ONEDNN_MAX_CPU_ISA']}); GEMM {gemm} GMAC/s per core")
        rows = [[f"tier-{t}", *(f"{w['fraction'][f'tier-{t}@{b}']:.3f}" for b in BATCHES)] for t in TIERS]
        print(text_table(["model", *(f"batch {b}" for b in BATCHES)], rows))


PROFILES = ("rpi-zero-2w", "rpi4-4gb", "rpi5-8gb", "x86-gateway")


def sampling_config(devices: int, rounds: int, sample: float | None, seed: int, fraction: float) -> dict[str, Any]:
    """A FedAvg fleet of ``devices`` tier-xs devices over four profiles (one averaging group) on Fashion-MNIST."""
    per, extra = divmod(devices, len(PROFILES))
    groups = [{"profile": p, "count": per + (i < extra), "arch": "tier-xs"} for i, p in enumerate(PROFILES)]
    cfg: dict[str, Any] = {
        "run": {"method": "fedavg", "rounds": rounds, "dataset": "fmnist", "seed": seed, "eval_every": rounds,
                "name": f"sampling-{sample or 'full'}"},
        "partition": {"kind": "dirichlet", "alpha": 0.5, "fraction": fraction},
        "train": {"lr": 0.05, "batch_size": 16, "local_epochs": 1, "min_tail": 1, "val_fraction": 0.0,
                  "lr_schedule": "constant"},
        "devices": [g for g in groups if g["count"]],
    }
    if sample is not None:
        cfg["coordinator"] = {"sample": sample, "selection": "balanced"}
    return cfg


def sampling_run(devices: int, rounds: int, sample: float | None, seed: int, fraction: float,
                 eval_images: int) -> dict[str, Any]:
    """One run: the final global model's accuracy on the whole test set, bytes and virtual time per round."""
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.training import accuracy
    from fedge.fleet.config import parse_fleet
    from fedge.fleet.devices import show_global_test
    from fedge.sim.simulate import build_fleet, run_timed

    torch.set_num_threads(1)
    cfg = parse_fleet(sampling_config(devices, rounds, sample, seed, fraction), source="benchmarks/clock.py")
    t0 = time.perf_counter()
    fleet, strat = build_fleet(cfg)
    test = load_dataset("fmnist", train=False)
    # the devices' own evaluations (every device, final round) see a slice of the test set; the global model is
    # scored once below on all of it
    small = test.subset(np.arange(min(eval_images, len(test))))
    show_global_test(fleet, small)
    _, reports, clock = run_timed(cfg, fleet, strat)
    assert clock is not None  # in-process: always timed
    model = fleet[0].method.ctx.model  # after the final round every device holds the final global model
    acc = accuracy(model, test.x, test.y)
    training = [r for r in reports if r.phase != "final"]
    per_round = [sum(r.bytes_up.values()) + sum(r.bytes_down.values()) for r in training]
    return {
        "devices": devices, "rounds": rounds, "sample": sample, "seed": seed, "fraction": fraction,
        "device_rounds": sum(len(r.accepted) for r in training),
        "final_acc_global": acc, "bytes_per_round": statistics.fmean(per_round),
        "bytes_up_per_round": statistics.fmean(sum(r.bytes_up.values()) for r in training),
        "virtual_s": clock.now, "virtual_s_per_round": clock.now / max(1, len(clock.rounds)),
        "wall_s": time.perf_counter() - t0,
    }


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """Full participation for ``rounds`` rounds against ``sample`` of the fleet for rounds / sample rounds."""
    sampled_rounds = round(args.rounds / args.sample)
    common = {"devices": args.devices, "seed": args.seed, "fraction": args.fraction, "eval_images": args.eval_images}
    full = sampling_run(rounds=args.rounds, sample=None, **common)
    part = sampling_run(rounds=sampled_rounds, sample=args.sample, **common)
    out = {"full": full, "sampled": part,
           "acc_diff_points": 100 * (part["final_acc_global"] - full["final_acc_global"]),
           "bytes_ratio": part["bytes_per_round"] / full["bytes_per_round"]}
    if args.equal_rounds:  # full participation for as many rounds as the sampled run: 1 / sample times the compute
        same = sampling_run(rounds=sampled_rounds, sample=None, **common)
        out["full_equal_rounds"] = same
        out["acc_diff_equal_rounds_points"] = 100 * (part["final_acc_global"] - same["final_acc_global"])
    return out


def print_sampling(res: dict[str, Any]) -> None:
    rows = []
    for name in ("full", "sampled", "full_equal_rounds"):
        if name not in res:
            continue
        r = res[name]
        rows.append([name, f"{r['sample'] or 1.0:g}", str(r["rounds"]), str(r["device_rounds"]),
                     f"{100 * r['final_acc_global']:.1f}", f"{r['bytes_per_round'] / 1024:,.0f}",
                     f"{r['virtual_s']:.1f}", f"{r['wall_s']:.0f}"])
    print(text_table(["run", "sample", "rounds", "device-rounds", "acc %", "KiB/round", "virtual s", "wall s"], rows))
    print(f"sampled - full: {res['acc_diff_points']:+.1f} points; bytes per round x{res['bytes_ratio']:.3f}")
    if "full_equal_rounds" in res:
        print(f"sampled - full at equal rounds: {res['acc_diff_equal_rounds_points']:+.1f} points")


ORDER = ("rpi-zero-2w", "rpi3b", "jetson-nano", "rpi4-2gb", "rpi4-4gb", "rpi5-8gb", "x86-gateway")


COMMON = ("tier-m", 64)  # one model for every profile: quotas then compare devices, not models


def order(seconds: float) -> dict[str, Any]:
    """Each built-in profile alone in a fleet: its plan, the speed model's rate and the emulation quota on this host,
    on its own plan and on one common model (each host rate measured once, as `fedge emulate up` caches it)."""
    import dataclasses

    from fedge.common.archs import arch_by_name
    from fedge.emulate.calibrate import calibrate
    from fedge.emulate.limits import device_plans, limits_for
    from fedge.fleet.config import parse_fleet
    from fedge.profiles.speed import speed_model

    plans = []
    for name in ORDER:
        cfg = parse_fleet({"run": {"method": "fedproto", "rounds": 1}, "devices": [{"profile": name}]})
        plans.append(device_plans(cfg, {f"{name}-1": 600})[0])
    host = calibrate({(p.arch, p.batch_size) for p in plans} | {COMMON}, embed_dim=64, seconds=seconds)
    rows = []
    for dp in plans:
        s = speed_model(dp.profile)
        common_rate = s.mac_rate(arch_by_name(COMMON[0], embed_dim=64), COMMON[1])
        common = dataclasses.replace(dp, arch=COMMON[0], batch_size=COMMON[1], mac_rate=common_rate)
        rows.append({"profile": dp.profile.name, "uarch": s.uarch.name, "source": s.uarch.source, "arch": dp.arch,
                     "batch": dp.batch_size, "device_gmac_s": dp.mac_rate / 1e9, "round_s": dp.round_time_s,
                     "host_gmac_s": host[(dp.arch, dp.batch_size)] / 1e9,
                     "cpus": limits_for(dp, host[(dp.arch, dp.batch_size)], host_cores=64).cpus_wanted,
                     "common_device_gmac_s": common_rate / 1e9,
                     "common_cpus": limits_for(common, host[COMMON], host_cores=64).cpus_wanted})
    return {"seconds": seconds, "common": f"{COMMON[0]}@{COMMON[1]}",
            "host_gmac_s": {f"{a}@{b}": r / 1e9 for (a, b), r in host.items()}, "profiles": rows}


def print_order(res: dict[str, Any]) -> None:
    rows = [[r["profile"], r["uarch"], f"{r['arch']}@{r['batch']}", f"{r['device_gmac_s']:.2f}",
             f"{r['round_s']:.1f}", f"{r['host_gmac_s']:.2f}", f"{r['cpus']:.3f}", f"{r['common_device_gmac_s']:.2f}",
             f"{r['common_cpus']:.3f}"] for r in res["profiles"]]
    common = res["common"]
    print(text_table(["profile", "core", "plan", "device GMAC/s", "round s", "host GMAC/s", "cpus",
                      f"{common} GMAC/s", f"{common} cpus"], rows))


HONEST_FLEET = """
[run]
method = "fedproto"
rounds = {rounds}
dataset = "{dataset}"
fleet = "{fleet}"
seed = 0
eval_every = {eval_every}

[partition]
fraction = {fraction}

[train]
lr = 0.1  # the figures were measured before issue 45 changed the defaults: pinned
lr_schedule = "constant"
local_epochs = {epochs}
min_tail = 1
val_fraction = 0.0
{devices}"""
HONEST_PROFILES = ("x86-gateway", "rpi4-4gb", "rpi-zero-2w")
HONEST_BAND = (0.67, 1.5)


def honesty(cfg: Any, reports: list[Any]) -> dict[str, Any]:
    """Measured against virtual, per device and round: the device's own ``train_s`` (apply, evaluate, train
    under its quota) over the clock's compute time, and each round's wall seconds over the clock's round."""
    from fedge.fleet.clock import fleet_clock
    from fedge.fleet.slots import checked_slots
    from fedge.sim.clocked import replay_clock

    clock = replay_clock(fleet_clock(cfg, checked_slots(cfg)), reports)
    timed = {r.round: r for r in clock.rounds}
    devices: dict[str, list[float]] = {}
    seconds: dict[str, list[tuple[float, float]]] = {}  # (measured, virtual) per round
    rounds = []
    for rep in reports:
        vr = timed.get(rep.round)
        if vr is None:  # the final evaluation: no training to compare
            continue
        for dev, t in rep.train_s.items():
            v = vr.devices[dev].compute_s
            devices.setdefault(dev, []).append(t / v)
            seconds.setdefault(dev, []).append((t, v))
        rounds.append({"round": rep.round, "measured_s": rep.seconds, "virtual_s": vr.seconds,
                       "ratio": rep.seconds / vr.seconds if vr.seconds else None})
    lo, hi = HONEST_BAND
    per_device = {d: {"ratios": r, "seconds": seconds[d], "median": statistics.median(r),
                      "ok": lo <= statistics.median(r) <= hi} for d, r in devices.items()}
    return {"devices": per_device, "rounds": rounds, "band": HONEST_BAND}


def honest(rounds: int, work: str, *, dataset: str = "digits", fraction: float = 0.3,
           eval_every: int = 1, epochs: int = 2, profiles: tuple[str, ...] = HONEST_PROFILES) -> dict[str, Any]:
    """Run the 3-profile fleet (or ``profiles`` only, one device each) in Docker (``fedge emulate``) and compare it
    with the virtual clock."""
    from pathlib import Path

    from fedge.coordinator.store import REPORTS_FILE, read_reports
    from fedge.emulate import discovery, images, lifecycle, status
    from fedge.fleet.config import load_fleet

    client = discovery.docker_client()
    tags = images.ensure_images(client, "amd64")
    out = Path(work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    fleet = out / "honest.toml"
    fleet.write_text(HONEST_FLEET.format(fleet="honest", rounds=rounds, dataset=dataset, fraction=fraction,
                                        eval_every=eval_every, epochs=epochs,
                                        devices="".join(f'\n[[devices]]\nprofile = "{p}"\n' for p in profiles)))
    emu = lifecycle.prepare(fleet, out / "emu", images=tags, device_args=("--keep-running",))
    t0 = time.perf_counter()
    try:
        lifecycle.start(emu, client, online_timeout=1800)
        code = lifecycle.wait_exited(emu, client, "coordinator", timeout=7200)
        if code != 0:
            raise SystemExit(status.logs(emu, client, "coordinator", tail=30))
        reports = read_reports(emu.out / "coordinator" / REPORTS_FILE)
    finally:
        lifecycle.down(emu)
    res = honesty(load_fleet(fleet), reports)
    return {"rounds": rounds, "dataset": dataset, "fraction": fraction, "eval_every": eval_every, "epochs": epochs,
            "profiles": list(profiles),
            "wall_s": time.perf_counter() - t0, "limits": emu.limits, **res}


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _deployed_cpu(fleet: Any, device_id: str, port: int, work: Any) -> float:
    """Run ``fleet`` with a coordinator and one device process on this host; the device's CPU seconds at the end."""
    state = work / f"state-{fleet.stem}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    broker = f"mqtt://127.0.0.1:{port}"
    with open(work / f"{fleet.stem}-coordinator.log", "w") as clog, open(work / f"{fleet.stem}-edge.log", "w") as elog:
        coord = subprocess.Popen([sys.executable, "-m", "fedge", "coordinator", "run", "--config", str(fleet),
                                  "--state-dir", str(state), "--broker", broker], stdout=clog, stderr=clog)
        edge = subprocess.Popen([sys.executable, "-m", "fedge", "edge", "run", "--config", str(fleet), "--device-id",
                                 device_id, "--broker", broker, "--keep-running", "--heartbeat", "0"], env=env,
                                stdout=elog, stderr=elog)
    try:
        if coord.wait(timeout=1800) != 0:
            raise SystemExit(f"the coordinator of {fleet} failed: see {work / f'{fleet.stem}-coordinator.log'}")
        time.sleep(0.5)
        return _proc_cpu_s(edge.pid)
    finally:
        for p in (edge, coord):
            p.kill()
            p.wait()


def deployed(rounds: tuple[int, int], work: str, *, fraction: float = 0.3, eval_every: int = 1, epochs: int = 2,
             profiles: tuple[str, ...] = HONEST_PROFILES) -> dict[str, Any]:
    """Each profile's device deployed alone on this host: CPU per round against the clock in host CPU seconds."""
    import shutil
    import socket
    from pathlib import Path

    from fedge.emulate.calibrate import host_mac_rate
    from fedge.fleet.clock import fleet_clock
    from fedge.fleet.config import load_fleet
    from fedge.fleet.slots import checked_slots, device_profile
    from fedge.profiles.speed import speed_model

    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    out = Path(work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = out / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n")
    broker = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res: dict[str, Any] = {"rounds": list(rounds), "fraction": fraction, "eval_every": eval_every, "epochs": epochs,
                           "devices": {}}
    try:
        time.sleep(0.5)
        for profile in profiles:
            cpu = []
            for r in rounds:
                fleet = out / f"{profile}-r{r}.toml"
                fleet.write_text(HONEST_FLEET.format(fleet=f"deployed-{profile}-r{r}", rounds=r, dataset="digits",
                                                    fraction=fraction, eval_every=eval_every, epochs=epochs,
                                                    devices=f'\n[[devices]]\nprofile = "{profile}"\n'))
                cfg = load_fleet(fleet)
                (slot,) = checked_slots(cfg)
                cpu.append(_deployed_cpu(fleet, slot.device_id, port, out))
            # the clock's compute for the rounds the long run has beyond the short one
            dev = fleet_clock(cfg, [slot]).devices[slot.device_id]
            virtual = [dev.train_s(n) for n in range(rounds[0] + 1, rounds[1] + 1)]
            device_rate = speed_model(device_profile(cfg, slot.group)).mac_rate(slot.spec, dev.work.batch)
            host_rate = host_mac_rate(slot.spec.name, dev.work.batch, embed_dim=cfg.run.embed_dim)
            per_round = (cpu[1] - cpu[0]) / (rounds[1] - rounds[0])
            model = statistics.mean(virtual) * device_rate / host_rate
            res["devices"][slot.device_id] = {
                "arch": slot.spec.name, "batch": dev.work.batch, "cpu_s": cpu, "cpu_per_round_s": per_round,
                "virtual_per_round_s": statistics.mean(virtual), "host_mac_rate": host_rate,
                "device_mac_rate": device_rate, "model_host_s": model, "ratio": per_round / model}
    finally:
        broker.kill()
        broker.wait()
    return res


def print_deployed(res: dict[str, Any]) -> None:
    rows = [[d, f"{v['arch']}@{v['batch']}", f"{v['cpu_per_round_s']:.3f}", f"{v['virtual_per_round_s']:.2f}",
             f"{v['model_host_s']:.3f}", f"{v['ratio']:.2f}"] for d, v in res["devices"].items()]
    print(text_table(["device", "model", "CPU s per round (deployed)", "clock s per round",
                      "clock in host CPU s", "deployed / clock"], rows))


def print_honest(res: dict[str, Any]) -> None:
    rows = [[d, ", ".join(f"{x:.2f}" for x in v["ratios"]),
             ", ".join(f"{m:.1f}/{s:.1f}" for m, s in v.get("seconds", [])), f"{v['median']:.2f}",
             "yes" if v["ok"] else "NO"] for d, v in res["devices"].items()]
    print(text_table(["device", "measured / virtual per round", "seconds (measured/virtual)", "median",
                      "in 0.67-1.5"], rows))
    print("rounds (wall / virtual): " + ", ".join(f"{r['round']}: {r['ratio']:.2f}" for r in res["rounds"]
                                                   if r["ratio"] is not None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.clock", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("curve", help="the size curve of the speed model")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--seconds", type=float, default=1.5)
    od = sub.add_parser("order", help="the built-ins' speeds and their emulation CPU quotas on this host")
    od.add_argument("--seconds", type=float, default=1.5, help="CPU seconds of each host calibration")
    hp = sub.add_parser("honest", help="the Docker-emulated fleet's time per round vs the virtual clock (Docker)")
    hp.add_argument("--rounds", type=int, default=4)
    hp.add_argument("--work", default="runs/bench-clock-honest")
    hp.add_argument("--dataset", default="digits",
                    help="digits (default; the device images hold no Fashion-MNIST)")
    hp.add_argument("--fraction", type=float, default=0.3, help="share of the training set the 3 devices split")
    hp.add_argument("--eval-every", type=int, default=1, help="rounds between the devices' evaluations")
    hp.add_argument("--epochs", type=int, default=2, help="local epochs per round")
    hp.add_argument("--profiles", nargs="+", default=list(HONEST_PROFILES), metavar="PROFILE",
                    help="the devices, one per profile (default: x86 gateway, Pi 4, Pi Zero 2 W); one alone shows "
                         "its quota without the others competing for the host's cores")
    dp = sub.add_parser("deployed", help="each device deployed on this host without a quota: CPU per round vs the "
                                         "clock (needs Mosquitto)")
    dp.add_argument("--rounds", type=int, nargs=2, default=[2, 12], metavar=("SHORT", "LONG"),
                    help="the two runs whose difference is timed")
    dp.add_argument("--work", default="runs/bench-clock-deployed")
    dp.add_argument("--fraction", type=float, default=0.3)
    dp.add_argument("--eval-every", type=int, default=1)
    dp.add_argument("--epochs", type=int, default=2)
    dp.add_argument("--profiles", nargs="+", default=list(HONEST_PROFILES), metavar="PROFILE")
    sp = sub.add_parser("sampling", help="10 % of the fleet per round vs full participation at equal device compute")
    sp.add_argument("--devices", type=int, default=200)
    sp.add_argument("--sample", type=float, default=0.1)
    sp.add_argument("--rounds", type=int, default=3, help="rounds of full participation (sampled: rounds / sample)")
    sp.add_argument("--fraction", type=float, default=0.2, help="share of Fashion-MNIST's training set used")
    sp.add_argument("--eval-images", type=int, default=500, help="test images each device evaluates on")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--equal-rounds", action="store_true",
                    help="also run full participation for as many rounds as the sampled run (1 / sample the compute)")
    o = sub.add_parser("_once", help=argparse.SUPPRESS)
    o.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args(argv)
    if args.what == "_once":
        print(json.dumps(measure_once(args.seconds)))
        return 0
    if args.what == "curve":
        res = curve(args.repeats, args.seconds)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "clock-curve.json").write_text(json.dumps(res, indent=1))
        print_curve(res)
    if args.what == "order":
        res = order(args.seconds)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "clock-order.json").write_text(json.dumps(res, indent=1))
        print_order(res)
    if args.what == "honest":
        res = honest(args.rounds, args.work, dataset=args.dataset, fraction=args.fraction, eval_every=args.eval_every,
                     epochs=args.epochs, profiles=tuple(args.profiles))
        RESULTS.mkdir(parents=True, exist_ok=True)
        default = (args.dataset, args.fraction, args.eval_every, args.epochs) == ("digits", 0.3, 1, 2)
        name = "clock-honest" + ("" if default else
                                 f"-{args.dataset}-f{args.fraction:g}-e{args.eval_every}-ep{args.epochs}")
        name += "" if tuple(args.profiles) == HONEST_PROFILES else "-" + "-".join(args.profiles)
        (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        print_honest(res)
    if args.what == "deployed":
        res = deployed((args.rounds[0], args.rounds[1]), args.work, fraction=args.fraction,
                       eval_every=args.eval_every, epochs=args.epochs, profiles=tuple(args.profiles))
        RESULTS.mkdir(parents=True, exist_ok=True)
        default = (args.fraction, args.eval_every, args.epochs) == (0.3, 1, 2)
        name = "clock-deployed" + ("" if default else f"-f{args.fraction:g}-e{args.eval_every}-ep{args.epochs}")
        (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1))
        print_deployed(res)
    if args.what == "sampling":
        res = sampling(args)
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"clock-sampling-n{args.devices}-s{args.seed}{'-eq' if args.equal_rounds else ''}.json"
        out.write_text(json.dumps({"args": vars(args), **res}, indent=1))
        print_sampling(res)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
