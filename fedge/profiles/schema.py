"""Device profiles as frozen, self-validating dataclasses.

A profile describes one kind of device: its hardware, its network link, the
budgets its owner grants to federated training and, optionally, latencies
measured on the real device. Profiles are read from TOML by
:mod:`fedge.profiles.loader`; :func:`fedge.common.tomlconf.build` rejects
unknown keys, missing keys and wrong types, and each ``__post_init__`` below
rejects impossible values with a :class:`ProfileError` that names the key and
the fix (the loader prefixes the file and table).

Units are in the key names: ``_mb`` mebibytes, ``_ghz`` gigahertz, ``_kbps``
kilobits per second, ``_ms`` milliseconds, ``_s`` seconds.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fedge.common.archs import TIERS
from fedge.errors import ProfileError
from fedge.profiles.power import Power
from fedge.profiles.thermal import Thermal
from fedge.profiles.uarch import check_uarch

# Inference quantization levels, highest precision first (ties in measured
# latency are broken toward the earlier, more accurate level).
INFERENCE_QUANTS: tuple[str, ...] = ("fp32", "fp16", "int8-dynamic", "int8-static")
UPLOAD_PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8")

# CPU architectures as `uname -m` prints them.
ARCHES: tuple[str, ...] = ("aarch64", "armv7l", "x86_64", "riscv64")
# Debian/Docker/macOS spellings of the same architectures.
_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64", "armhf": "armv7l", "armv7": "armv7l"}
# Only these have int8 dot-product instructions (ARMv8.2 dotprod, x86 VNNI).
INT8_DOT_ARCHES: tuple[str, ...] = ("aarch64", "x86_64")

# Accelerators the planner knows how to use, with what each one means.
ACCELERATORS: dict[str, str] = {
    "cuda-fp16": "NVIDIA GPU with native fp16 arithmetic (Jetson Maxwell and later)",
    "cuda-fp32": "NVIDIA GPU without fast fp16",
    "opencl-fp16": "OpenCL GPU with native fp16 (Mali, Adreno)",
    "npu-int8": "int8 neural accelerator reachable from ONNX Runtime",
}

# What the OS, Python and the torch runtime take before training allocates
# anything (Raspberry Pi OS Lite idles near 80 MB; `import torch` adds ~150 MB
# RSS on aarch64). A training budget must leave this much of the RAM free.
RUNTIME_RESERVE_MB = 256

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def _check(ok: bool, key: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ProfileError(f"{key} = {shown}: {problem}", hint=fix)


def _positive(key: str, value: float, fix: str) -> None:
    _check(math.isfinite(value) and value > 0, key, value, "must be a positive number", fix)


@dataclass(frozen=True)
class Hardware:
    """What the device computes with."""

    arch: str
    """CPU architecture as ``uname -m`` prints it: aarch64, armv7l, x86_64, riscv64."""
    cpu: str
    """CPU model, e.g. ``"Cortex-A72 (BCM2711)"`` (informational)."""
    cores: int
    """CPU cores available to training."""
    clock_ghz: float
    """Sustained (or rated maximum) core clock in GHz."""
    ram_mb: int
    """Total RAM in MiB."""
    int8_dot: bool
    """The CPU has int8 dot-product instructions (ARMv8.2 dotprod / x86 VNNI)."""
    accelerators: tuple[str, ...] = ()
    """Accelerators, from :data:`ACCELERATORS`, e.g. ``("cuda-fp16",)``."""
    uarch: str = ""
    """CPU microarchitecture for the speed model (:data:`fedge.profiles.uarch.UARCHES`, e.g. ``"cortex-a72"``);
    empty: found from ``cpu``."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            close = [_ARCH_ALIASES[self.arch]] if self.arch in _ARCH_ALIASES else difflib.get_close_matches(
                self.arch, ARCHES, n=1)
            _check(False, "arch", self.arch, "unknown CPU architecture",
                   f"did you mean {close[0]!r}? (`uname -m` spelling)" if close
                   else f"use one of {', '.join(ARCHES)} (`uname -m`)")
        _check(bool(self.cpu.strip()), "cpu", self.cpu, "must not be empty", 'name the CPU, e.g. "Cortex-A53"')
        _check(1 <= self.cores <= 1024, "cores", self.cores, "must be between 1 and 1024",
               "set the number of CPU cores training may use (`nproc`)")
        _check(math.isfinite(self.clock_ghz) and 0.05 <= self.clock_ghz <= 8.0, "clock_ghz", self.clock_ghz,
               "must be between 0.05 and 8 GHz", "give the clock in GHz, e.g. 1.5 (not MHz)")
        _check(self.ram_mb >= 64, "ram_mb", self.ram_mb, "must be at least 64 MiB",
               "give the RAM in MiB, e.g. 4096 for 4 GB")
        _check(not self.int8_dot or self.arch in INT8_DOT_ARCHES, "int8_dot", self.int8_dot,
               f"{self.arch} has no int8 dot-product instructions",
               "set int8_dot = false (only ARMv8.2+ aarch64 and x86_64 with VNNI have them)")
        for acc in self.accelerators:
            if acc not in ACCELERATORS:
                close = difflib.get_close_matches(acc, ACCELERATORS, n=1)
                _check(False, "accelerators", acc, "unknown accelerator",
                       f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(ACCELERATORS)}")
        _check(len(set(self.accelerators)) == len(self.accelerators), "accelerators", list(self.accelerators),
               "lists an accelerator twice", "list each accelerator once")
        if self.uarch:
            check_uarch(self.uarch)

    @property
    def ghz_total(self) -> float:
        """cores × clock: the compute measure the planner and the dominance order use."""
        return self.cores * self.clock_ghz

    def has_fp16_accelerator(self) -> bool:
        return any(a.endswith("-fp16") for a in self.accelerators)

    def has_int8_accelerator(self) -> bool:
        return any(a.endswith("-int8") for a in self.accelerators)


