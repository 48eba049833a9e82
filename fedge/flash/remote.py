"""Install a device over SSH (``fedge flash --ssh USER@HOST``): copy the payload, run its install.sh.

The payload is written to a local scratch directory by the same code as
``--to`` (no first-boot hook: the device is already running), copied with
``scp -r`` to ``--remote-dir`` and installed with ``ssh USER@HOST sh
DIR/fedge/install.sh ...`` (through ``sudo -n`` unless the user is root).
``--ssh-option`` passes ``-o`` options (port, identity file, host-key
checking) to both commands.
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from fedge.errors import ConfigError, FedgeError
from fedge.flash.flash import Listing, flash_dir
from fedge.flash.payload import PAYLOAD_DIR, DevicePlan, Source

log = logging.getLogger(__name__)

_TARGET = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.:_\[\]-]+$")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"--ssh needs the {name} command", hint="apt-get install openssh-client")
    return path


def flash_ssh(target: str, plan: DevicePlan, *, options: list[str] | None = None, remote_dir: str = "/tmp/fedge-flash",
              install_args: list[str] | None = None, dry_run: bool = False, wheels: list[Source] | None = None,
              timeout_s: float = 1800.0) -> Listing:
    """Copy ``plan``'s payload to ``target`` and run its install.sh there."""
    if not _TARGET.match(target):
        raise ConfigError(f"--ssh {target!r}", hint="give USER@HOST, e.g. pi@192.168.1.20")
    user = target.split("@", 1)[0]
    opts = [a for o in options or [] for a in ("-o", o)]
    base = ["-o", "BatchMode=yes", *opts]
    with tempfile.TemporaryDirectory(prefix="fedge-flash-") as tmp:
        stage = Path(tmp)
        listing = flash_dir(stage, plan, init="none", force=True, dry_run=dry_run, wheels=wheels)
        if dry_run:
            return listing
        ssh, scp = _tool("ssh"), _tool("scp")
        rdir = shlex.quote(remote_dir)
        steps = [
            ([ssh, *base, target, f"rm -rf {rdir}/{PAYLOAD_DIR} && mkdir -p {rdir}"], "preparing " + remote_dir),
            ([scp, "-q", "-r", *base, str(stage / PAYLOAD_DIR), f"{target}:{remote_dir}/"], "copying the payload"),
        ]
        sudo = "" if user == "root" else "sudo -n "
        args = " ".join(shlex.quote(a) for a in install_args or [])
        steps.append(([ssh, *base, target, f"{sudo}sh {rdir}/{PAYLOAD_DIR}/install.sh {args}".strip()],
                      "running install.sh"))
        for cmd, what in steps:
            log.info("%s: %s", what, " ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout_s)
            if proc.returncode != 0:
                raise FedgeError(f"--ssh {target}: {what} failed (exit {proc.returncode}): "
                                 f"{(proc.stderr or proc.stdout).strip()[-500:]}",
                                 hint="check that `ssh " + target + "` works without a password prompt (a key), "
                                      "and that the user may run sudo without a password")
            if proc.stdout.strip():
                log.info("%s", proc.stdout.strip())
    return listing
