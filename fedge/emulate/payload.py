"""The flash payload an emulated device boots from (the contract in NOTES.md, written by `fedge flash`).

Until branch ``flash`` lands ``fedge flash``, :func:`flash_device` writes a minimal payload with
the contract's layout: ``fedge/payload.json``, ``fedge/bundle/`` (the device bundle of
``fedge broker config``), ``fedge/install.sh`` (``--prefix``, ``--no-systemd``, ``--venv``) and
``fedge/fedge-edge.service``. The container side (``docker/device-boot.sh``) uses only the
contract, so swapping this module for ``fedge flash`` changes nothing there.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

from fedge import __version__

INSTALL_SH = r"""#!/bin/sh
# Install this fedge payload (idempotent). Options: --prefix DIR, --no-systemd, --venv PATH.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=/
systemd=1
venv=/opt/fedge/venv
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --no-systemd) systemd=0; shift ;;
    --venv) venv=$2; shift 2 ;;
    *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
prefix=${prefix%/}
if ! "$venv/bin/python" -c "import fedge" 2>/dev/null; then
  if [ -d "$here/wheels" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --no-index --find-links "$here/wheels" fedge
  else
    echo "install.sh: fedge is not installed in $venv and this payload has no wheels/ (flash with --wheels)" >&2
    exit 1
  fi
fi
mkdir -p "$prefix/etc/fedge" "$prefix/var/lib/fedge/data" "$prefix/opt/fedge/bin"
rm -rf "$prefix/etc/fedge/bundle.new"
cp -r "$here/bundle" "$prefix/etc/fedge/bundle.new"
chmod 600 "$prefix/etc/fedge/bundle.new/password"
rm -rf "$prefix/etc/fedge/bundle"
mv "$prefix/etc/fedge/bundle.new" "$prefix/etc/fedge/bundle"
cat > "$prefix/opt/fedge/bin/fedge-edge" <<LAUNCH
#!/bin/sh
exec "$venv/bin/fedge" edge run --bundle "$prefix/etc/fedge/bundle" "\$@"
LAUNCH
chmod 755 "$prefix/opt/fedge/bin/fedge-edge"
if [ "$systemd" = 1 ]; then
  cp "$here/fedge-edge.service" /etc/systemd/system/fedge-edge.service
  systemctl daemon-reload && systemctl enable --now fedge-edge.service
fi
"""

SERVICE = """[Unit]
Description=fedge edge agent
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/opt/fedge/bin/fedge-edge
Restart=on-failure
RestartSec=10

[Install]
WantedBy=multi-user.target
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flash_device(device_id: str, profile: str, arch: str, bundle_dir: Path, boot_dir: Path) -> Path:
    """Write ``boot_dir/fedge/`` for ``device_id`` from its broker bundle; returns ``payload.json``."""
    root = boot_dir / "fedge"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(bundle_dir, root / "bundle")
    os.chmod(root / "bundle" / "password", 0o600)
    (root / "install.sh").write_text(INSTALL_SH)
    os.chmod(root / "install.sh", 0o755)
    (root / "fedge-edge.service").write_text(SERVICE)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    meta = {
        "device_id": device_id, "profile": profile, "arch": arch, "fedge_version": __version__,
        "written_by": f"fedge.emulate.payload on {platform.node()}",
        "files": [{"path": str(p.relative_to(root)), "size": p.stat().st_size, "sha256": _sha256(p)} for p in files],
    }
    out = root / "payload.json"
    out.write_text(json.dumps(meta, indent=1) + "\n")
    return out
