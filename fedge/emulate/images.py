"""Images of an emulated fleet, built from the top-level ``docker/`` directory when missing.

* base: ``FEDGE_BASE_IMAGE`` / ``--base-image``, else ``fedge-base:bookworm-ARCH`` made by
  ``docker/base-image.sh`` (debootstrap + docker import: no registry needed);
* wheels: ``docker/wheelhouse.sh`` into ``~/.cache/fedge/wheelhouse/ARCH`` (dependencies once,
  fedge's own wheel each build);
* device ``fedge-device:ARCH-<source hash>``, coordinator ``fedge-coordinator:<hash>`` (the amd64
  device image with another entry point) and broker ``fedge-broker:bookworm``.

The tags carry a hash of fedge's source, so a code change builds new fedge layers (the dependency
layers come from Docker's cache) and an unchanged checkout reuses its images.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import fedge
from fedge.emulate.compose import Images
from fedge.emulate.discovery import docker_sdk
from fedge.errors import EmulationError

log = logging.getLogger(__name__)

ARCHES = ("amd64", "arm64")
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def docker_dir() -> Path:
    """The repository's ``docker/`` directory (Dockerfiles and scripts)."""
    d = Path(os.environ.get("FEDGE_DOCKER_DIR", Path(fedge.__file__).resolve().parent.parent / "docker"))
    if not (d / "device.Dockerfile").is_file():
        raise EmulationError(f"no Dockerfiles in {d}",
                             hint="run from a fedge checkout, or set FEDGE_DOCKER_DIR to its docker/ directory")
    return d


