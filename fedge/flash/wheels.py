"""An offline wheelhouse of ``fedge[device]`` for the device's CPU and Python (``fedge flash --wheels``).

``pip download --only-binary=:all: --platform TAG... --python-version X.Y``
fetches wheels built for the device, not for this machine. pip evaluates
environment markers against the machine it runs on, though: resolving torch for
aarch64 on an x86_64 workstation pulls in torch's CUDA packages, whose markers
say ``platform_machine == "x86_64"``, and fails. So the closure is walked here:
each requirement is downloaded with ``--no-deps``, its wheel's ``Requires-Dist``
read and the markers evaluated for the *device* (``packaging.markers`` with the
device's machine and Python), until nothing is missing. fedge itself is built
from the source tree with ``pip wheel --no-deps``. The top-level requirements
are the ``device`` extra of the source tree's pyproject.toml.
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


def download_command(cpu_arch: str, python: str, dest: Path, requirements: list[str],
                     extra_indexes: tuple[str, ...] = ()) -> list[str]:
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
    for url in extra_indexes:  # e.g. PyTorch's CPU-only index: torch X+cpu sorts above PyPI's X
        cmd += ["--extra-index-url", url]
    return cmd + requirements


def source_tree() -> Path:
    """The fedge source tree (with pyproject.toml) this fedge was imported from."""
    import fedge

    root = Path(fedge.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(f"--wheels builds fedge's own wheel from its source tree; {root} has no pyproject.toml",
                          hint="run fedge flash from a source checkout (pip install -e .)")
    return root


def target_environment(cpu_arch: str, python: str) -> dict[str, str]:
    """PEP 508 marker values of the device (Linux, CPython ``python``, machine ``cpu_arch``)."""
    return {"platform_machine": cpu_arch, "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
            "python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "implementation_version": f"{python}.0",
            "platform_release": "", "platform_version": "", "extra": ""}


def _wheel_of(dest: Path, name: str) -> Path | None:
    from packaging.utils import canonicalize_name, parse_wheel_filename

    for w in sorted(dest.glob("*.whl")):
        if parse_wheel_filename(w.name)[0] == canonicalize_name(name):
            return w
    return None


def _requires(wheel: Path) -> list[str]:
    import zipfile
    from email.parser import HeaderParser

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return HeaderParser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


def download_closure(cpu_arch: str, python: str, dest: Path, requirements: list[str],
                     extra_indexes: tuple[str, ...] = ()) -> list[Path]:
    """Download ``requirements`` and everything they need on the device into ``dest`` (markers evaluated for the
    device, see the module docstring); returns the wheels."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    env = target_environment(cpu_arch, python)
    base = download_command(cpu_arch, python, dest, [], extra_indexes)
    todo = [(Requirement(r), frozenset[str]()) for r in requirements]
    got: dict[str, Path] = {}
    while todo:
        req, _ = todo.pop(0)
        name = canonicalize_name(req.name)
        if name in got:
            version = parse_wheel_filename(got[name].name)[1]
            if not req.specifier.contains(version, prereleases=True):
                raise FedgeError(f"the wheelhouse needs {req} but already holds {name} {version}",
                                 hint="pin compatible versions in pyproject.toml's extras")
            continue
        spec = f"{req.name}{req.specifier}"
        log.info("downloading %s for %s / Python %s", spec, cpu_arch, python)
        proc = subprocess.run([*base, "--no-deps", spec], capture_output=True, text=True, check=False)
        wheel = _wheel_of(dest, req.name)
        if proc.returncode != 0 or wheel is None:
            tail = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("WARNING")][-2:]
            cuda = " (PyPI's torch pulls CUDA packages" if name.startswith("nvidia-") else ""
            raise FedgeError(f"pip download of {spec} for {cpu_arch} / Python {python} failed{cuda and cuda + ')'}: "
                             f"{' '.join(tail)}",
                             hint="take torch from PyTorch's CPU-only index: --wheel-index "
                                  "https://download.pytorch.org/whl/cpu" if cuda else
                                  "check the network; some packages (e.g. torch on armv7l) publish no wheels for "
                                  "that platform: use a 64-bit OS image, or install from piwheels by hand")
        got[name] = wheel
        extras = req.extras or {""}
        for dep in _requires(wheel):
            r = Requirement(dep)
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append((r, frozenset(r.extras)))
    return sorted(got.values())


def build_wheelhouse(cpu_arch: str, python: str, dest: Path, extra_indexes: tuple[str, ...] = (),
                     extra: str = "device") -> list[Source]:
    """Download fedge[``extra``] into ``dest`` and return it as payload sources (``wheels/NAME.whl``)."""
    dest.mkdir(parents=True, exist_ok=True)
    download_closure(cpu_arch, python, dest, device_requirements(extra), extra_indexes)
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
