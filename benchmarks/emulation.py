"""How faithfully a Docker container behaves like its profile (not a test: figures for docs/results.md).

Per profile, a one-device FedProto fleet runs alone in Docker (so no other device competes for the
host's cores) and is measured against the planner:

* round time: the mean training round minus the final (evaluation-only) round, both as the
  coordinator measured them, against the planner's estimate of local training (target 0.67-1.5);
* upload: one full-model update of the plan's size and precision published from inside the
  container with QoS 1 and timed from the first publish to the last PUBACK (the payload is made
  before the clock starts; nothing is encoded), against bytes x 8 / uplink rate (target within
  20 %). Decomposed (:func:`upload_decomposition`): the same upload with a 4 MiB socket send buffer,
  and with the CPU quota lifted (the wire part), each with the CPU seconds and throttled CFS
  periods it took;
* memory: the agent's peak RSS (VmHWM of PID 1) and the cgroup's peak usage, against the planner's
  runtime share plus training estimate.

``--arm64`` also runs one profile's fleet with aarch64 device containers under QEMU and compares
the coordinator's final global prototypes with the amd64 run's (and the slowdown).

    python -m benchmarks.emulation [--profiles rpi-zero-2w,rpi4-4gb,x86-gateway] [--arm64 rpi4-4gb]

Writes benchmarks/results/emulation.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from fedge.common.archs import tier_arch
from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.emulate import discovery, faults, images, lifecycle, status
from fedge.emulate.limits import OS_SHARE_MB
from fedge.profiles import load_profile
from fedge.profiles.planner import UPLOAD_BYTES
from fedge.profiles.schema import RUNTIME_RESERVE_MB
from fedge.profiles.speed import speed_model

FLEET = """
[run]
method = "fedproto"
rounds = {rounds}
dataset = "digits"
fleet = "bench"
seed = 0

[partition]
fraction = {fraction}

[[devices]]
profile = "{profile}"
count = {count}
"""

UPLOAD_SNIPPET = r"""
import json, socket, sys, time, tomllib
from pathlib import Path
from fedge.mqtt.client import new_paho_client, no_delay

def cg():  # cgroup v1 (cpu, cpuacct controllers), else v2
    for f in ("/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu.stat"):
        if Path(f).is_file():
            st = dict(line.split() for line in Path(f).read_text().splitlines())
            break
    acct = Path("/sys/fs/cgroup/cpuacct/cpuacct.usage")
    return {"periods": int(st.get("nr_periods", 0)), "throttled": int(st.get("nr_throttled", 0)),
            "throttled_s": (int(st["throttled_time"]) / 1e9 if "throttled_time" in st
                            else int(st.get("throttled_usec", 0)) / 1e6),
            "usage_s": int(acct.read_text()) / 1e9 if acct.is_file() else int(st.get("usage_usec", 0)) / 1e6}

b = Path("/etc/fedge/bundle")
conf = tomllib.loads((b / "bundle.toml").read_text())
host = conf["broker"].split("://")[1].split(":")[0]
n, sndbuf, old = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "old"
c = new_paho_client(conf["device_id"] + "-bench", clean_session=True)
c.username_pw_set(conf["username"], (b / "password").read_text().strip())
sends = []  # (time the send returned, bytes handed to the kernel)
raw_send = c._sock_send
def counted(buf):
    k = raw_send(buf)
    sends.append((time.perf_counter(), k))
    return k
c._sock_send = counted
if not old:
    c.on_socket_open = no_delay  # the agent's socket options and in-flight window (fedge.mqtt.client.MqttClient)
    c.max_inflight_messages_set(100)
c.connect(host, 1883, keepalive=120)
if sndbuf:
    c.socket().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
sndbuf_effective = c.socket().getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
c.loop_start()
# In chunks below the broker's max_packet_size (fedge's agent chunks its uploads the same way), QoS 1.
chunk = 128 * 1024
if old:
    # The timer of the first version of this benchmark: the clock starts as soon as the network thread
    # is started, before the broker's CONNACK, and the payload is made inside it.
    cg0, p0 = cg(), time.process_time()
    t_prep = t0 = time.perf_counter()
    payloads = (bytes(min(chunk, n - i)) for i in range(0, n, chunk))
