"""A boot partition and its first-boot hook: Raspberry Pi OS's ``firstrun.sh`` or cloud-init ``user-data``.

``firstrun``: Raspberry Pi Imager writes ``firstrun.sh`` at the root of the boot
partition and appends ``systemd.run=/boot/firstrun.sh
systemd.run_success_action=reboot systemd.unit=kernel-command-line.target`` to
``cmdline.txt``; at first boot systemd runs the script instead of the normal
boot, and reboots. fedge's hook takes that slot: an existing ``firstrun.sh``
(Imager's user, Wi-Fi and SSH settings) is kept as ``fedge/firstrun.previous.sh``
and run first, never overwritten. The kernel command line gets the entry once,
whatever was there.

``cloud-init`` (newer images; Imager writes ``user-data`` / ``meta-data`` /
``network-config`` on the boot partition): ``user-data`` is parsed and fedge's
install command appended to its ``runcmd`` (once), everything else kept.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedge.errors import ConfigError
from fedge.flash.payload import PAYLOAD_DIR, DevicePlan, Source, render

log = logging.getLogger(__name__)

Init = Literal["firstrun", "cloud-init", "none"]
INITS: tuple[str, ...] = ("firstrun", "cloud-init", "none")
BOOT_MARKERS = ("cmdline.txt", "config.txt")
CLOUD_FILES = ("user-data", "meta-data", "network-config")
FEDGE_MARK = "fedge-flash first-boot hook"
PREVIOUS = "firstrun.previous.sh"
# Where Raspberry Pi OS mounts the boot partition (bookworm and later).
BOOT_MOUNT = "/boot/firmware"
CMDLINE_ENTRY = (f"systemd.run={BOOT_MOUNT}/firstrun.sh systemd.run_success_action=reboot "
                 "systemd.unit=kernel-command-line.target")
RUNCMD = f"sh {BOOT_MOUNT}/{PAYLOAD_DIR}/install.sh >>/var/log/fedge-install.log 2>&1"


def looks_like_boot(boot: Path) -> bool:
    return any((boot / m).is_file() for m in BOOT_MARKERS)


def detect_init(boot: Path) -> Init:
    """cloud-init when the partition carries its seed files, firstrun when it has a kernel command line."""
    if any((boot / f).is_file() for f in CLOUD_FILES):
        return "cloud-init"
    if (boot / "cmdline.txt").is_file():
        return "firstrun"
    return "none"


@dataclass(frozen=True)
class HookFiles:
    """The first-boot hook: files at the partition root (name -> content) and extra payload files."""

    root: dict[str, bytes]
    payload: list[Source]


def cmdline_with_hook(cmdline: str) -> str:
    """``cmdline.txt`` (one line) with the firstrun entry exactly once; other arguments untouched."""
    line = " ".join(cmdline.split())
    if re.search(r"(^| )systemd\.run=\S*firstrun\.sh( |$)", line):
        # Imager's own entry (or ours from an earlier flash) already starts firstrun.sh: the hook replaces
        # that script, so the entry stays as it is.
        return line + "\n"
    if re.search(r"(^| )systemd\.run=", line):
        raise ConfigError(f"cmdline.txt already runs another first-boot program: {line}",
                          hint="remove its systemd.run= entry, or flash with --init none and run install.sh "
                               "yourself")
    return f"{line} {CMDLINE_ENTRY}".strip() + "\n"


def firstrun_hook(boot: Path, plan: DevicePlan) -> HookFiles:
    """firstrun.sh + cmdline.txt; an existing foreign firstrun.sh becomes fedge/firstrun.previous.sh."""
    cmd = boot / "cmdline.txt"
    if not cmd.is_file():
        raise ConfigError(f"{boot} has no cmdline.txt for the firstrun hook",
                          hint="flash a Raspberry Pi OS boot partition, or use --init cloud-init / none")
    payload = []
    previous = boot / PAYLOAD_DIR / PREVIOUS
    current = boot / "firstrun.sh"
    if current.is_file() and FEDGE_MARK not in current.read_text(errors="replace"):
        payload.append(Source(PREVIOUS, content=current.read_bytes(), mode=0o755))
    elif previous.is_file():
        payload.append(Source(PREVIOUS, content=previous.read_bytes(), mode=0o755))
    root = {"firstrun.sh": render("firstrun.sh", plan),
            "cmdline.txt": cmdline_with_hook(cmd.read_text()).encode()}
    return HookFiles(root, payload)


def merge_user_data(text: str | None, plan: DevicePlan) -> str:
    """cloud-config ``user-data`` with fedge's install appended to ``runcmd`` once; the rest kept."""
    import yaml

    data: Any = {}
    if text and text.strip():
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"user-data is not valid YAML: {exc}",
                              hint="fix user-data on the boot partition, or flash with --init firstrun") from exc
        if not text.lstrip().startswith("#cloud-config"):
            raise ConfigError("user-data is not a #cloud-config document (a script or MIME multipart)",
                              hint="merge fedge's install by hand: runcmd: [" + RUNCMD + "]")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError("user-data's top level is not a mapping", hint="fix user-data on the boot partition")
    runcmd = data.get("runcmd") or []
    if not isinstance(runcmd, list):
        raise ConfigError("user-data's runcmd is not a list", hint="fix user-data on the boot partition")
    if RUNCMD not in runcmd:
        runcmd.append(RUNCMD)
    data["runcmd"] = runcmd
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1000)
    return f"#cloud-config\n# {FEDGE_MARK}: fedge's install is the last runcmd entry (device {plan.device_id})\n{body}"


def cloud_init_hook(boot: Path, plan: DevicePlan) -> HookFiles:
    """user-data merged; meta-data written only when absent (its instance-id makes cloud-init run once)."""
    ud = boot / "user-data"
    root = {"user-data": merge_user_data(ud.read_text() if ud.is_file() else None, plan).encode()}
    if not (boot / "meta-data").is_file():
        root["meta-data"] = f"instance-id: fedge-{plan.device_id}\n".encode()
    return HookFiles(root, [])


def hook_for(init: Init, boot: Path, plan: DevicePlan) -> HookFiles:
    if init == "firstrun":
        return firstrun_hook(boot, plan)
    if init == "cloud-init":
        return cloud_init_hook(boot, plan)
    return HookFiles({}, [])
