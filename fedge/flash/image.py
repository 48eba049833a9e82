"""Flash into a disk image file without mounting it and without root (``fedge flash --image``).

The partition table is read with ``sfdisk --json`` (util-linux); the first FAT
partition is the boot partition; its files are read and written with mtools
(``mcopy``/``mdeltree``/``mdir`` on ``IMAGE@@OFFSET``). The files the hook
needs (``cmdline.txt``, ``config.txt``, ``firstrun.sh``, cloud-init's files,
an earlier payload's ``fedge/firstrun.previous.sh``) are copied out to a
scratch directory, the payload is written there by the same code as ``--to``,
and the result is copied back: ``fedge/`` replaced as a whole, the root files
overwritten.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fedge.errors import ConfigError, FedgeError
from fedge.flash.boot import BOOT_MARKERS, CLOUD_FILES, PREVIOUS
from fedge.flash.flash import Listing, flash_dir
from fedge.flash.payload import PAYLOAD_DIR, DevicePlan, Source

log = logging.getLogger(__name__)

# MBR partition types of FAT file systems, and the GPT type GUIDs a FAT boot partition carries.
FAT_MBR_TYPES = {"1", "4", "6", "b", "c", "e", "ef"}
FAT_GPT_TYPES = {"EBD0A0A2-B9E5-4433-87C0-68B6B72699C7", "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"}


@dataclass(frozen=True)
class Partition:
    """A FAT partition inside an image: its byte offset and size."""

    index: int
    offset: int
    size: int

    def spec(self, image: Path) -> str:
        return f"{image}@@{self.offset}"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"--image needs the {name} command", hint=f"apt-get install {package}")
    return path


def _run(args: list[str], what: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "MTOOLS_SKIP_CHECK": "1", "MTOOLS_NO_VFAT": "0"}
    proc = subprocess.run(args, capture_output=True, env=env, check=False)
    if proc.returncode != 0:
        raise FedgeError(f"{what} failed: {proc.stderr.decode(errors='replace').strip()[-400:]}")
    return proc


def fat_partition(image: Path) -> Partition:
    """The first FAT partition of ``image``'s partition table (MBR or GPT)."""
    if not image.is_file():
        raise ConfigError(f"--image {image}: no such file")
    sfdisk = _tool("sfdisk", "fdisk")
    proc = subprocess.run([sfdisk, "--json", str(image)], capture_output=True, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ConfigError(f"{image} has no partition table sfdisk can read",
                          hint="give a whole-disk image (e.g. a Raspberry Pi OS .img), not a single partition")
    table = json.loads(proc.stdout)["partitiontable"]
    sector = int(table.get("sectorsize", 512))
    gpt = table.get("label") == "gpt"
    for i, part in enumerate(table.get("partitions", [])):
        kind = str(part.get("type", "")).upper() if gpt else str(part.get("type", "")).lower()
        if kind in (FAT_GPT_TYPES if gpt else FAT_MBR_TYPES):
            p = Partition(i + 1, int(part["start"]) * sector, int(part["size"]) * sector)
            if p.offset + p.size > image.stat().st_size:
                raise ConfigError(f"{image}: partition {p.index} ends beyond the end of the file",
                                  hint="the image is truncated: copy it again")
            return p
    types = [str(p.get("type")) for p in table.get("partitions", [])]
    raise ConfigError(f"{image} has no FAT partition (partition types: {', '.join(types) or 'none'})",
                      hint="flash an image with a FAT boot partition (Raspberry Pi OS), or mount the boot "
                           "partition and use --to")


class FatImage:
    """Files of the FAT file system at ``partition`` of ``image``, through mtools."""

    def __init__(self, image: Path, partition: Partition) -> None:
        self.image = image
        self.part = partition
        self.mcopy = _tool("mcopy", "mtools")
        self.mdir = _tool("mdir", "mtools")
        self.mdeltree = _tool("mdeltree", "mtools")
        self.minfo = _tool("minfo", "mtools")
        proc = subprocess.run([self.minfo, "-i", partition.spec(image), "::"], capture_output=True, check=False,
                              env={**os.environ, "MTOOLS_SKIP_CHECK": "1"})
        if proc.returncode != 0:
            raise ConfigError(f"{image}: partition {partition.index} is marked FAT but holds no FAT file system",
                              hint="format it (mkfs.vfat) or give the right image")

    def exists(self, path: str) -> bool:
        proc = subprocess.run([self.mdir, "-b", "-i", self.part.spec(self.image), f"::/{path}"],
                              capture_output=True, check=False, env={**os.environ, "MTOOLS_SKIP_CHECK": "1"})
        return proc.returncode == 0

    def get(self, path: str, dest: Path) -> bool:
        """Copy ``::/path`` to ``dest`` (recursively for a directory); False when it does not exist."""
        if not self.exists(path):
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        _run([self.mcopy, "-s", "-n", "-o", "-i", self.part.spec(self.image), f"::/{path}", str(dest)],
             f"reading {path} from {self.image}")
        return True

    def put(self, src: Path, path: str) -> None:
        """Copy ``src`` (a file, or a directory recursively) to ``::/path``, replacing what was there."""
        if src.is_dir() and self.exists(path):
            _run([self.mdeltree, "-i", self.part.spec(self.image), f"::/{path}"], f"removing {path}")
        _run([self.mcopy, "-s", "-n", "-o", "-D", "o", "-i", self.part.spec(self.image), str(src), f"::/{path}"],
             f"writing {path} to {self.image}")


def flash_image(image: Path, plan: DevicePlan, *, init: str | None = None, dry_run: bool = False,
                wheels: list[Source] | None = None) -> Listing:
    """Flash ``plan`` into the boot partition inside ``image``."""
    fat = FatImage(image, fat_partition(image))
    with tempfile.TemporaryDirectory(prefix="fedge-flash-") as tmp:
        stage = Path(tmp) / "boot"
        stage.mkdir()
        for name in (*BOOT_MARKERS, "firstrun.sh", *CLOUD_FILES):
            fat.get(name, stage / name)
        fat.get(f"{PAYLOAD_DIR}/{PREVIOUS}", stage / PAYLOAD_DIR / PREVIOUS)
        before = {p.name: p.read_bytes() for p in stage.iterdir() if p.is_file()}
        listing = flash_dir(stage, plan, init=init, force=True, dry_run=dry_run, wheels=wheels)
        if dry_run:
            return listing
        fat.put(stage / PAYLOAD_DIR, PAYLOAD_DIR)
        for p in sorted(stage.iterdir()):
            if p.is_file() and before.get(p.name) != p.read_bytes():
                fat.put(p, p.name)
    log.info("flashed %s into %s (partition %d at byte %d)", plan.device_id, image, fat.part.index, fat.part.offset)
    return listing