else:
    # On an established connection (as the agent's upload is), the payload made before the clock starts
    # (nothing to encode: zeros); the clock runs from the first publish to the last PUBACK.
    time.sleep(0.5)  # CONNACK
    t_prep = time.perf_counter()
    payloads = [bytes(min(chunk, n - i)) for i in range(0, n, chunk)]
    sends.clear()
    cg0, p0 = cg(), time.process_time()
    t0 = time.perf_counter()
infos = [c.publish("fedge/bench/devices/%s/bench" % conf["device_id"], p, qos=1) for p in payloads]
for info in infos:
    info.wait_for_publish(timeout=600)
dt = time.perf_counter() - t0
cpu, cg1 = time.process_time() - p0, cg()
data = [(t, k) for t, k in sends if k > 0]  # before the DISCONNECT
c.loop_stop(); c.disconnect()
print(json.dumps({"bytes": n, "seconds": dt, "prep_s": t0 - t_prep, "sndbuf": sndbuf,
                  "sndbuf_effective": sndbuf_effective, "process_cpu_s": cpu,
                  "cgroup_cpu_s": cg1["usage_s"] - cg0["usage_s"],
                  "periods": cg1["periods"] - cg0["periods"], "throttled_periods": cg1["throttled"] - cg0["throttled"],
                  "throttled_s": cg1["throttled_s"] - cg0["throttled_s"], "send_calls": len(data),
                  "last_send_s": (data[-1][0] - t0) if data else None}))
"""


FORWARD_SNIPPET = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
from fedge.edge.models.zoo import build_model
torch.set_num_threads(1)
arch, embed_dim, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state, inp = load_file("/probe/weights.safetensors"), load_file("/probe/inputs.safetensors")
m = build_model(arch, embed_dim=embed_dim)
m.load_state_dict(state)
m.eval()
with torch.no_grad():
    feats = m.features(inp["x"])
    logits = m.head(feats)
protos = torch.stack([feats[inp["y"] == k].mean(0) for k in range(int(inp["y"].max()) + 1)])
out = {"features": feats, "logits": logits, "prototypes": protos}
# Then plain SGD on the same batches in the same order (no shuffling, no randomness): how the arithmetic's
# differences grow with training. The weights' max |diff| after 1 and after 40 steps.
m.train()
opt = torch.optim.SGD(m.parameters(), lr=0.05)
for step in range(1, 41):
    i = (step - 1) % (len(inp["y"]) // 32) * 32
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(inp["x"][i:i + 32]), inp["y"][i:i + 32]).backward()
    opt.step()
    if step in (1, 40):
        out[f"weights_after_{step}_steps"] = torch.cat([p.detach().flatten() for p in m.parameters()])
save_file(out, f"/probe/out-{tag}.safetensors")
print(json.dumps({"torch": torch.__version__}))
"""


