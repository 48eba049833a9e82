"""CPU microarchitectures: what one core sustains on a large fp32 matrix product, from published figures.

:mod:`fedge.profiles.speed` multiplies it by the size curve; the profile schema checks a
``hardware.uarch`` against :data:`UARCHES`. A profile that does not name its ``uarch`` gets the one its
``hardware.cpu`` string names, or the slowest known core of its architecture.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedge.errors import ProfileError

if TYPE_CHECKING:
    pass

_SBC = "geerlingguy/sbc-reviews, web/data/results.yml"


@dataclass(frozen=True)
class Uarch:
    """One CPU microarchitecture as the speed model sees it."""

    name: str
    """Key of :data:`UARCHES`, what a profile's ``hardware.uarch`` names (e.g. ``"cortex-a72"``)."""
    mac_per_cycle: float
    """Sustained fp32 multiply-accumulates per cycle per core on a large matrix product."""
    lanes: int
    """fp32 lanes of the SIMD unit the kernels use: selects the row of :data:`SIZE_CURVE`."""
    source: str
    """Where ``mac_per_cycle`` comes from (a published figure and how it was divided)."""


# Published HPL results (Jeff Geerling's SBC reviews; each board's issue in that repository holds the run):
#   Raspberry Pi 4 Model B (issue 4):  4 x Cortex-A72 @ 1.8 GHz, HPL 11.774 GFLOPS -> 1.635 per core-cycle
#   Raspberry Pi 5 Model B (issue 21): 4 x Cortex-A76 @ 2.4 GHz, HPL 37.888 GFLOPS -> 3.947
#   LattePanda Mu (issue 42):          Intel N100, 4 x Gracemont @ 3.4 GHz (max turbo), HPL 62.851 GFLOPS -> 4.621
#   Orange Pi CM4 (issue 26):          RK3566, 4 x Cortex-A55 @ 1.8 GHz, HPL 5.604 GFLOPS -> 0.778
# No HPL run of a Cortex-A53 board is in that data; its Geekbench 5 single-core scores give the A53's
# per-clock speed relative to the A72: Pi 3 B+ (issue 16, A53 @ 1.4 GHz) 108, Pi 4 (A72 @ 1.8 GHz) 271,
# so 108/1.4 ÷ 271/1.8 = 0.512 of the A72's 1.635 per cycle.
# No published CPU benchmark of the Jetson Nano (Cortex-A57) was found: the A57 has the A72's two 128-bit
# NEON pipes (Arm's Cortex-A57 and A72 technical reference manuals), and is taken as 0.9 of the A72 per
# clock for its older core; a [measured] table from the real board should replace it.
UARCHES: dict[str, Uarch] = {u.name: u for u in (
    Uarch("cortex-a53", round(1.635 * (108 / 1.4) / (271 / 1.8), 3), 4,
          f"Geekbench 5 single-core per GHz vs the A72: Pi 3 B+ 108 @ 1.4 GHz, Pi 4 271 @ 1.8 GHz ({_SBC}) "
          "x the A72's HPL figure"),
    Uarch("cortex-a55", round(5.604 / (4 * 1.8), 3), 4, f"HPL 5.604 GFLOPS, Orange Pi CM4, 4 x 1.8 GHz ({_SBC})"),
    Uarch("cortex-a57", round(0.9 * 11.774 / (4 * 1.8), 3), 4,
          "assumed 0.9 x the Cortex-A72 per clock (same two 128-bit NEON pipes); no published figure used"),
    Uarch("cortex-a72", round(11.774 / (4 * 1.8), 3), 4, f"HPL 11.774 GFLOPS, Raspberry Pi 4 B, 4 x 1.8 GHz ({_SBC})"),
    Uarch("cortex-a76", round(37.888 / (4 * 2.4), 3), 4, f"HPL 37.888 GFLOPS, Raspberry Pi 5 B, 4 x 2.4 GHz ({_SBC})"),
    # Gracemont runs AVX2 but splits every 256-bit operation into two on its 128-bit units: its balance of
    # GEMM throughput against the per-layer overheads of small models is a 128-bit core's, the 4-lane curve.
    Uarch("gracemont", round(62.851 / (4 * 3.4), 3), 4,
          f"HPL 62.851 GFLOPS, LattePanda Mu (Intel N100), 4 x 3.4 GHz max turbo ({_SBC})"),
)}

# Which microarchitecture a profile's ``hardware.cpu`` names, when ``hardware.uarch`` is not set.
_CPU_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"cortex[- ]?a53|\bbcm2837|\bbcm2710|\brp3a0", "cortex-a53"),
    (r"cortex[- ]?a55|\brk3566|\brk3568", "cortex-a55"),
    (r"cortex[- ]?a57|tegra ?x1", "cortex-a57"),
    (r"cortex[- ]?a72|\bbcm2711", "cortex-a72"),
    (r"cortex[- ]?a76|\bbcm2712", "cortex-a76"),
    (r"gracemont|\bn(50|95|97|100|150|200|300|305)\b|alder lake-n|twin lake", "gracemont"),
)
# A CPU the patterns do not know: the slowest known core of its architecture, so that a plan made for
# it errs towards a smaller model; the profile should name its ``uarch`` or carry measured figures.
_FALLBACK = {"aarch64": "cortex-a53", "armv7l": "cortex-a53", "riscv64": "cortex-a53", "x86_64": "gracemont"}

def check_uarch(name: str) -> None:
    """Raise :class:`ProfileError` unless ``name`` is a key of :data:`UARCHES` (with a suggestion)."""
    if name not in UARCHES:
        close = difflib.get_close_matches(name, UARCHES, n=1)
        raise ProfileError(f"uarch = {name!r}: unknown microarchitecture",
                           hint=(f"did you mean {close[0]!r}? " if close else "")
                           + f"known: {', '.join(UARCHES)}; or leave it out and add [measured] train_gmac_s")


def uarch_of(arch: str, cpu: str, uarch: str = "") -> tuple[Uarch, str]:
    """The microarchitecture of a profile's ``[hardware]`` (its ``arch``, ``cpu`` and ``uarch`` keys) and how
    it was found: the ``uarch`` key, the ``cpu`` string, or assumed for the architecture."""
    if uarch:
        check_uarch(uarch)
        return UARCHES[uarch], "hardware.uarch"
    for pattern, name in _CPU_PATTERNS:
        if re.search(pattern, cpu.lower()):
            return UARCHES[name], f"hardware.cpu {cpu!r}"
    name = _FALLBACK[arch]
    return UARCHES[name], f"assumed for an unknown {arch} CPU {cpu!r} (set hardware.uarch)"
