"""Installed size, import time and peak RSS of `fedge infer` and an idle `fedge edge run`, per install set.

Builds a throwaway virtualenv per set (``runtime``, ``device``) from fedge's wheel (built from this source
tree) and local wheels (``--find-links``, default /opt/wheels: a CPU-only torch, as a Raspberry Pi gets from
PyPI for aarch64), then measures in each:

* installed size: ``du`` of the venv's site-packages (what the set put on the device);
* ``fedge infer --model M digit.png``: wall time, total import time (``python -X importtime``: the sum of
  the top-level imports' cumulative times) and peak RSS (VmHWM);
* an idle ``fedge edge run --data DIR`` (device set only: the runtime set cannot train): started against a
  Mosquitto with no coordinator, measured once it has said hello and waits for a round.

"full" is today's install: the environment running this script (``.[all,dev]`` with the Makefile's torch).

The model is tier-xs trained 3 epochs on scikit-learn's digits (fixed seeds), the images are digits written
as PNG files, one folder per class, and the fleet is two rpi4-2gb devices on their own data
(``install_size_fleet.toml``).

    .venv/bin/python -m benchmarks.install_size [--sets runtime,device] [--find-links DIR] [--keep]

Writes benchmarks/results/install_size.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, RESULTS, text_table

OUT = RESULTS / "install_size.json"

FLEET = Path(__file__).with_name("install_size_fleet.toml")  # what the idle agent runs


# -- what is measured: a model, digit images, a fleet ------------------------------------------------

def export_trained_model(out: Path) -> None:
    """tier-xs trained 3 epochs on digits (fixed seeds), exported at fp32 to ``out`` for ``fedge infer``."""
    import numpy as np
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.zoo import build_model
    from fedge.edge.training import TrainConfig, train_epochs
    from fedge.export.exporter import export_model

    train, test = load_dataset("digits", train=True), load_dataset("digits", train=False)
    torch.manual_seed(0)
    net = build_model("tier-xs", seed=0)
    train_epochs(net, train.x, train.y, TrainConfig(lr=0.02, batch_size=32, momentum=0.9),
                 np.random.default_rng(0), epochs=3)
    export_model(net.eval(), out, quant="fp32", test=test)


def write_digits(root: Path, per_class: int, classes: tuple[int, ...] = tuple(range(10))) -> list[Path]:
    """The first ``per_class`` scikit-learn digits of each class as 8-bit grey PNGs under ``root/<class>/``:
    a device's data folder (``fedge edge run --data``) or images for ``fedge infer``."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    pixels = (d.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
    paths = []
    for c in classes:
        (root / str(c)).mkdir(parents=True, exist_ok=True)
        for k, i in enumerate(np.flatnonzero(d.target == c)[:per_class]):
            paths.append(root / str(c) / f"img_{k:04d}.png")
            Image.fromarray(pixels[i], mode="L").save(paths[-1])
    return paths


