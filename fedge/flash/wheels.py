"""An offline wheelhouse of ``fedge[device]`` for the device's CPU and Python (``fedge flash --wheels``).

``pip download --only-binary=:all: --platform TAG... --python-version X.Y``
fetches the dependencies built for the device (not for this machine); fedge
itself is built from the source tree with ``pip wheel --no-deps``. The
requirements are read from fedge's own package metadata (the ``device`` extra),
so the wheelhouse follows pyproject.toml.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fedge.errors import ConfigError, FedgeError
from fedge.flash.payload import Source

log = logging.getLogger(__name__)

# pip platform tags per `uname -m`, newest manylinux first (pip accepts any of them).
PLATFORMS: dict[str, tuple[str, ...]] = {
    "aarch64": ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"),
    "x86_64": ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"),
    "armv7l": ("manylinux_2_31_armv7l", "manylinux_2_17_armv7l", "manylinux2014_armv7l", "linux_armv7l"),
    "riscv64": ("manylinux_2_39_riscv64", "manylinux_2_31_riscv64", "linux_riscv64"),
}


def device_requirements(extra: str = "device", pyproject: Path | None = None) -> list[str]:
    """fedge's requirements for ``extra`` (the core + the extra, self-references like ``fedge[runtime]``
    resolved), from the source tree's pyproject.toml: the wheelhouse matches the fedge wheel built beside it."""
    import tomllib

    path = pyproject or source_tree() / "pyproject.toml"
    project = tomllib.loads(path.read_text())["project"]
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in extras:
            raise ConfigError(f"{path}: fedge has no extra {name!r}", hint=f"extras: {', '.join(extras)}")
        seen.add(name)
        for req in extras[name]:
            m = re.fullmatch(r"fedge\[([^\]]+)\]", req.replace(" ", ""))
            if m:
                todo += m.group(1).split(",")
            elif req not in out:
                out.append(req)
    return out


def download_command(cpu_arch: str, python: str, dest: Path, requirements: list[str]) -> list[str]:
    """The ``pip download`` command of the wheelhouse (binary wheels for the device only)."""
    if cpu_arch not in PLATFORMS:
        raise ConfigError(f"no wheel platform tags for CPU architecture {cpu_arch!r}",
                          hint=f"profiles with one of {', '.join(PLATFORMS)} can get a wheelhouse")
    if not re.fullmatch(r"3\.\d+", python):
        raise ConfigError(f"--python {python!r}", hint="give the device's Python as MAJOR.MINOR, e.g. 3.11")
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(dest),
           "--python-version", python, "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}"]
    for tag in PLATFORMS[cpu_arch]:
        cmd += ["--platform", tag]
    return cmd + requirements


def source_tree() -> Path:
    """The fedge source tree (with pyproject.toml) this fedge was imported from."""
    import fedge

    root = Path(fedge.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(f"--wheels builds fedge's own wheel from its source tree; {root} has no pyproject.toml",
                          hint="run fedge flash from a source checkout (pip install -e .)")
    return root


def build_wheelhouse(cpu_arch: str, python: str, dest: Path) -> list[Source]:
    """Download the device set into ``dest`` and return it as payload sources (``wheels/NAME.whl``)."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = device_requirements()
    cmd = download_command(cpu_arch, python, dest, reqs)
    log.info("downloading the wheelhouse: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise FedgeError(f"pip download for {cpu_arch} / Python {python} failed: {' '.join(tail)}",
                         hint="check the network; some packages (e.g. torch on armv7l) publish no wheels for "
                              "that platform: use an aarch64 OS image, or install from piwheels by hand")
    with tempfile.TemporaryDirectory() as tmp:
        # Build from a copy: building in place leaves build/ and fedge.egg-info in the source tree.
        src = Path(tmp) / "src"
        shutil.copytree(source_tree(), src, ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "tests", "benchmarks", "__pycache__", "*.egg-info", "build", "dist"))
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest),
                               str(src)], capture_output=True, text=True, check=False, cwd=tmp)
    if proc.returncode != 0:
        raise FedgeError(f"building fedge's wheel failed: {proc.stderr.strip()[-300:]}")
    return [Source(f"wheels/{w.name}", path=w) for w in sorted(dest.glob("*.whl"))]
