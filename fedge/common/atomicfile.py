"""Writing a file atomically, with its mode (and owner) set before any byte is in it.

Secrets (passwords, private keys, the replay guard) must never exist, even for an instant, with the umask's
mode, and a crash must never leave half a file: the bytes go to a new temporary file created with the final
mode, are fsync'd, and the file is renamed over the target.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644,
                 owner: tuple[int, int] | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably, created with ``mode`` (never the umask's) and ``owner``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have cleared bits of ``mode``
        if owner is not None:
            os.fchown(fd, *owner)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
