"""What one device needs to join its fleet, as files: the flash payload (docs/flash.md).

Layout (under the boot partition, ``BOOT/fedge/``)::

    payload.json          device, fleet, profile, CPU arch, fedge version, every file's size and sha256
    bundle/               the device bundle as `fedge broker config` wrote it (password 0600)
    model/                with --export: the device's exported ONNX directory (manifest + graphs)
    wheels/               with --wheels: an offline wheelhouse of fedge[device] (fedge[sim] for a fleet without
                          [data] classes) for the device's CPU and Python
    install.sh            idempotent installer (--prefix, --venv, --no-systemd)
    fedge-edge.service    the hardened systemd unit; ExecStart is the launcher install.sh writes
    fedge-install.service installs fedge at the first boot with a network (enabled by firstrun.sh)

:func:`prepare` checks everything first (device id, profile and plan, bundle,
exported model) and lists the files; :func:`write_payload` writes them into a
staging directory and swaps it in, so a payload is never half-written.
Writing is deterministic: the same inputs give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fedge import __version__
from fedge.common.atomicfile import rename_atomic
from fedge.errors import ConfigError, ExportError, FedgeError, ProfileError
from fedge.fleet.shards import Shard, parse_address

log = logging.getLogger(__name__)

PAYLOAD_DIR = "fedge"
PAYLOAD_FORMAT = "fedge-flash/1"
MANIFEST_NAME = "manifest.json"
SECRET_NAMES = ("password", "device.key")
# The wheelhouse's Python when the profile does not say (Raspberry Pi OS bookworm ships 3.11).
DEFAULT_PYTHON = "3.11"


@dataclass(frozen=True)
class Source:
    """One payload file: where it comes from (a path) or its content, and its mode."""

    rel: str  # path under BOOT/fedge/
    path: Path | None = None
    content: bytes | None = None
    mode: int = 0o644

    def data(self) -> bytes:
        if self.content is not None:
            return self.content
        assert self.path is not None
        return self.path.read_bytes()

    @property
    def size(self) -> int:
        return len(self.content) if self.content is not None else (self.path.stat().st_size if self.path else 0)


@dataclass
class DevicePlan:
    """Everything checked about one device before anything is written."""

    device_id: str
    fleet: str
    fleet_config: Path
    profile: str
    cpu_arch: str
    python: str
    own_data: bool
    broker: str
    arch: str | None  # the architecture the fleet config pins (the plan's own choice depends on the data)
    files: list[Source] = field(default_factory=list)
    wheels: list[Path] = field(default_factory=list)

    @property
    def install_extra(self) -> str:
        """The fedge extra the device installs: ``device`` to train on its own data; ``sim`` on a fleet without
        ``[data] classes``, whose devices rebuild their share of the benchmark data set (digits needs
        scikit-learn, CIFAR-10 torchvision)."""
        return "device" if self.own_data else "sim"

    def info(self) -> dict[str, Any]:
        """payload.json without its file list."""
        return {"format": PAYLOAD_FORMAT, "device_id": self.device_id, "fleet": self.fleet, "profile": self.profile,
                "cpu_arch": self.cpu_arch, "python": self.python, "fedge_version": __version__,
                "own_data": self.own_data, "install_extra": self.install_extra, "broker": self.broker,
                "arch": self.arch}


def _template(name: str) -> str:
    return resources.files("fedge.flash").joinpath("templates", name).read_text(encoding="utf-8")


def render(name: str, plan: DevicePlan) -> bytes:
    """A template with the device's values filled in (device ids and fleet names are plain names)."""
    text = _template(name)
    for key, value in (("@DEVICE_ID@", plan.device_id), ("@FLEET@", plan.fleet), ("@VERSION@", __version__),
                       ("@OWN_DATA@", "1" if plan.own_data else "0"), ("@EXTRA@", plan.install_extra)):
        text = text.replace(key, value)
    return text.encode()