# -- measuring ---------------------------------------------------------------------------------------


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def import_ms(stderr: str) -> float:
    """Total import time from ``-X importtime``: the top-level entries' cumulative microseconds."""
    total = 0
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        parts = line.split("|")
        if len(parts) == 3 and parts[2][1:2] != " ":  # nested imports are indented under their importer
            total += int(parts[1])
    return total / 1000


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_measured(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run to completion; wall time, import time, and peak RSS (from the rusage of this child alone)."""
    wrapper = ("import resource, subprocess, sys, time\n"
               "t = time.perf_counter()\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "dt = time.perf_counter() - t\n"
               "sys.stderr.write(p.stderr)\n"
               "print(p.returncode, dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env,
                          timeout=600)
    rc, dt, rss_kb = proc.stdout.split()
    if int(rc) != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr[-2000:]}")
    return {"wall_s": float(dt), "import_ms": import_ms(proc.stderr), "peak_rss_mb": int(rss_kb) / 1024}


def idle_agent(python: Path, fleet: Path, data: Path, url: str, env: dict[str, str]) -> dict[str, float]:
    cmd = [str(python), "-X", "importtime", "-m", "fedge", "edge", "run", "--config", str(fleet), "--device-id",
           "rpi4-2gb-1", "--broker", url, "--data", str(data)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    lines = []
    ready = None
    for line in proc.stderr:
        lines.append(line)
        if " via mqtt://" in line:  # printed once the device is built and connecting: it now waits idle
            ready = time.perf_counter() - t
            break
    time.sleep(3.0)
    rss = peak_rss_mb(proc.pid)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    if ready is None:
        raise RuntimeError("the agent did not start: " + "".join(lines)[-2000:] + rest[-2000:])
    return {"ready_s": ready, "import_ms": import_ms("".join(lines)), "peak_rss_mb": rss}


def build_venv(kind: str, root: Path, wheel: Path, find_links: str) -> Path:
    venv = root / kind
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--find-links", find_links]
    # The local CPU-only torch (a device's torch has no CUDA libraries); the rest from the index.
    torch_wheels = sorted(Path(find_links).glob("torch-*+cpu-*.whl"))
    cons = root / "constraints.txt"
    cons.write_text("".join(f"torch=={w.name.split('-')[1]}\n" for w in torch_wheels[-1:]))
    # Without PYTHONPATH: a source tree on it would count as an installed fedge and pip would skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([*pip, "-c", str(cons), f"{wheel}[{kind}]"], check=True, env=env)
    return venv


def measure_set(label: str, python: Path, sp: Path, model: Path, png: Path, fleet: Path, data: Path, url: str,
                can_train: bool, pythonpath: str | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if pythonpath:  # the full install runs this source tree (an editable install of another checkout may differ)
        env["PYTHONPATH"] = pythonpath
    env["OMP_NUM_THREADS"] = "1"
    infer = [run_measured([str(python), "-X", "importtime", "-m", "fedge", "infer", "--model", str(model), str(png)],
                          env) for _ in range(3)]
    best = min(infer, key=lambda r: r["wall_s"])
    row: dict[str, Any] = {"set": label, "site_packages_mb": du(sp) / 2**20, "infer": best, "infer_runs": infer}
    if can_train:
        row["edge_idle"] = idle_agent(python, fleet, data, url, env)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="runtime,device")
    ap.add_argument("--find-links", default="/opt/wheels")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway venvs (printed)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from fedge.mqtt.broker import MosquittoProcess

    tmp = Path(tempfile.mkdtemp(prefix="fedge-install-size-"))
    model = tmp / "model"
    export_trained_model(model)
    (png,) = write_digits(tmp / "one", 1, classes=(7,))
    data = tmp / "data"
    write_digits(data, 20)
    src = tmp / "src"  # a copy: building in place would leave build/ and fedge.egg-info in the source tree
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "benchmarks", "tests",
                                                             "__pycache__", "*.egg-info", "build"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp / "dist"),
                    str(src)], check=True, cwd=tmp)
    wheel = next((tmp / "dist").glob("fedge-*.whl"))
    broker = MosquittoProcess().start()
    rows = []
    try:
        full_sp = Path(next(p for p in sys.path if p.endswith("site-packages")))
        rows.append(measure_set("full (.[all,dev])", Path(sys.executable), full_sp, model, png, FLEET, data,
                                broker.url, True, pythonpath=str(REPO)))
        for kind in args.sets.split(","):
            venv = build_venv(kind, tmp / "venvs", wheel, args.find_links)
            py = venv / "bin" / "python"
            version = subprocess.run([str(py), "-c", "import importlib.metadata as m\n"
                                      "print(*(f'{d}=={m.version(d)}' for d in ('torch', 'onnxruntime', 'numpy') "
                                      "if d in {x.metadata['Name'] for x in m.distributions()}))"],
                                     capture_output=True, text=True).stdout.strip()
            row = measure_set(kind, py, site_packages(venv), model, png, FLEET, data, broker.url, kind != "runtime")
            row["versions"] = version
            rows.append(row)
    finally:
        broker.close()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    table = [[r["set"], f"{r['site_packages_mb']:.0f}", f"{r['infer']['import_ms']:.0f}",
              f"{r['infer']['wall_s']:.2f}", f"{r['infer']['peak_rss_mb']:.0f}",
              f"{r['edge_idle']['import_ms']:.0f}" if "edge_idle" in r else "-",
              f"{r['edge_idle']['peak_rss_mb']:.0f}" if "edge_idle" in r else "-"] for r in rows]
    print(text_table(["set", "site-packages MB", "infer import ms", "infer wall s", "infer peak RSS MB",
                      "edge idle import ms", "edge idle peak RSS MB"], table))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
