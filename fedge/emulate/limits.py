"""Profiles become container limits: CPU quota, memory limit and link shaping per emulated device.

* **CPU.** The speed model (:mod:`fedge.profiles.speed`, the planner's and the virtual clock's too)
  gives the device's training multiply-accumulates per second on its own model and batch. The
  emulator measures how many training MACs per second one core of *this host* reaches on the same
  model and batch (:mod:`fedge.emulate.calibrate`) and gives the container that fraction of a core, so
  the container trains at the model's speed for the profile: ``cpus = device MAC/s ÷ host MAC/s``,
  handed out by the kernel's CFS as ``cpus × period`` of CPU time per period, the period long enough
  that each slice is at least :data:`MIN_CPU_SLICE_US` (:func:`cpu_period_us`).
* **Memory.** The profile's RAM less :data:`OS_SHARE_MB`, the share of a Raspberry Pi OS Lite that
  the container does not run (the kernel and system services idle near 80 MB; see
  :data:`fedge.profiles.schema.RUNTIME_RESERVE_MB`). Python, torch and training must fit in the
  rest, as on the device; no swap.
* **Network.** The profile's uplink and downlink rates (tbf) and half its round-trip time on each
  direction (netem), shaped inside the container (``docker/shape-link.sh``, run at boot and after a partition).

No Docker and no torch here: the numbers only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fedge.fleet.config import FleetConfig, device_ids
from fedge.fleet.slots import device_arch_spec, family_specs, pinned_tier, run_budget
from fedge.profiles import load_profile
from fedge.profiles.planner import plan, train_memory_mb
from fedge.profiles.schema import RUNTIME_RESERVE_MB, Profile
from fedge.profiles.speed import speed_model

MIB = 2**20
# What Raspberry Pi OS Lite itself takes (kernel, systemd, sshd): the part of the planner's
# RUNTIME_RESERVE_MB that is not the Python process, so not inside the container.
OS_SHARE_MB = 80
# Docker refuses a CPU quota below 1 ms per 100 ms period.
MIN_CPUS = 0.01
# CFS gives a container ``cpus × period`` of CPU time per period and then stops it until the next. At the
# default 100 ms period a Pi Zero 2 W's 0.069 of a host core is a 6.9 ms slice per 100 ms, and a deployed
# device (`fedge edge run` over Mosquitto, FedProto on digits, tier-s) then used 2.15x the CPU time per
# round it used unthrottled (0.215 against 0.100 host CPU-s): each stop and restart costs the process
# milliseconds. 20.7 ms slices (a 300 ms period) took 0.138 s, 69 ms slices (1 s) 0.140 s
# (docs/emulate.md, "CPU slices"). So a small quota gets a longer period, up to the kernel's 1 s: the same
# share of a core in fewer, longer slices.
MIN_CPU_SLICE_US = 20_000
DEFAULT_CPU_PERIOD_US = 100_000
MAX_CPU_PERIOD_US = 1_000_000  # the kernel's largest cfs_period_us


def cpu_period_us(cpus: float) -> int:
    """The CFS period for a quota of ``cpus`` host cores: 100 ms, or longer (up to 1 s) so that each slice,
    ``cpus × period``, is at least :data:`MIN_CPU_SLICE_US`."""
    if cpus <= 0 or not math.isfinite(cpus):
        raise ValueError(f"cpus must be positive, got {cpus}")
    return min(MAX_CPU_PERIOD_US, max(DEFAULT_CPU_PERIOD_US, math.ceil(MIN_CPU_SLICE_US / cpus)))


@dataclass(frozen=True)
class DevicePlan:
    """One device of the fleet as the emulator sees it: its profile and what it will train."""

    device_id: str
    profile: Profile
    arch: str
    batch_size: int
    local_epochs: int
    samples: int
    macs: int
    """Forward multiply-accumulates of one sample of ``arch``."""
    train_memory_mb: float
    """The planner's estimate of peak training memory for ``arch`` at ``batch_size``, MiB."""
    round_time_s: float
    """The speed model's estimate of one round of local training, s."""
    upload_precision: str
    params: int
    mac_rate: float
    """The speed model's training MAC/s of this device on ``arch`` at ``batch_size``."""