def _device_arch(cfg: Any, device_id: str) -> tuple[str | None, int]:
    """(architecture the fleet config pins for the device or None, its [[devices]] group index)."""
    from fedge.fleet.config import device_ids

    ids = device_ids(cfg)
    known = [i for i, _ in ids]
    if device_id not in known:
        raise ConfigError(f"{cfg.source} has no device {device_id!r}",
                          hint=f"its devices are {', '.join(known[:8])}{' ...' if len(known) > 8 else ''}")
    idx = known.index(device_id)
    gi = ids[idx][1]
    group = cfg.devices[gi]
    k = sum(1 for _, g in ids[:idx] if g == gi)
    return group.arch or (group.archs[k % len(group.archs)] if group.archs else None), gi


def check_bundle(broker_dir: Path, device_id: str, fleet_config: Path) -> Path:
    """The device's bundle directory under ``broker_dir``, checked against the fleet config."""
    if not broker_dir.is_dir():
        raise ConfigError(f"broker directory {broker_dir} does not exist",
                          hint=f"write it first: fedge broker config --fleet {fleet_config} --out {broker_dir}")
    bdir = broker_dir / "bundles" / device_id
    if not (bdir / "bundle.toml").is_file():
        raise ConfigError(f"{broker_dir} has no bundle for {device_id} ({bdir}/bundle.toml)",
                          hint=f"(re)write the broker config with this fleet: fedge broker config --fleet "
                               f"{fleet_config} --out {broker_dir}")
    copied = bdir / "fleet.toml"
    if copied.is_file() and copied.read_bytes() != fleet_config.read_bytes():
        raise ConfigError(f"{copied} differs from {fleet_config}: the bundle was written for another version "
                          "of the fleet config",
                          hint=f"rewrite the bundles (passwords are kept): fedge broker config --fleet "
                               f"{fleet_config} --out {broker_dir}")
    return bdir


def check_shard_broker(layout: list[Shard], device_id: str, broker: str, bdir: Path) -> None:
    """With ``[[shards]]``, the bundle must name the broker of the device's shard (the host and port there)."""
    shard = next((s for s in layout if device_id in s.devices), None)
    if shard is None:
        return
    _, host, port = parse_address(broker, f"{bdir}/bundle.toml")
    if (host, port) != (shard.host, shard.port):
        raise ConfigError(f"{bdir}/bundle.toml names broker {broker!r}, but [[shards]] puts {device_id} on shard "
                          f"{shard.name!r} at {shard.host}:{shard.port}",
                          hint=f"rewrite the bundles from the fleet config (passwords are kept): fedge broker "
                               f"config --fleet FLEET.toml --out {bdir.parent.parent}")


def check_certificate(broker_dir: Path, bdir: Path, device_id: str, bundle: dict[str, Any]) -> None:
    """A mutual-TLS bundle's certificate: present, issued by the fleet CA for this device, not expired, not
    revoked (``ca/index.json``); flashing a card the broker would refuse is an error naming the fix."""
    from fedge.broker.identity import cert_problem, tree_root
    from fedge.broker.pki import INDEX_NAME, CertIndex, load_cert

    rotate = f"fedge broker rotate {device_id} --out {tree_root(broker_dir) or broker_dir}"
    crt, key = bdir / str(bundle.get("cert_file")), bdir / str(bundle.get("key_file", "device.key"))
    if not crt.is_file() or not key.is_file():
        raise ConfigError(f"{bdir} has no certificate and key for {device_id} ({crt.name}, {key.name}): was it "
                          "revoked?", hint=f"issue a new one: {rotate}")
    ca = bdir / str(bundle.get("ca_file", "ca.crt"))
    if not ca.is_file():
        raise ConfigError(f"{ca} is missing", hint=f"rewrite the bundle: fedge broker config --mtls --out {broker_dir}")
    # a shard's directory of a sharded tree has no index: the tree's one, at its root, says what is revoked
    index_path = (tree_root(broker_dir) or broker_dir) / "ca" / INDEX_NAME
    problem = cert_problem(load_cert(crt), load_cert(ca), device_id,
                           CertIndex(index_path) if index_path.is_file() else None)
    if problem is not None:
        raise ConfigError(f"{crt}: the certificate of {device_id} cannot connect: {problem}",
                          hint=f"issue a new one: {rotate}")


