"""One atomic write (``fedge.common.atomicfile``): its guarantees, and that no module writes a second one."""

from __future__ import annotations

import os
import re
import stat
import threading
from pathlib import Path

import pytest

from fedge.common import atomicfile
from fedge.common.atomicfile import rename_atomic, write_atomic

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


def test_a_rename_swaps_in_whole_and_durably(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rename_atomic: what was staged beside its target (a directory, a symlink, a key written ahead) replaces
    it in one step, and the directories that changed are fsynced (both, when it moves between two)."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(atomicfile.os, "fsync", spy)
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "model.onnx").write_bytes(b"new")
    rename_atomic(tmp_path / "stage", tmp_path / "current")
    assert (tmp_path / "current" / "model.onnx").read_bytes() == b"new" and not (tmp_path / "stage").exists()
    assert synced == [str(tmp_path)]
    synced.clear()
    (tmp_path / "keys").mkdir()
    (tmp_path / "next.key").write_bytes(b"k2")
    rename_atomic(tmp_path / "next.key", tmp_path / "keys" / "signing.key")
    assert (tmp_path / "keys" / "signing.key").read_bytes() == b"k2"
    assert synced == [str(tmp_path / "keys"), str(tmp_path)]
    synced.clear()
    os.symlink("current", tmp_path / "link.tmp")
    rename_atomic(tmp_path / "link.tmp", tmp_path / "link", durable=False)
    assert os.readlink(tmp_path / "link") == "current" and synced == []


def test_a_file_system_without_modes_is_tolerated_only_when_asked(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A FAT boot partition mounted without ``quiet`` refuses chmod (EPERM): fedge flash's hook files accept
    the partition's modes (modeless_ok); anything else, a secret above all, fails and leaves nothing behind."""
    def fat(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(atomicfile.os, "fchmod", fat)
    write_atomic(tmp_path / "firstrun.sh", b"#!/bin/sh\n", 0o755, modeless_ok=True)
    assert (tmp_path / "firstrun.sh").read_bytes() == b"#!/bin/sh\n"
    with pytest.raises(PermissionError):
        write_atomic(tmp_path / "secret.key", b"k", 0o600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["firstrun.sh"]


def test_no_module_renames_a_file_by_hand() -> None:
    """Every replacement goes through fedge.common.atomicfile: file contents through write_atomic, a staged
    directory, symlink or key through rename_atomic."""
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fedge").rglob("*.py")
                   if re.search(r"\bos\.(replace|rename)\(|\.(replace|rename)\((tmp|stage)", p.read_text())
                   and p.name != "atomicfile.py")
    assert found == [], (f"{found} rename by hand: use fedge.common.atomicfile.write_atomic (a file's content: "
                         "fsync, mode, clean-up after a failure) or rename_atomic (a staged directory or link)")