def device_plans(cfg: FleetConfig, samples: dict[str, int]) -> list[DevicePlan]:
    """Every device's plan, with the fleet config's overrides (``arch``, ``[train] batch_size``, epochs).

    ``samples`` maps a device id to its number of local training samples (the partition decides it).
    """
    out = []
    ids = device_ids(cfg)
    specs = family_specs(cfg)  # the tiers of [model] family, measured (None: the GeFL CNN tiers)
    for idx, (dev_id, gi) in enumerate(ids):
        group = cfg.devices[gi]
        k = sum(1 for _, g in ids[:idx] if g == gi)
        ref = group.profile
        if ref.endswith(".toml") and not ref.startswith("/"):
            ref = str(cfg.base_dir / ref)
        profile = load_profile(ref)
        n = max(1, samples.get(dev_id, 1))
        pinned = group.arch or (group.archs[k % len(group.archs)] if group.archs else None)
        p = plan(profile, embed_dim=cfg.run.embed_dim, samples=n, specs=specs, run=run_budget(cfg),
                 pin=pinned_tier(pinned, specs))
        arch = pinned or p.arch
        spec = device_arch_spec(cfg, arch)
        batch = cfg.train.batch_size or p.batch_size
        epochs = cfg.train.local_epochs or p.local_epochs
        speed = speed_model(profile)
        out.append(DevicePlan(
            device_id=dev_id, profile=profile, arch=arch, batch_size=batch, local_epochs=epochs, samples=n,
            macs=spec.macs(), train_memory_mb=train_memory_mb(spec, batch),
            round_time_s=speed.train_seconds(spec, batch, samples=n, epochs=epochs),
            upload_precision=p.upload_precision, params=spec.num_params(), mac_rate=speed.mac_rate(spec, batch),
        ))
    return out


@dataclass(frozen=True)
class DeviceLimits:
    """What one device container gets."""

    device_id: str
    profile: str
    cpus: float
    """Fraction of host cores: CFS quota ÷ period (:attr:`cpu_quota_us`, :attr:`cpu_period_us`)."""
    cpus_wanted: float
    """What the profile's speed needs; more than ``cpus`` when the host has too few cores."""
    threads: int
    """torch threads in the container (``OMP_NUM_THREADS``): enough to use the quota, at most the profile's cores."""
    mem_limit_mb: int
    uplink_kbit: int
    downlink_kbit: int
    delay_ms: float
    """One-way delay added on each direction: half the profile's round-trip time."""
    loss_pct: float
    host_mac_rate: float
    """Training MAC/s one host core reached on this device's model and batch (the calibration)."""
    device_mac_rate: float

    @property
    def cpu_period_us(self) -> int:
        """The CFS period (:func:`cpu_period_us`)."""
        return cpu_period_us(self.cpus)

    @property
    def cpu_quota_us(self) -> int:
        """CPU time per period: ``cpus × period``."""
        return round(self.cpus * self.cpu_period_us)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_period_us": self.cpu_period_us, "cpu_quota_us": self.cpu_quota_us}


def container_memory_mb(profile: Profile) -> int:
    """The container's memory limit: the profile's RAM less the OS share it does not emulate."""
    return profile.hardware.ram_mb - OS_SHARE_MB


def limits_for(dp: DevicePlan, host_mac_rate: float, *, host_cores: int, loss_pct: float = 0.0) -> DeviceLimits:
    """Container limits for ``dp``, given the host core's measured training rate on its model.

    A device faster than ``host_cores`` host cores gets them all (Docker allows no more); its
    ``cpus_wanted`` says how far short the emulation falls.
    """
    if host_mac_rate <= 0 or not math.isfinite(host_mac_rate):
        raise ValueError(f"host MAC rate must be positive, got {host_mac_rate}")
    rate = dp.mac_rate
    wanted = max(MIN_CPUS, round(rate / host_mac_rate, 3))
    cpus = min(wanted, float(host_cores))
    net = dp.profile.network
    return DeviceLimits(
        device_id=dp.device_id, profile=dp.profile.name, cpus=cpus, cpus_wanted=wanted,
        threads=max(1, min(dp.profile.hardware.cores, math.ceil(cpus))),
        mem_limit_mb=container_memory_mb(dp.profile),
        uplink_kbit=max(1, round(net.uplink_kbps)), downlink_kbit=max(1, round(net.downlink_kbps)),
        delay_ms=round(net.latency_ms / 2, 3), loss_pct=loss_pct,
        host_mac_rate=host_mac_rate, device_mac_rate=rate,
    )


def memory_need_mb(dp: DevicePlan) -> float:
    """What the plan needs in the container: the runtime share of the planner's reserve plus training."""
    return RUNTIME_RESERVE_MB - OS_SHARE_MB + dp.train_memory_mb


def oom_message(dp: DevicePlan) -> str:
    """The words `fedge emulate status` uses for a device the kernel killed for memory."""
    return (f"{dp.device_id} ran out of memory: its plan ({dp.arch} at batch {dp.batch_size}) needs "
            f"{dp.train_memory_mb:.0f} MiB for training on top of the "
            f"{RUNTIME_RESERVE_MB - OS_SHARE_MB} MiB of Python and torch, the profile {dp.profile.name} has "
            f"{dp.profile.hardware.ram_mb} MiB ({container_memory_mb(dp.profile)} MiB once the OS has its "
            f"{OS_SHARE_MB} MiB) and grants training {dp.profile.budgets.train_memory_mb:g} MiB")