def _manifest_for(export_dir: Path, device_id: str) -> Path:
    """The model directory of ``device_id`` in ``export_dir`` (an `fedge export` run or a single model)."""
    if (export_dir / device_id / MANIFEST_NAME).is_file():
        return export_dir / device_id
    if (export_dir / MANIFEST_NAME).is_file():
        return export_dir
    if not export_dir.is_dir():
        raise ExportError(f"--export {export_dir}: no such directory")
    others = sorted(p.name for p in export_dir.iterdir() if (p / MANIFEST_NAME).is_file())
    raise ExportError(f"{export_dir} holds no exported model for {device_id}"
                      + (f" (it has {', '.join(others[:6])})" if others else ""),
                      hint="export the device's model: fedge export --run RESULTS_DIR --out DIR, or give the "
                           "model directory of this device")


def check_export(export_dir: Path, plan: DevicePlan, classes: tuple[str, ...] | None) -> Path:
    """The device's model directory; refused when it was exported for another profile, model or class list."""
    from fedge.runtime.manifest import Manifest

    mdir = _manifest_for(export_dir, plan.device_id)
    path = mdir / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: not a readable manifest ({exc})") from exc
    m = Manifest.from_dict(raw, source=str(path))
    fix = f"export the model of {plan.device_id} (profile {plan.profile}) and flash again"
    if m.profile is not None and m.profile != plan.profile:
        raise ExportError(f"{mdir} was exported for profile {m.profile!r}, but {plan.device_id} is a "
                          f"{plan.profile!r}", hint=fix)
    if plan.arch is not None and m.arch != plan.arch:
        raise ExportError(f"{mdir} holds a {m.arch} model, but the fleet config gives {plan.device_id} "
                          f"{plan.arch}", hint=fix)
    if classes is not None and tuple(m.classes) != classes:
        raise ExportError(f"{mdir} classifies {list(m.classes)[:5]}..., the fleet's classes are {list(classes)[:5]}...",
                          hint=fix)
    device = raw.get("device_id") or raw.get("device")
    if isinstance(device, str) and device != plan.device_id:
        raise ExportError(f"{mdir} was exported for device {device!r}, not {plan.device_id!r}", hint=fix)
    for name, entry in m.files.items():
        f = mdir / name
        if not f.is_file() or f.stat().st_size != entry.bytes:
            raise ExportError(f"{mdir}: {name} is missing or not {entry.bytes} bytes as the manifest says",
                              hint="export the model again")
    return mdir


