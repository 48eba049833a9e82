"""A device's model store: versions side by side, an atomic switch, the previous version kept, rollback.

Layout of ``STORE/``::

    versions/{n}/        one whole model directory per installed version (manifest.json + graphs)
    current -> versions/{n}    the model in use: a symbolic link, replaced atomically (rename(2))
    previous -> versions/{m}   the version before it, kept for a rollback
    state.json           the trial of a new version (unconfirmed starts), rolled-back versions, history
    incoming/            parts of a download in progress (``fedge deploy``'s chunks), kept across restarts

**Never a mix.** A version is written into ``.staging-{n}-{pid}`` (every file fsync'd), checked against its
manifest, and renamed to ``versions/{n}`` whole; switching writes a new link ``current.tmp`` and renames it
over ``current``, then fsyncs the directory. Whatever instant a ``kill -9`` or a power cut hits, ``current``
names a complete version, the old or the new one (``tests/test_ota.py`` kills the installer at random
moments to check). The links are the truth; ``state.json`` (written atomically after them) holds only what
the links cannot say, and a staging directory left by a crash is deleted when the store is opened.

**Trial and automatic rollback.** A newly switched-in version is *on trial*: each process that opens it
(:meth:`ModelStore.open_current`) counts a start, and the first that ran inference with it calls
:meth:`ModelStore.confirm`. When ``max_starts`` starts in a row never confirmed (the model crashes its user),
the next open switches back to the previous version by itself and records why.

Standard library only (numpy-free): this runs on the smallest device.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.atomicfile import fsync_dir, rename_atomic, write_atomic
from fedge.errors import ExportError, FedgeError
from fedge.runtime.manifest import read_manifest, verify_files
from fedge.runtime.package import ModelPackage

log = logging.getLogger(__name__)

STATE_NAME = "state.json"
MAX_STARTS = 3


class StoreError(FedgeError):
    """A model version cannot be installed, switched in or found (the store is left as it was)."""

    exit_code = 10


@dataclass
class Trial:
    """A version switched in but not yet confirmed by a process that ran inference with it."""

    version: int
    starts: int = 0


@dataclass
class StoreState:
    """What ``state.json`` holds besides the links."""

    trial: Trial | None = None
    rolled_back: dict[str, str] = field(default_factory=dict)  # version -> why it was rolled back
    history: list[dict[str, Any]] = field(default_factory=list)  # switches and rollbacks, newest last

    @classmethod
    def load(cls, path: Path) -> StoreState:
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
            trial = raw.get("trial")
            return cls(Trial(int(trial["version"]), int(trial["starts"])) if trial else None,
                       {str(k): str(v) for k, v in raw.get("rolled_back", {}).items()},
                       list(raw.get("history", []))[-50:])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("%s is unreadable (%s): starting its bookkeeping afresh (the links are intact)", path, exc)
            return cls()


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (a staging directory's owner) still runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class ModelStore:
    """The model store at ``root`` (created if missing)."""

    def __init__(self, root: str | os.PathLike[str], *, max_starts: int = MAX_STARTS) -> None:
        self.root = Path(root)
        self.max_starts = max_starts
        self.versions = self.root / "versions"
        self.incoming = self.root / "incoming"
        self.versions.mkdir(parents=True, exist_ok=True)
        self.incoming.mkdir(exist_ok=True)
        for leftover in self.root.glob(".staging-*"):  # a crash mid-install: never a version
            if not _alive(leftover.name.rsplit("-", 1)[-1]):  # (another process may be installing right now)
                shutil.rmtree(leftover, ignore_errors=True)
        (self.root / "current.tmp").unlink(missing_ok=True)
        (self.root / "previous.tmp").unlink(missing_ok=True)
        self.state = StoreState.load(self.root / STATE_NAME)

    # -- reading ---------------------------------------------------------------------------
    def _link(self, name: str) -> int | None:
        link = self.root / name
        if not link.is_symlink():
            return None
        target = os.readlink(link)
        try:
            return int(Path(target).name)
        except ValueError:
            return None

    @property
    def current(self) -> int | None:
        """The version in use (None: nothing installed)."""
        return self._link("current")

    @property
    def previous(self) -> int | None:
        return self._link("previous")

    def path(self, version: int) -> Path:
        return self.versions / str(version)

    def status(self) -> dict[str, Any]:
        """Version numbers and trial, for the device's status message."""
        trial = self.state.trial
        return {"version": self.current, "previous": self.previous,
                "trial": None if trial is None else asdict(trial), "rolled_back": dict(self.state.rolled_back)}

    # -- installing ------------------------------------------------------------------------
    def check_new(self, version: int) -> None:
        """Refuse a version that is not newer than the one in use, or that was rolled back here before."""
        cur = self.current
        if cur is not None and version <= cur:
            what = "the installed one" if version == cur else "older than the installed one"
            raise StoreError(f"model version {version} is {what} ({cur}): nothing changed",
                             hint="publish a higher --version (versions only go up; a rollback is automatic)")
        if str(version) in self.state.rolled_back:
            raise StoreError(f"model version {version} was rolled back on this device "
                             f"({self.state.rolled_back[str(version)]}): nothing changed",
                             hint="fix the model and publish it as a new version")

    def install(self, package: ModelPackage) -> Path:
        """Write ``package`` as ``versions/{n}`` (whole or not at all) and check it against its manifest."""
        self.check_new(package.version)
        final = self.path(package.version)
        stage = self.root / f".staging-{package.version}-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        try:
            for name, data in package.files.items():
                with open(stage / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(stage / name, 0o444)
            manifest = read_manifest(stage)
            verify_files(stage, manifest)
            fsync_dir(stage)
            if final.exists():  # an earlier install of it that was never switched in
                shutil.rmtree(final)
            rename_atomic(stage, final)
        except ExportError as exc:
            raise StoreError(f"model version {package.version} is not a whole export: {exc.message}",
                             hint="re-export the model and deploy it again") from exc
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return final

    def seed(self, model_dir: str | os.PathLike[str]) -> None:
        """An empty store starts from the flashed model as version 0 (any deployed version replaces it)."""
        if self.current is not None:
            return
        files = {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
        self.install(ModelPackage("", 0, files))
        self.activate(0)

    def _point(self, name: str, version: int | None) -> None:
        """Make link ``name`` point at ``versions/{version}`` (or remove it) atomically."""
        link = self.root / name
        if version is None:
            link.unlink(missing_ok=True)
            return
        tmp = self.root / f"{name}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(f"versions/{version}", tmp)
        rename_atomic(tmp, link)  # durable: a power cut after the switch keeps it

    def _save(self, event: dict[str, Any]) -> None:
        self.state.history = [*self.state.history[-49:], {"time": time.time(), **event}]
        path = self.root / STATE_NAME
        write_atomic(path, (json.dumps(asdict(self.state), indent=1) + "\n").encode())

    def activate(self, version: int) -> None:
        """Switch ``versions/{version}`` in (the one in use becomes ``previous``) and put it on trial."""
        if not (self.path(version) / "manifest.json").is_file():
            raise StoreError(f"model version {version} is not installed in {self.versions}")
        old = self.current
        if old is not None:
            self._point("previous", old)
        self._point("current", version)  # the switch: one rename
        fsync_dir(self.root)
        self.state.trial = Trial(version) if old is not None else None
        self._save({"event": "switched", "version": version, "from": old})
        self._prune(keep={version, old})
        log.info("model store %s: version %s in use (previous %s)", self.root, version, old)

    def _prune(self, keep: set[int | None]) -> None:
        """Delete versions other than the current and previous ones."""
        for d in self.versions.iterdir():
            if d.name.isdigit() and int(d.name) not in keep:
                shutil.rmtree(d, ignore_errors=True)

    def discard(self, version: int, reason: str) -> None:
        """A version that failed its checks before being switched in: delete it, remember why."""
        if version == self.current:
            raise StoreError(f"model version {version} is in use; roll back instead")
        shutil.rmtree(self.path(version), ignore_errors=True)
        self.state.rolled_back[str(version)] = reason
        self._save({"event": "refused", "version": version, "reason": reason})

    def rollback(self, reason: str) -> int:
        """Switch back to the previous version; the current one is remembered as rolled back. Returns the
        version now in use."""
        cur, prev = self.current, self.previous
        if cur is None or prev is None or not self.path(prev).is_dir():
            raise StoreError(f"model store {self.root} has no previous version to roll back to")
        self._point("current", prev)
        fsync_dir(self.root)
        self._point("previous", None)
        self.state.trial = None
        self.state.rolled_back[str(cur)] = reason
        self._save({"event": "rolled back", "version": cur, "to": prev, "reason": reason})
        with contextlib.suppress(OSError):
            shutil.rmtree(self.path(cur))
        log.warning("model store %s: rolled back from version %d to %d: %s", self.root, cur, prev, reason)
        return prev

    # -- using -----------------------------------------------------------------------------
    def open_current(self) -> Path:
        """The directory of the version in use, counting a start of a version on trial; after ``max_starts``
        unconfirmed starts in a row, it rolls back first (the new model crashes whoever uses it)."""
        cur = self.current
        if cur is None:
            raise StoreError(f"model store {self.root} holds no model yet",
                             hint="flash the device with --export, or deploy a model with `fedge deploy`")
        trial = self.state.trial
        if trial is not None and trial.version == cur:
            if trial.starts >= self.max_starts:
                self.rollback(f"crashed {trial.starts} times in a row before running inference")
                return self.path(self.current or 0)
            trial.starts += 1
            self._save({"event": "trial start", "version": cur, "starts": trial.starts})
        return self.path(cur)

    def confirm(self) -> None:
        """A process ran inference with the version in use: its trial is over."""
        trial = self.state.trial
        if trial is not None and trial.version == self.current:
            self.state.trial = None
            self._save({"event": "confirmed", "version": trial.version})
