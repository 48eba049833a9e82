"""``[method]`` settings of the generative methods, parsed the same way by both halves (no torch)."""

from __future__ import annotations

from typing import Any

from fedge.errors import ConfigError

GEFL_GENERATORS = ("cvae", "dcgan")  # image level (GeFL)
GEFLF_GENERATORS = ("cvae", "dcgan", "ddpm")  # feature level (GeFL-F): DDPM-F too


def cfg_bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean ``[method]`` setting; refuses strings like "false" that TOML users may write."""
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"[method] {key} must be true or false, got {v!r}")
    return v


def cfg_int(cfg: dict[str, Any], key: str, default: int, minimum: int = 0) -> int:
    """An integer ``[method]`` setting of at least ``minimum``."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"[method] {key} must be an integer >= {minimum}, got {v!r}")
    return v


def cfg_float(cfg: dict[str, Any], key: str, default: float, minimum: float = 0.0, *,
              positive: bool = False) -> float:
    """A number ``[method]`` setting of at least ``minimum`` (``positive``: above 0, e.g. a learning rate)."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < minimum or (positive and v <= 0):
        bound = "> 0" if positive else f">= {minimum}"
        raise ConfigError(f"[method] {key} must be a number {bound}, got {v!r}")
    return float(v)


def generator_kind(cfg: dict[str, Any], level: str = "image") -> str:
    """``[method] generator`` of GeFL (``level = "image"``) or GeFL-F (``"feature"``), default "cvae"."""
    kind = cfg.get("generator", "cvae")
    allowed = GEFLF_GENERATORS if level == "feature" else GEFL_GENERATORS
    if kind not in allowed:
        hint = ("fedge's DDPM is feature-level only (DDPM-F): use method = \"geflf\""
                if kind == "ddpm" else f"use one of {', '.join(allowed)}")
        raise ConfigError(f"[method] generator must be one of {', '.join(allowed)}, got {kind!r}", hint=hint)
    return str(kind)