def prepare(device_id: str, fleet_config: str | os.PathLike[str], broker_dir: str | os.PathLike[str], *,
            export_dir: str | os.PathLike[str] | None = None, python: str | None = None,
            check_memory: bool = True) -> DevicePlan:
    """Check the device and collect its payload files (nothing is written).

    ``check_memory=False`` flashes a fleet config that pins a model or batch the profile's training memory
    does not hold (a warning instead of the error): ``fedge emulate`` runs such a device to show its
    out-of-memory kill.
    """
    from fedge.common.tomlconf import read_toml
    from fedge.fleet.config import load_fleet
    from fedge.fleet.slots import device_arch_spec, device_profile
    from fedge.profiles import plan as plan_profile
    from fedge.profiles.planner import train_memory_mb

    fleet_path = Path(fleet_config)
    cfg = load_fleet(fleet_path)
    arch, group = _device_arch(cfg, device_id)
    try:
        profile = device_profile(cfg, group)
        p = plan_profile(profile, embed_dim=cfg.run.embed_dim)
    except ProfileError as exc:
        raise ProfileError(f"{device_id}: {exc.message}",
                           hint=exc.hint or "give the device a profile whose training memory fits a model") from exc
    if p.train_memory_mb > profile.budgets.train_memory_mb:
        raise ProfileError(f"{device_id}: the plan needs {p.train_memory_mb:.0f} MiB of training memory, the "
                           f"profile grants {profile.budgets.train_memory_mb:g} MiB",
                           hint="raise budgets.train_memory_mb or choose a smaller model")
    # The fleet config may pin the architecture or the batch size (a simulation may overcommit on purpose;
    # a board would run out of memory): what the device will train must fit too.
    batch = cfg.train.batch_size or p.batch_size
    if arch is not None or batch != p.batch_size:
        need = train_memory_mb(device_arch_spec(cfg, arch or p.arch), batch)
        if need > profile.budgets.train_memory_mb and not check_memory:
            log.warning("%s: %s at batch %d needs %.0f MiB of training memory, profile %r grants %g MiB; "
                        "flashed anyway", device_id, arch or p.arch, batch, need, profile.name,
                        profile.budgets.train_memory_mb)
        elif need > profile.budgets.train_memory_mb:
            raise ProfileError(f"{device_id}: the fleet config has it train {arch or p.arch} at batch {batch}, "
                               f"which needs {need:.0f} MiB of training memory; profile {profile.name!r} grants "
                               f"{profile.budgets.train_memory_mb:g} MiB (its plan picks {p.arch} at batch "
                               f"{p.batch_size})",
                               hint=f"drop arch/archs or [train] batch_size from {cfg.source} for this device's "
                                    "group (the plan then decides), or give it a profile with more memory")
    bdir = check_bundle(Path(broker_dir), device_id, fleet_path)
    bundle = read_toml(bdir / "bundle.toml")
    if bundle.get("device_id") != device_id:
        raise ConfigError(f"{bdir}/bundle.toml is for device {bundle.get('device_id')!r}, not {device_id!r}")
    if bundle.get("cert_file") is not None:
        check_certificate(Path(broker_dir), bdir, device_id, bundle)
    check_shard_broker(cfg.shard_layout, device_id, str(bundle.get("broker", "")), bdir)
    dp = DevicePlan(device_id, cfg.run.fleet, fleet_path, profile.name, profile.hardware.arch,
                    python or DEFAULT_PYTHON, cfg.own_data, str(bundle.get("broker", "")), arch)
    files = dp.files
    for f in sorted(bdir.iterdir()):
        if f.is_file():
            files.append(Source(f"bundle/{f.name}", path=f, mode=0o600 if f.name in SECRET_NAMES else 0o644))
    if export_dir is not None:
        mdir = check_export(Path(export_dir), dp, cfg.data.classes if cfg.own_data else None)
        for f in sorted(mdir.rglob("*")):
            if f.is_file():
                files.append(Source(f"model/{f.relative_to(mdir)}", path=f))
    files.append(Source("install.sh", content=render("install.sh", dp), mode=0o755))
    files.append(Source("fedge-edge.service", content=render("fedge-edge.service", dp)))
    files.append(Source("fedge-install.service", content=render("fedge-install.service", dp)))
    return dp


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload_json(plan: DevicePlan, extra: list[Source], init: str, boot_files: list[str]) -> bytes:
    """payload.json: the device and every other payload file with its size and sha256, sorted."""
    entries = {}
    for s in sorted([*plan.files, *extra], key=lambda s: s.rel):
        data = s.data()
        entries[s.rel] = {"bytes": len(data), "sha256": sha256(data), "mode": f"{s.mode:04o}"}
    doc = {**plan.info(), "init": init, "boot_files": sorted(boot_files), "files": entries}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def set_mode(path: Path, mode: int) -> None:
    """chmod where the file system has modes (a FAT boot partition mounted without ``quiet`` refuses)."""
    try:
        os.chmod(path, mode)
    except PermissionError:
        log.debug("%s: no file modes here (FAT)", path)


def write_tree(target: Path, sources: list[Source]) -> None:
    """Write ``sources`` as ``target`` (a directory), via a staging copy swapped in at the end."""
    stage = target.with_name(target.name + ".new")
    old = target.with_name(target.name + ".old")
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    try:
        for s in sources:
            dest = stage / s.rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(s.data())
            set_mode(dest, s.mode)
        if target.exists():
            rename_atomic(target, old, durable=False)
        rename_atomic(stage, target)
    except OSError as exc:
        raise FedgeError(f"cannot write {target}: {exc}", hint="check that the boot partition is mounted "
                                                               "read-write and has space") from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
