"""Write a device's payload and first-boot hook into a boot-partition directory (``fedge flash --to``).

Idempotent: flashing the same device again gives byte-identical files, one
``cmdline.txt`` entry, one ``runcmd`` entry, and keeps the ``firstrun.sh`` that
was there before the first flash.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError, FedgeError
from fedge.flash.boot import INITS, Init, detect_init, hook_for, looks_like_boot
from fedge.flash.payload import PAYLOAD_DIR, DevicePlan, Source, payload_json, write_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listing:
    """What a flash writes: (path relative to the boot partition, bytes, mode) per file."""

    init: Init
    files: list[tuple[str, int, int]]

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n, _ in self.files)


def resolve_init(boot: Path, init: str | None) -> Init:
    if init is None or init == "auto":
        return detect_init(boot)
    if init not in INITS:
        raise ConfigError(f"--init {init!r}", hint=f"use one of {', '.join(INITS)} (default: detected)")
    return init  # type: ignore[return-value]


def check_boot(boot: Path, force: bool) -> None:
    if not boot.is_dir():
        raise ConfigError(f"--to {boot}: no such directory",
                          hint="mount the card's boot partition (e.g. /media/$USER/bootfs) and give its path")
    if not force and not looks_like_boot(boot):
        raise ConfigError(f"{boot} does not look like a boot partition (no cmdline.txt or config.txt)",
                          hint="give the mounted boot partition, or --force to write the payload into any directory")


def flash_dir(boot: Path, plan: DevicePlan, *, init: str | None = None, force: bool = False,
              dry_run: bool = False, wheels: list[Source] | None = None) -> Listing:
    """Write ``plan``'s payload to ``boot/fedge/`` and the first-boot hook to ``boot``."""
    check_boot(boot, force)
    kind = resolve_init(boot, init)
    hook = hook_for(kind, boot, plan)
    extra = [*hook.payload, *(wheels or [])]
    meta = Source("payload.json", content=payload_json(plan, extra, kind, list(hook.root)))
    sources = [*plan.files, *extra, meta]
    listing = Listing(kind, sorted([(f"{PAYLOAD_DIR}/{s.rel}", s.size, s.mode) for s in sources]
                                   + [(name, len(data), 0o644 if name != "firstrun.sh" else 0o755)
                                      for name, data in hook.root.items()]))
    if dry_run:
        return listing
    write_tree(boot / PAYLOAD_DIR, sources)
    for name, data in hook.root.items():
        path = boot / name
        try:  # durable: the card may be pulled right after; a FAT partition keeps its own modes
            write_atomic(path, data, 0o755 if name == "firstrun.sh" else 0o644, modeless_ok=True)
        except OSError as exc:
            raise FedgeError(f"cannot write {path}: {exc}") from exc
    log.info("flashed %s (%s hook) to %s: %d files, %d bytes", plan.device_id, kind, boot, len(listing.files),
             listing.total_bytes)
    return listing


def flash(device_id: str, fleet: str | os.PathLike[str], broker_dir: str | os.PathLike[str],
          to: str | os.PathLike[str], *, export: str | os.PathLike[str] | None = None, wheels: bool = False,
          wheel_indexes: tuple[str, ...] = (), python: str | None = None, init: str | None = None,
          force: bool = False, dry_run: bool = False, check_memory: bool = True) -> Listing:
    """``fedge flash DEVICE_ID --fleet F --broker-dir B --to TO`` as a function (the Python entry point).

    ``check_memory=False``: see :func:`fedge.flash.payload.prepare` (``fedge emulate`` only).
    """
    import tempfile

    from fedge.flash.payload import prepare

    plan = prepare(device_id, fleet, broker_dir, export_dir=export, python=python, check_memory=check_memory)
    with tempfile.TemporaryDirectory(prefix="fedge-wheels-") as tmp:
        sources: list[Source] = []
        if wheels and not dry_run:
            from fedge.flash.wheels import build_wheelhouse

            sources = build_wheelhouse(plan.cpu_arch, plan.python, Path(tmp), wheel_indexes, plan.install_extra)
        return flash_dir(Path(to), plan, init=init, force=force, dry_run=dry_run, wheels=sources)
