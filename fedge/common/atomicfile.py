"""Replacing a file atomically: the one helper every module that rewrites a file uses (:func:`write_atomic`),
and the one rename that swaps in what was staged beside its target (:func:`rename_atomic`: a directory, a symlink,
a key file written ahead).

A crash must never leave half a file, and secrets (passwords, private keys, the replay guard) must never exist,
even for an instant, with the umask's mode: the bytes go to a new temporary file beside the target, created
with the final mode (and owner), and the temporary file is renamed over the target. With ``durable`` (the
default) the file's bytes are ``fsync``-ed before the rename and the directory after it, so that once
:func:`write_atomic` returns the new content survives a power cut (a checkpoint, a key, a relay's state); a
file that is only a convenience (a status file, one part of a resumable download) may pass ``durable=False``.
Plain Python: the runtime and the coordinator use it too.

A boot partition (FAT) mounted without ``quiet`` has no file modes and refuses ``chmod``: ``modeless_ok``
lets such a file system keep its own (``fedge flash``'s hook files); never for a secret.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644,
                 owner: tuple[int, int] | None = None, *, durable: bool = True, modeless_ok: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically, created with ``mode`` (never the umask's) and ``owner``;
    ``durable``: ``fsync`` the file before the rename and its directory after it; ``modeless_ok``: a file
    system that refuses ``chmod`` (FAT) keeps its own modes."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # one temporary name per process and thread: two writers of the same file never share one
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            try:
                os.fchmod(fd, mode)  # the umask may have cleared bits of ``mode``
            except PermissionError:
                if not modeless_ok:
                    raise
            if owner is not None:
                os.fchown(fd, *owner)
            view = memoryview(data)
            while view:  # os.write may write less than asked (a large buffer, a signal)
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no temporary file behind
        raise
    if durable:
        fsync_dir(target.parent)


def rename_atomic(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, durable: bool = True) -> None:
    """Rename ``src`` over ``dst`` in one step (a file, a symlink or an empty-or-absent directory's place, on one
    file system); ``durable``: ``fsync`` the directory (both, if they differ) so the rename survives a power cut.
    To replace a file's content, use :func:`write_atomic`."""
    os.replace(src, dst)
    if durable:
        fsync_dir(Path(dst).parent)
        if Path(src).parent.resolve() != Path(dst).parent.resolve():
            fsync_dir(Path(src).parent)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` directory ``path``, so that a rename or a new entry in it is on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
