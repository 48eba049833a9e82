"""One atomic write (``fedge.common.atomicfile``): its guarantees, and that no module writes a second one."""

from __future__ import annotations

import os
import re
import stat
import threading
from pathlib import Path

import pytest

from fedge.common import atomicfile
from fedge.common.atomicfile import write_atomic

ROOT = Path(__file__).resolve().parent.parent


def test_the_file_has_its_mode_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "sub" / "public.pem", b"x" * 10, 0o644)
        write_atomic(tmp_path / "secret.key", b"y", 0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "sub" / "public.pem").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "secret.key").stat().st_mode) == 0o600
    assert (tmp_path / "sub" / "public.pem").read_bytes() == b"x" * 10


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, b"old")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicfile.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_durable_writes_fsync_the_file_and_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(atomicfile.os, "fsync", spy)
    write_atomic(tmp_path / "a", b"1")
    assert synced == ["file", "dir"]
    synced.clear()
    write_atomic(tmp_path / "b", b"2", durable=False)
    assert synced == []


def test_threads_replacing_one_file_never_share_a_temporary(tmp_path: Path) -> None:
    target = tmp_path / "relay.json"
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for _ in range(50):
                write_atomic(target, str(i).encode() * 100, durable=False)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = target.read_bytes()
    assert len(data) == 100 and len(set(data)) == 1  # one writer's whole content, never a mix
    assert [p.name for p in tmp_path.iterdir()] == ["relay.json"]


# Renames that are not a file's content replaced: each says why it is not write_atomic.
NOT_A_REWRITE = {
    "fedge/runtime/store.py": "a staged version directory renamed in; a symlink swapped",
    "fedge/export/exporter.py": "a staged export directory swapped in",
    "fedge/flash/payload.py": "a staged payload directory swapped in",
    "fedge/flash/flash.py": "a FAT boot partition, which has no file modes for write_atomic to set",
    "fedge/broker/config.py": "an existing CA key moved to its own directory",
    "fedge/broker/fleetkey.py": "the next fleet key, already written, promoted",
}


def test_every_file_replaced_by_a_rename_is_written_by_write_atomic() -> None:
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "fedge").rglob("*.py")
             if re.search(r"\bos\.(replace|rename)\(", p.read_text())} - {"fedge/common/atomicfile.py"}
    assert found <= set(NOT_A_REWRITE), (
        f"{sorted(found - set(NOT_A_REWRITE))} rename a temporary file by hand: use "
        "fedge.common.atomicfile.write_atomic (it fsyncs, sets the mode, cleans up after a failure)")
    assert set(NOT_A_REWRITE) <= found, f"stale entries: {sorted(set(NOT_A_REWRITE) - found)}"
