"""Measure this machine: batch-1 latency of every model tier at every quantization level.

Whether int8 beats fp32 depends on the CPU (without ARMv8.2 dotprod or x86
VNNI it often does not), so a profile should carry numbers measured on the
device. :func:`probe` exports each tier (trained briefly, so the accuracy of
each quantization level means something), quantizes it, and times ONNX
Runtime; :func:`measured_profile` turns the figures into a profile with a
``[measured]`` table, which the planner (:mod:`fedge.profiles.planner`) uses
to choose int8 only where it was measured faster and within the accuracy bound.

Accuracy drops are per quantization level in the profile schema; the probe
records the worst drop over the tiers it measured (conservative).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import re
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedge.common.archs import TIERS, tier_arch
from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError, ExportError
from fedge.runtime.manifest import QUANTS

log = logging.getLogger(__name__)

# Brief training so accuracies are meaningful: 90-99 % on digits for every tier in
# 1-6 s each on one core (lr 0.05 with the same momentum diverged on tier-xl).
PROBE_LR = 0.02
PROBE_MOMENTUM = 0.9
PROBE_BATCH = 32


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` measured."""

    latency_ms: dict[str, float]
    """``"tier-<t>/<quant>"`` → median batch-1 latency, ms."""
    accuracy: dict[str, dict[str, float]]
    """``"tier-<t>"`` → quantization level → top-1 accuracy in [0, 1]."""
    dataset: str
    test_images: int
    runs: int
    threads: int
    hardware: dict[str, Any] = field(default_factory=dict)
    train_gmac_s: dict[str, float] = field(default_factory=dict)
    """``"tier-<t>@<batch>"`` → training rate on ``train_threads`` threads, 10^9 MAC per wall second."""
    train_threads: int = 0

    @property
    def accuracy_drop(self) -> dict[str, float]:
        """Quantization level → worst accuracy loss against fp32 over the tiers, in points."""
        drops: dict[str, float] = {}
        for accs in self.accuracy.values():
            for q, a in accs.items():
                if q != "fp32" and "fp32" in accs:
                    drops[q] = max(drops.get(q, -100.0), round(100 * (accs["fp32"] - a), 2))
        return drops


def probe(*, tiers: Sequence[str] = TIERS, quants: Sequence[str] = QUANTS, runs: int = 200, threads: int = 1,
          dataset: str = "digits", data_dir: str | os.PathLike[str] | None = None, epochs: int = 3,
          calibration_samples: int = 256, seed: int = 0, train_batches: Sequence[int] = (),
          train_threads: int | None = None, train_seconds: float = 1.5) -> ProbeResult:
    """Train each tier briefly on ``dataset``, export it at each of ``quants`` and time it.

    Latency is the median of ``runs`` batch-1 runs on ``threads`` ONNX Runtime threads. With
    ``train_batches``, each tier's training rate at each batch is timed too (SGD steps for
    ``train_seconds`` of wall time on ``train_threads`` threads, default every core this process may
    use): the ``[measured] train_gmac_s`` the speed model prefers to its own estimate.
    """
    import torch

    from fedge.edge.data.datasets import load_dataset
    from fedge.edge.models.zoo import build_model
    from fedge.edge.training import TrainConfig, train_epochs, train_mac_rate
    from fedge.export.variants import model_variants
    from fedge.export.verify import onnx_accuracy, onnx_latency_ms

    bad = [q for q in quants if q not in QUANTS] + [t for t in tiers if t not in TIERS]
    if bad:
        raise ConfigError(f"probe: unknown tier or quantization {bad}",
                          hint=f"tiers: {', '.join(TIERS)}; quantizations: {', '.join(QUANTS)}")
    if runs < 1 or threads < 1 or epochs < 0:
        raise ConfigError("probe: runs and threads must be >= 1, epochs >= 0")
    if any(b < 1 for b in train_batches) or (train_threads is not None and train_threads < 1):
        raise ConfigError("probe: training batches and threads must be >= 1")
    train = load_dataset(dataset, train=True, data_dir=data_dir)
    test = load_dataset(dataset, train=False, data_dir=data_dir)
    rng = np.random.default_rng(seed)
    calib = train.x[np.sort(rng.choice(len(train), min(calibration_samples, len(train)), replace=False))]
    cfg = TrainConfig(lr=PROBE_LR, batch_size=PROBE_BATCH, momentum=PROBE_MOMENTUM)
    latency: dict[str, float] = {}
    accuracy: dict[str, dict[str, float]] = {}
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tier in tiers:
            spec = tier_arch(tier)
            torch.manual_seed(seed)
            net = build_model(spec, seed=seed, num_classes=train.num_classes)
            if epochs:
                train_epochs(net, train.x, train.y, cfg, np.random.default_rng(seed), epochs=epochs)
            net.eval()
            with tempfile.TemporaryDirectory(prefix="fedge-probe-") as work:
                paths = model_variants(net, work, quants=quants, calib=calib)
                accuracy[spec.name] = {}
                for q, path in paths.items():
                    ms = onnx_latency_ms(path, test.x[:1], runs=runs, threads=threads)
                    latency[f"{spec.name}/{q}"] = round(ms, 4)
                    accuracy[spec.name][q] = onnx_accuracy(path, test.x, test.y)
            log.info("probe %s: %s", spec.name, ", ".join(
                f"{q} {latency[f'{spec.name}/{q}']:.3f} ms {accuracy[spec.name][q]:.1%}" for q in quants))
    finally:
        torch.set_num_threads(torch_threads)
    hw = detect_hardware()
    cores = train_threads or int(hw["cores"])
    rates = {}
    for tier in tiers if train_batches else ():
        for b in train_batches:
            # wall time: the device trains with all its cores to itself, as it will in a round
            rate = train_mac_rate(f"tier-{tier}", b, threads=cores, seconds=train_seconds, cpu_time=False)
            rates[f"tier-{tier}@{b}"] = round(rate / 1e9, 4)
            log.info("probe tier-%s at batch %d trains at %.3f GMAC/s on %d threads", tier, b, rate / 1e9, cores)
    return ProbeResult(latency, accuracy, dataset, len(test), runs, threads, hw, rates, cores if rates else 0)