@dataclass(frozen=True)
class Network:
    """The device's link to the broker (sustained rates, not the PHY rate)."""

    uplink_kbps: float
    """Device → broker, kbit/s."""
    downlink_kbps: float
    """Broker → device, kbit/s."""
    latency_ms: float
    """Round-trip time to the broker, ms."""

    def __post_init__(self) -> None:
        for key in ("uplink_kbps", "downlink_kbps"):
            _positive(key, getattr(self, key),
                      "give the sustained rate in kbit/s (> 0; a device without a link cannot federate)")
        _check(math.isfinite(self.latency_ms) and 0 <= self.latency_ms <= 60_000, "latency_ms", self.latency_ms,
               "must be between 0 and 60000 ms", "give the round-trip time to the broker in ms")


@dataclass(frozen=True)
class Budgets:
    """What the device's owner grants to federated learning."""

    train_memory_mb: float
    """Peak memory local training may use (model, gradients, optimizer state, activations, workspace), MiB."""
    round_time_s: float
    """Wall time one round of local training may take, s."""
    inference_latency_ms: float
    """Target batch-1 inference latency, ms."""

    def __post_init__(self) -> None:
        _positive("train_memory_mb", self.train_memory_mb, "give the training memory budget in MiB, e.g. 256")
        _positive("round_time_s", self.round_time_s, "give the time a round of local training may take in s")
        _positive("inference_latency_ms", self.inference_latency_ms, "give the target inference latency in ms")


