"""Human-readable quantities for tables and status lines (no dependencies)."""

from __future__ import annotations


def format_bytes(n: float, *, binary: bool = True) -> str:
    """``n`` bytes as ``"512 B"``, ``"1.5 KiB"`` … (``binary``) or ``"1.5 kB"`` … (powers of 1000).

    Binary units for payload sizes (what a codec writes); decimal ones beside Docker's own figures,
    which count network bytes in powers of 1000.
    """
    base, units = (1024, ("B", "KiB", "MiB", "GiB")) if binary else (1000, ("B", "kB", "MB", "GB"))
    for unit in units[:-1]:
        if n < base:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    return f"{n:.1f} {units[-1]}"