# -- this machine ------------------------------------------------------------------------
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def detect_hardware() -> dict[str, Any]:
    """This machine as a profile's ``[hardware]`` table (best effort, from /proc on Linux)."""
    info = _cpuinfo()

    def field_of(*names: str) -> str | None:
        for name in names:
            m = re.search(rf"^{name}\s*:\s*(.+)$", info, re.MULTILINE)
            if m:
                return m.group(1).strip()
        return None

    flags = set((field_of("flags", "Features") or "").split())
    mhz = [float(x) for x in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", info, re.MULTILINE)]
    try:
        khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text().strip())
        mhz.append(khz / 1000)
    except (OSError, ValueError):
        pass
    ram_mb = 0
    try:
        m = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        ram_mb = int(m.group(1)) // 1024 if m else 0
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return {
        "arch": platform.machine(),
        "cpu": field_of("model name", "Model", "Hardware") or platform.processor() or "unknown CPU",
        "cores": cores,
        "clock_ghz": round(max(mhz) / 1000, 2) if mhz else 1.0,
        "ram_mb": ram_mb or 1024,
        # x86 VNNI (AVX-512 or AVX) / ARMv8.2 dot product.
        "int8_dot": bool(flags & {"avx512_vnni", "avx_vnni", "asimddp"}),
        "accelerators": [],
    }


def _default_name() -> str:
    host = re.sub(r"[^a-z0-9._-]+", "-", socket.gethostname().lower()).strip("-._") or "this-machine"
    return f"measured-{host}"


def measured_profile(result: ProbeResult, *, base: str | None = None, name: str | None = None) -> Any:
    """A :class:`fedge.profiles.Profile` carrying ``result`` as its ``[measured]`` table.

    With ``base`` (a profile name or path) its hardware, network and budgets are
    kept; without, the hardware is detected and network and budgets get
    placeholders the owner should edit.
    """
    from fedge.profiles import Measured, parse_profile
    from fedge.profiles import load_profile as _load

    measured = Measured(latency_ms=dict(result.latency_ms), accuracy_drop=result.accuracy_drop,
                        train_gmac_s=dict(result.train_gmac_s))
    if base is not None:
        prof = _load(base)
        return replace(prof, name=name or f"{prof.name}-measured", measured=measured,
                       description=f"{prof.description} (measured)")
    hw = dict(result.hardware)
    ram = int(hw.get("ram_mb", 1024))
    data = {
        "name": name or _default_name(),
        "description": f"{hw.get('cpu', 'this machine')}, measured by `fedge profile probe`",
        "hardware": hw,
        "network": {"uplink_kbps": 10_000.0, "downlink_kbps": 10_000.0, "latency_ms": 10.0},
        "budgets": {"train_memory_mb": float(max(64, min(ram // 2, ram - 256))), "round_time_s": 60.0,
                    "inference_latency_ms": 10.0},
        "measured": {"latency_ms": dict(measured.latency_ms), "accuracy_drop": dict(measured.accuracy_drop),
                     "train_gmac_s": dict(measured.train_gmac_s)},
    }
    try:
        return parse_profile(data, source="probe of this machine")
    except ConfigError as exc:
        raise ExportError(f"this machine does not make a valid profile: {exc.message}",
                          hint="pass --base NAME with the built-in profile closest to this device") from exc


def probe_comment(result: ProbeResult, *, base: str | None) -> str:
    """The header written above a measured profile: how and when the figures were taken."""
    import onnxruntime

    lines = [
        f"Measured by `fedge profile probe` on {socket.gethostname()} at "
        f"{dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}, onnxruntime {onnxruntime.__version__}.",
        f"latency_ms: median of {result.runs} batch-1 runs, {result.threads} ONNX Runtime thread(s), per tier/quant.",
        f"accuracy_drop: worst fp32 - quantized top-1 loss (points) over the tiers, each trained "
        f"briefly on {result.dataset} and tested on {result.test_images} images:",
    ]
    for arch, accs in result.accuracy.items():
        lines.append(f"  {arch}: " + ", ".join(f"{q} {a:.2%}" for q, a in accs.items()))
    if result.train_gmac_s:
        lines.append(f"train_gmac_s: training MACs (3 x forward) per wall second of SGD steps on "
                     f"{result.train_threads} thread(s), per tier@batch; the speed model uses them over its estimate.")
    if base is None:
        lines.append("[hardware] was detected; [network] and [budgets] are placeholders: edit them for the device.")
    else:
        lines.append(f"[hardware], [network] and [budgets] come from profile {base!r}.")
    return "\n".join(lines)


def write_measured_profile(result: ProbeResult, out: str | os.PathLike[str], *, base: str | None = None,
                           name: str | None = None) -> Path:
    """Write the measured profile as TOML to ``out`` (atomically) and return the path."""
    from fedge.profiles import dump_profile

    text = dump_profile(measured_profile(result, base=base, name=name), comment=probe_comment(result, base=base))
    path = Path(out)
    write_atomic(path, text.encode("utf-8"))
    return path