def forward_probe(client: Any, device_images: dict[str, str], work: Path, *, arch: str, embed_dim: int = 64,
                  n: int = 256) -> dict[str, Any]:
    """Kernel float differences alone: one set of weights (seed 0, untrained) and one batch of digits
    test images, written on the host, run through the extractor (features, logits, per-class mean
    features = prototypes) in a device container of each architecture. No training, so any difference
    is the arithmetic (torch version, NEON vs AVX kernels), not a diverged optimisation. Then 40 plain
    SGD steps on the same batches in the same order, to see how training grows that difference."""
    import torch
    from safetensors.torch import load_file, save_file

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.zoo import build_model

    d = work / "forward-probe"
    d.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, embed_dim=embed_dim, seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "weights.safetensors"))
    test = load_dataset("digits", train=False)
    save_file({"x": torch.from_numpy(test.x[:n]).contiguous(), "y": torch.from_numpy(test.y[:n]).contiguous()},
              str(d / "inputs.safetensors"))
    outs: dict[str, dict[str, np.ndarray]] = {}
    versions = {}
    for a, image in device_images.items():
        t0 = time.perf_counter()
        raw = client.containers.run(image, entrypoint=["/opt/fedge/venv/bin/python", "-c", FORWARD_SNIPPET],
                                    command=[arch, str(embed_dim), a],
                                    volumes={str(d): {"bind": "/probe", "mode": "rw"}},
                                    network_disabled=True, remove=True, nano_cpus=10**9)
        versions[a] = {**json.loads(raw.decode().strip().splitlines()[-1]), "seconds": time.perf_counter() - t0}
        outs[a] = {k: v.numpy() for k, v in load_file(str(d / f"out-{a}.safetensors")).items()}
    ref, other = outs["amd64"], outs["arm64"]
    return {"arch": arch, "images": n, "torch": versions,
            **{f"max_abs_diff_{k}": float(np.max(np.abs(other[k] - ref[k]))) for k in ref},
            **{f"max_rel_diff_{k}": float(np.max(np.abs(other[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref}}


def _vm_hwm_mb(container: Any) -> float | None:
    code, out = container.exec_run(["sh", "-c", "grep VmHWM /proc/1/status"])
    if code != 0:
        return None
    return int(out.split()[1]) / 1024


BIG_SNDBUF = 4 * 2**20


def _upload(c: Any, nbytes: int, sndbuf: int = 0, timer: str = "publish") -> dict[str, Any]:
    code, out = c.exec_run(["/opt/fedge/venv/bin/python", "-c", UPLOAD_SNIPPET, str(nbytes), str(sndbuf), timer])
    if code != 0:
        return {"seconds": float("nan"), "error": out.decode("utf-8", "replace")[-500:]}
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def upload_decomposition(c: Any, nbytes: int, *, host_cores: int) -> dict[str, Any]:
    """One update's upload four ways, in the device container after its run:

    * ``quota``: as the device is (its CPU quota, default socket buffer, the agent's socket options), on
      an established connection, timed from the first publish to the last PUBACK: the benchmark's figure;
    * ``quota_old_timer``: the first version's timer (clock started before the broker's CONNACK, payload
      made inside it, paho's default socket options): what the figures before 2026-12-01 08:33 measured;
    * ``quota_big_sndbuf``: the same with a 4 MiB socket send buffer, so the kernel keeps sending while
      the CFS quota has the process stopped;
    * ``unthrottled``: the quota lifted to the host's cores (the link shaping unchanged): the wire part.

    Each reports the process's and the cgroup's CPU seconds and the throttled CFS periods during the
    upload (cgroup cpu.stat), so the time can be split into wire and CPU.
    """
    runs = {"quota": _upload(c, nbytes), "quota_old_timer": _upload(c, nbytes, timer="old"),
            "quota_big_sndbuf": _upload(c, nbytes, BIG_SNDBUF)}
    faults.set_cpus(c, host_cores)
    runs["unthrottled"] = _upload(c, nbytes)
    return runs


def run_profile(client: Any, tags: Any, profile: str, work: Path, *, rounds: int, arch: str = "amd64",
                fraction: float = 0.3, rates: dict[tuple[str, int], float] | None = None) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    fleet = work / f"{profile}-{arch}.toml"
    fleet.write_text(FLEET.format(profile=profile, rounds=rounds, fraction=fraction, count=1))
    emu = lifecycle.prepare(fleet, work / f"{profile}-{arch}", arch=arch, images=tags, device_args=("--keep-running",),
                         rates=rates)
    (dev,) = emu.devices
    plan, lim = emu.plans[dev], emu.limits[dev]
    t0 = time.perf_counter()
    try:
        lifecycle.start(emu, client, online_timeout=1800)
        code = lifecycle.wait_exited(emu, client, "coordinator", timeout=7200)
        if code != 0:
            raise SystemExit(status.logs(emu, client, "coordinator", tail=30))
        wall = time.perf_counter() - t0
        reports = read_reports(emu.out / "coordinator" / REPORTS_FILE)
        train = [r.seconds for r in reports if r.phase != "final"]
        final = next(r.seconds for r in reports if r.phase == "final")
        round_s = float(np.mean(train[1:] if len(train) > 1 else train)) - final
        c = emu.containers(client)[dev]
        hwm = _vm_hwm_mb(c)
        stats = c.stats(stream=False)
        cg_peak = stats.get("memory_stats", {}).get("max_usage", 0) / 2**20
        nbytes = plan["params"] * UPLOAD_BYTES[plan["upload_precision"]]
        uploads = upload_decomposition(c, nbytes, host_cores=len(os.sched_getaffinity(0)))
        upload = uploads["quota"]
        globals_path = emu.out / "coordinator" / "globals.safetensors"
        protos = None
        if globals_path.is_file():
            from safetensors.numpy import load_file
            protos = {k: v.tolist() for k, v in load_file(str(globals_path)).items()}
    finally:
        lifecycle.down(emu)
    expected_upload = nbytes * 8 / (lim["uplink_kbit"] * 1000)
    need = RUNTIME_RESERVE_MB - OS_SHARE_MB + plan["train_memory_mb"]
    return {
        "profile": profile, "arch": arch, "device_arch": plan["arch"], "batch": plan["batch_size"],
        "epochs": plan["local_epochs"], "samples": plan["samples"], "cpus": lim["cpus"],
        "cpus_wanted": lim["cpus_wanted"], "host_gmacs": lim["host_mac_rate"] / 1e9,
        "round_s": round_s, "planned_round_s": plan["round_time_s"], "round_ratio": round_s / plan["round_time_s"],
        "round_seconds": train, "final_seconds": final, "upload_bytes": nbytes, "upload_s": upload["seconds"],
        "expected_upload_s": expected_upload, "upload_ratio": upload["seconds"] / expected_upload,
        "upload_runs": uploads,
        "upload_ratio_big_sndbuf": uploads["quota_big_sndbuf"]["seconds"] / expected_upload,
        "upload_ratio_old_timer": uploads["quota_old_timer"]["seconds"] / expected_upload,
        "upload_ratio_unthrottled": uploads["unthrottled"]["seconds"] / expected_upload,
        "peak_rss_mb": hwm, "cgroup_peak_mb": cg_peak, "planned_memory_mb": need,
        "mem_limit_mb": lim["mem_limit_mb"], "wall_s": wall, "globals": protos,
    }


def _write(out: str, result: dict[str, Any]) -> None:
    result["loadavg_end"] = os.getloadavg()  # the host is shared: other jobs' load is in the figures
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="rpi-zero-2w,rpi4-4gb,x86-gateway")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arm64", metavar="PROFILE", help="also run PROFILE with arm64 device containers")
    ap.add_argument("--arm64-only", action="store_true", help="only the arm64 comparison (no profile rows)")
    ap.add_argument("--arm64-rounds", type=int, default=2, help="rounds of the arm64 comparison (both arches)")
    ap.add_argument("--arm64-fraction", type=float, default=0.1, help="data fraction of the arm64 comparison")
    ap.add_argument("--images-hash", metavar="H",
                    help="use the images built for fedge source hash H (they must exist) instead of this checkout's")
    ap.add_argument("--forward-only", action="store_true",
                    help="with --arm64: only the untrained forward pass on both architectures (no fleet runs)")
    ap.add_argument("--forward-arch", default="tier-xl", help="with --forward-only: the model (the Pi 4's plan)")
    ap.add_argument("--work", default="runs/bench-emulation")
    ap.add_argument("--out", default=str(RESULTS / "emulation.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    client = discovery.docker_client()
    tags = (images.image_tags("amd64", args.images_hash) if args.images_hash
            else images.ensure_images(client, "amd64"))
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)  # a fresh calibration each run (prepare caches it per directory)
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    t_start = time.time()
    rows = [] if args.arm64_only or args.forward_only else [run_profile(client, tags, p, work, rounds=args.rounds)
                                       for p in args.profiles.split(",") if p]
    for r in rows:  # the targets
        r["round_ok"] = 0.67 <= r["round_ratio"] <= 1.5
        r["upload_ok"] = abs(r["upload_ratio"] - 1) <= 0.2
    result: dict[str, Any] = {"command": "python -m benchmarks.emulation " + " ".join(sys.argv[1:]),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
                              "loadavg_start": load_start, "rounds": args.rounds, "profiles": rows}
    _write(args.out, result)  # now: the arm64 part takes long and may fail
    if args.arm64:
        arm_tags = (images.image_tags("arm64", args.images_hash) if args.images_hash
                    else images.ensure_images(client, "arm64"))
        result["images"] = {"amd64": tags.device, "arm64": arm_tags.device}
    if args.arm64 and args.forward_only:
        result["arm64_forward"] = forward_probe(client, {"amd64": tags.device, "arm64": arm_tags.device}, work,
                                                arch=args.forward_arch)
    elif args.arm64:
        # A smaller run than the profiles' on both architectures back to back, each device container with
        # one whole host core (host rate := the profile's rate, so cpus = 1): at the profile's quota (0.06 of a
        # core for a Pi 4) QEMU's slowdown made the arm64 device miss round 1's deadline (180 s).
        speed = speed_model(load_profile(args.arm64))
        one_core = {(f"tier-{t}", b): speed.mac_rate(tier_arch(t), b)
                    for t in ("xs", "s", "m", "l", "xl") for b in (8, 16, 32, 64, 128, 256, 512)}
        small = {"rounds": args.arm64_rounds, "fraction": args.arm64_fraction, "rates": one_core}
        amd = run_profile(client, tags, args.arm64, work / "arm64-ref", **small)
        arm = run_profile(client, arm_tags, args.arm64, work / "arm64", arch="arm64", **small)
        # Per global tensor: (max |arm64 - amd64|, the largest |amd64| element of the same tensor), so the
        # relative figure divides prototypes (~1.6) by prototypes, not by their counts (~16).
        pairs = [(float(np.max(np.abs(np.asarray(arm["globals"][k]) - np.asarray(v)))), float(np.max(np.abs(v))))
                 for k, v in (amd["globals"] or {}).items() if k in (arm["globals"] or {})]
        diffs = [d for d, _ in pairs]
        rel = [d / m for d, m in pairs if m > 0]
        result["arm64"] = {"profile": args.arm64, "amd64_wall_s": amd["wall_s"], "arm64_wall_s": arm["wall_s"],
                           "slowdown": arm["wall_s"] / amd["wall_s"],
                           "round_slowdown": arm["round_s"] / amd["round_s"] if amd["round_s"] > 0 else None,
                           "max_abs_diff_globals": max(diffs) if diffs else None,
                           "max_rel_diff_globals": max(rel) if rel else None,
                           "untrained_forward": forward_probe(client, {"amd64": tags.device, "arm64": arm_tags.device},
                                                              work, arch=amd["device_arch"]),
                           "run": arm}
    _write(args.out, result)
    print(f"{'profile':<13} {'model':<8} {'cpus':>5} {'round s':>8} {'planned':>8} {'ratio':>6} "
          f"{'upload s':>9} {'bytes/rate':>10} {'ratio':>6} {'peak RSS':>9} {'cgroup':>7} {'planned':>8}")
    for r in rows:
        print(f"{r['profile']:<13} {r['device_arch']:<8} {r['cpus']:>5.2f} {r['round_s']:>8.2f} "
              f"{r['planned_round_s']:>8.2f} {r['round_ratio']:>6.2f} {r['upload_s']:>9.2f} "
              f"{r['expected_upload_s']:>10.2f} {r['upload_ratio']:>6.2f} {r['peak_rss_mb'] or 0:>8.0f}M "
              f"{r['cgroup_peak_mb']:>6.0f}M {r['planned_memory_mb']:>7.0f}M")
    print("upload decomposition (s): at the quota / old timer (CONNACK inside) / 4 MiB send buffer / quota lifted;"
          " process CPU s at the quota; throttled CFS periods")
    for r in rows:
        u = r["upload_runs"]
        print(f"{r['profile']:<13} {u['quota']['seconds']:.3f} / {u['quota_old_timer']['seconds']:.3f} / "
              f"{u['quota_big_sndbuf']['seconds']:.3f} / "
              f"{u['unthrottled']['seconds']:.3f} (bytes/rate {r['expected_upload_s']:.3f}); "
              f"cpu {u['quota'].get('process_cpu_s', float('nan')):.4f} s; "
              f"throttled {u['quota'].get('throttled_periods')} of {u['quota'].get('periods')} periods")
    if "arm64" in result:
        a = result["arm64"]
        print(f"arm64 vs amd64 ({a['profile']}): wall {a['arm64_wall_s']:.0f} s vs {a['amd64_wall_s']:.0f} s "
              f"(x{a['slowdown']:.1f}); max |global prototype difference| {a['max_abs_diff_globals']}")
    for f in [x for x in (result.get("arm64", {}).get("untrained_forward"), result.get("arm64_forward")) if x]:
        print(f"untrained {f['arch']} on {f['images']} digits (same weights and inputs), arm64 - amd64 max |diff|: "
              f"features {f['max_abs_diff_features']:.2e}, logits {f['max_abs_diff_logits']:.2e}, "
              f"prototypes {f['max_abs_diff_prototypes']:.2e}; weights after 1 / 40 SGD steps "
              f"{f['max_abs_diff_weights_after_1_steps']:.2e} / {f['max_abs_diff_weights_after_40_steps']:.2e}")
    print(f"load average (1/5/15 min) at start {result['loadavg_start']}, at end {result['loadavg_end']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