def source_hash() -> str:
    """12 hex digits over fedge's source files, pyproject.toml and docker/: the images' version tag.

    docker/ counts too: a change to a Dockerfile or to device-boot.sh (copied into the device image)
    must not reuse an image built from the old one.
    """
    root = Path(fedge.__file__).resolve().parent
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".toml", ".sh") and "__pycache__" not in p.parts)
    extra = [root.parent / "pyproject.toml", *sorted((root.parent / "docker").glob("*"))]
    for p in [*files, *(f for f in extra if f.is_file())]:
        h.update(str(p.relative_to(root.parent)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def image_tags(arch: str, h: str | None = None) -> Images:
    """The images of an emulation on ``arch`` for fedge source hash ``h`` (default: this checkout's)."""
    h = h or source_hash()
    return Images(device=f"fedge-device:{arch}-{h}", coordinator=f"fedge-coordinator:{h}",
                  broker=os.environ.get("FEDGE_BROKER_IMAGE", "fedge-broker:bookworm"))


def check_arch(arch: str) -> None:
    """Raise with the fix when ``arch`` containers cannot run here (foreign arch without binfmt)."""
    if arch not in ARCHES:
        raise EmulationError(f"--arch {arch}: unknown", hint=f"use one of {', '.join(ARCHES)}")
    host = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    if arch == host:
        return
    qemu = "qemu-aarch64" if arch == "arm64" else "qemu-x86_64"
    entry = BINFMT / qemu
    if not entry.is_file() or "enabled" not in entry.read_text():
        raise EmulationError(
            f"{arch} containers cannot run on this {host} host: binfmt_misc has no enabled {qemu} handler "
            f"({entry} is missing)",
            hint="install Debian's qemu-user-static, then as root: mount -t binfmt_misc binfmt_misc "
                 f"{BINFMT} 2>/dev/null; cat /usr/lib/binfmt.d/{qemu}.conf > {BINFMT}/register "
                 "(or run: docker run --privileged --rm tonistiigi/binfmt --install arm64 where a registry is "
                 "reachable)")


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise EmulationError(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}",
                             hint=f"run it by hand to see everything: {' '.join(cmd)}")


def _exists(client: Any, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker_sdk().errors.ImageNotFound:
        return False


def ensure_base(client: Any, arch: str, base: str | None) -> str:
    """The base image: the one given, else fedge's debootstrap image (built when missing)."""
    tag = base or os.environ.get("FEDGE_BASE_IMAGE") or f"fedge-base:bookworm-{arch}"
    if _exists(client, tag):
        return tag
    if base or os.environ.get("FEDGE_BASE_IMAGE"):
        raise EmulationError(f"base image {tag} is not on this Docker engine",
                             hint=f"docker pull {tag}, or leave --base-image out to build one with debootstrap")
    if shutil.which("debootstrap") is None:
        raise EmulationError(f"no base image {tag} and no debootstrap to build one",
                             hint="apt-get install debootstrap, or pass --base-image python:3.11-slim-bookworm "
                                  "where a registry is reachable")
    _run(["sh", str(docker_dir() / "base-image.sh"), "--arch", arch, "--tag", tag], f"building {tag}")
    return tag


def wheelhouse(arch: str) -> Path:
    """The wheelhouse for ``arch`` (dependencies reused, fedge's wheel rebuilt)."""
    out = Path(os.environ.get("FEDGE_WHEELHOUSE", Path.home() / ".cache" / "fedge" / "wheelhouse")) / arch
    env = {**os.environ, "PIP": f"{sys.executable} -m pip"}
    _run(["sh", str(docker_dir() / "wheelhouse.sh"), "--arch", arch, "--out", str(out)], f"wheelhouse for {arch}",
         env=env)
    return out


def _build(client: Any, ctx: Path, dockerfile: str, tag: str, buildargs: dict[str, str]) -> None:
    log.info("building %s from %s", tag, dockerfile)
    try:
        client.images.build(path=str(ctx), dockerfile=dockerfile, tag=tag, buildargs=buildargs, rm=True,
                            forcerm=True, network_mode="none")
    except docker_sdk().errors.BuildError as exc:
        tail = "".join(str(c.get("stream", c.get("error", ""))) for c in list(exc.build_log)[-15:])
        raise EmulationError(f"building {tag} failed: {exc.msg}\n{tail.strip()}",
                             hint=f"build by hand to see the whole log: docker build -f {dockerfile} {ctx}") from exc


def ensure_images(client: Any, arch: str = "amd64", *, base: str | None = None) -> Images:
    """Build whatever image of this emulation is missing; returns the tags."""
    check_arch(arch)
    h = source_hash()  # once: the tags must agree even if the checkout changes while images build
    tags = image_tags(arch, h)
    ddir = docker_dir()
    wanted = {arch} | ({"amd64"} if not _exists(client, tags.coordinator) else set())
    for a in sorted(wanted):
        dev = image_tags(a, h).device
        if _exists(client, dev):
            continue
        base_tag = ensure_base(client, a, base if a == arch else None)
        wheels = wheelhouse(a)
        with tempfile.TemporaryDirectory(prefix="fedge-ctx-") as tmp:
            ctx = Path(tmp)
            shutil.copytree(wheels, ctx / "wheels", copy_function=_link_or_copy)
            for f in ("device.Dockerfile", "device-boot.sh", "shape-link.sh"):
                shutil.copy(ddir / f, ctx / f)
            _build(client, ctx, "device.Dockerfile", dev, {"BASE_IMAGE": base_tag})
    with tempfile.TemporaryDirectory(prefix="fedge-ctx-") as tmp:
        ctx = Path(tmp)
        for f in ("coordinator.Dockerfile", "broker.Dockerfile"):
            shutil.copy(ddir / f, ctx / f)
        if not _exists(client, tags.coordinator):
            _build(client, ctx, "coordinator.Dockerfile", tags.coordinator,
                   {"DEVICE_IMAGE": image_tags("amd64", h).device})
        if not _exists(client, tags.broker):
            _build(client, ctx, "broker.Dockerfile", tags.broker,
                   {"BASE_IMAGE": ensure_base(client, "amd64", None)})
    return tags


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