def _freeze(d: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType({k: float(v) for k, v in d.items()})


@dataclass(frozen=True)
class Measured:
    """Measurements taken on the real device (written by a probe, read by the planner).

    ``latency_ms`` maps ``"tier-<t>/<quant>"`` to batch-1 latency in ms;
    ``accuracy_drop`` maps a quantization level to its top-1 accuracy loss
    against fp32, in percentage points; ``train_gmac_s`` maps ``"tier-<t>@<batch>"``
    to the training rate on all cores, in 10^9 multiply-accumulates per second
    (:mod:`fedge.profiles.speed` uses it over its model).
    """

    latency_ms: Mapping[str, float] = field(default_factory=dict)
    accuracy_drop: Mapping[str, float] = field(default_factory=dict)
    train_gmac_s: Mapping[str, float] = field(default_factory=dict)
    round_fixed_s: float | None = None
    """Seconds a round costs the device whatever its work (applying the global state, the optimizer's set-up,
    encoding the update); None: :data:`fedge.profiles.speed.ROUND_FIXED_MACS_PER_PARAM`'s estimate."""

    def __post_init__(self) -> None:
        examples = {"latency_ms": '"tier-m/fp32" = 1.2', "accuracy_drop": '"int8-static" = 0.4',
                    "train_gmac_s": '"tier-m@64" = 1.9'}
        for name, example in examples.items():
            _check(isinstance(getattr(self, name), Mapping), name, getattr(self, name), "is not a table",
                   f"write it as a table, e.g. {name} = {{ {example} }}")
        for key, ms in self.latency_ms.items():
            arch, _, quant = key.partition("/")
            tier = arch.removeprefix("tier-")
            _check(arch.startswith("tier-") and tier in TIERS and quant in INFERENCE_QUANTS,
                   "latency_ms", key, "is not a <model tier>/<quantization> key",
                   f'use keys like "tier-m/int8-static": tiers {", ".join(TIERS)}; '
                   f'quantizations {", ".join(INFERENCE_QUANTS)}')
            _check(isinstance(ms, int | float) and not isinstance(ms, bool), f"latency_ms.{key}", ms,
                   "is not a number", "give the latency in ms")
            _positive(f"latency_ms.{key}", ms, "give the measured batch-1 latency in ms (> 0)")
        for quant, drop in self.accuracy_drop.items():
            _check(quant in INFERENCE_QUANTS, "accuracy_drop", quant, "is not a quantization level",
                   f"use one of {', '.join(INFERENCE_QUANTS)}")
            _check(isinstance(drop, int | float) and not isinstance(drop, bool)
                   and math.isfinite(drop) and -100 <= drop <= 100,
                   f"accuracy_drop.{quant}", drop, "must be a number of percentage points in [-100, 100]",
                   "give the top-1 accuracy lost against fp32, in points (0.4 means 0.4 %)")
        for key, rate in self.train_gmac_s.items():
            arch, _, batch = key.partition("@")
            _check(arch.startswith("tier-") and arch.removeprefix("tier-") in TIERS and batch.isdigit()
                   and int(batch) >= 1, "train_gmac_s", key, "is not a <model tier>@<batch> key",
                   f'use keys like "tier-m@64": tiers {", ".join(TIERS)}, a batch size >= 1')
            _check(isinstance(rate, int | float) and not isinstance(rate, bool), f"train_gmac_s.{key}", rate,
                   "is not a number", "give the measured training rate in 10^9 MAC/s")
            _positive(f"train_gmac_s.{key}", rate, "give the measured training rate in 10^9 MAC/s (> 0)")
        if self.round_fixed_s is not None:
            _check(math.isfinite(self.round_fixed_s) and self.round_fixed_s >= 0, "round_fixed_s", self.round_fixed_s,
                   "must be a number of seconds >= 0", "give the per-round fixed cost measured on the device, in s")
        object.__setattr__(self, "latency_ms", _freeze(self.latency_ms))
        object.__setattr__(self, "accuracy_drop", _freeze(self.accuracy_drop))
        object.__setattr__(self, "train_gmac_s", _freeze(self.train_gmac_s))

    def latency(self, tier: str, quant: str) -> float | None:
        """Measured latency of ``tier-<tier>`` at ``quant`` in ms, or None."""
        return self.latency_ms.get(f"tier-{tier}/{quant}")


@dataclass(frozen=True)
class Profile:
    """One kind of device: hardware, network, budgets, optional measurements and an optional energy model."""

    name: str
    description: str
    hardware: Hardware
    network: Network
    budgets: Budgets
    measured: Measured | None = None
    power: Power | None = None
    """``[power]`` (:mod:`fedge.profiles.power`): board power, radio energy per byte, a battery (None: no estimate)."""
    thermal: Thermal | None = None
    """``[thermal]`` (:mod:`fedge.profiles.thermal`): how the board heats and throttles in simulation (None: never)."""

    def __post_init__(self) -> None:
        _check(self.thermal is None or self.power is not None, "thermal", "[thermal]",
               "heats with the board's power, and the profile has no [power] table", "add [power] (idle_w, busy_w)")
        _check(bool(_NAME.match(self.name)), "name", self.name, "is not a valid profile name",
               "use lower-case letters, digits, '.', '_' and '-', e.g. \"rpi4-4gb\"")
        ram, budget = self.hardware.ram_mb, self.budgets.train_memory_mb
        _check(budget <= ram, "budgets.train_memory_mb", budget,
               f"exceeds the device's RAM (hardware.ram_mb = {ram})",
               f"lower budgets.train_memory_mb to at most {max(ram - RUNTIME_RESERVE_MB, 0)}, or fix hardware.ram_mb")
        _check(budget <= ram - RUNTIME_RESERVE_MB, "budgets.train_memory_mb", budget,
               f"leaves less than {RUNTIME_RESERVE_MB} MiB of the {ram} MiB RAM for the OS, Python and torch",
               f"lower budgets.train_memory_mb to at most {ram - RUNTIME_RESERVE_MB}" if ram > RUNTIME_RESERVE_MB
               else f"this device needs more than {RUNTIME_RESERVE_MB} MiB of RAM to train with torch")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready); :func:`fedge.profiles.loader.parse_profile` reads it back."""
        hw = self.hardware
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "hardware": {
                "arch": hw.arch, "cpu": hw.cpu, "cores": hw.cores, "clock_ghz": hw.clock_ghz,
                "ram_mb": hw.ram_mb, "int8_dot": hw.int8_dot, "accelerators": list(hw.accelerators),
                **({"uarch": hw.uarch} if hw.uarch else {}),
            },
            "network": {
                "uplink_kbps": self.network.uplink_kbps, "downlink_kbps": self.network.downlink_kbps,
                "latency_ms": self.network.latency_ms,
            },
            "budgets": {
                "train_memory_mb": self.budgets.train_memory_mb, "round_time_s": self.budgets.round_time_s,
                "inference_latency_ms": self.budgets.inference_latency_ms,
            },
        }
        if self.measured is not None:
            d["measured"] = {
                "latency_ms": dict(self.measured.latency_ms),
                "accuracy_drop": dict(self.measured.accuracy_drop),
                **({"train_gmac_s": dict(self.measured.train_gmac_s)} if self.measured.train_gmac_s else {}),
                **({"round_fixed_s": self.measured.round_fixed_s} if self.measured.round_fixed_s is not None else {}),
            }
        if self.power is not None:
            d["power"] = self.power.to_dict()
        if self.thermal is not None:
            d["thermal"] = self.thermal.to_dict()
        return d
