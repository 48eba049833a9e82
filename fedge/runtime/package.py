"""A model version as one byte string: what ``fedge deploy`` publishes and a device unpacks.

Layout (little-endian)::

    8 bytes   magic b"FDGMODEL"
    4 bytes   H = header length, uint32 (at most 64 KiB)
    H bytes   JSON: {"v": 1, "fleet": name, "version": n, "files": [{"name", "bytes", "sha256"}, ...]}
    rest      the files' bytes, back to back, in the header's order

The package travels inside a signed frame (:mod:`fedge.common.signing`), so a device verifies who made it
before this module reads a byte of it. Unpacking still treats the bytes as untrusted: names must be plain
file names (no directories, no ``..``), sizes must tile the data exactly, every file must match its
sha256, and the model's own ``manifest.json`` must be among them. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from fedge.common import boundedjson
from fedge.errors import PayloadError
from fedge.runtime.manifest import MANIFEST_NAME

MAGIC = b"FDGMODEL"
VERSION = 1
MAX_HEADER = 64 * 1024
MAX_FILES = 64
MAX_MODEL_VERSION = 2**53  # a JSON integer every language reads exactly
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True)
class ModelPackage:
    """A model version: its number and files (name → bytes)."""

    fleet: str
    version: int
    files: dict[str, bytes]

    def to_bytes(self) -> bytes:
        entries = [{"name": n, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                   for n, b in sorted(self.files.items())]
        header = json.dumps({"v": VERSION, "fleet": self.fleet, "version": self.version, "files": entries},
                            separators=(",", ":"), sort_keys=True).encode()
        return b"".join([MAGIC, struct.pack("<I", len(header)), header,
                         *(self.files[e["name"]] for e in entries)])  # type: ignore[index]


def pack_dir(model_dir: str | Path, fleet: str, version: int) -> ModelPackage:
    """The package of an exported model directory (its regular files, not recursing)."""
    root = Path(model_dir)
    files = {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}
    check_version(version)
    if MANIFEST_NAME not in files:
        raise PayloadError(f"{root} has no {MANIFEST_NAME}", hint="deploy a directory `fedge export` wrote")
    for name in files:
        if not _FILE_NAME.match(name):
            raise PayloadError(f"{root / name}: file names in a model must be plain names")
    return ModelPackage(fleet, version, files)


def check_version(version: object) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_MODEL_VERSION:
        raise PayloadError(f"model version must be an integer in [1, 2^53], got {str(version)[:32]!r}")
    return version


def unpack(data: bytes, *, max_bytes: int) -> ModelPackage:
    """Parse and check a package (see the module docstring); :class:`PayloadError` naming the problem."""
    if len(data) > max_bytes:
        raise PayloadError(f"model package of {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < 12 or data[:8] != MAGIC:
        raise PayloadError("not a fedge model package (bad magic)")
    (hlen,) = struct.unpack("<I", data[8:12])
    if hlen > MAX_HEADER or 12 + hlen > len(data):
        raise PayloadError(f"model package header length {hlen} is invalid")
    h = boundedjson.loads(data[12 : 12 + hlen], max_bytes=MAX_HEADER, max_depth=3, what="model package header")
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise PayloadError(f"model package format {str(h.get('v') if isinstance(h, dict) else h)[:16]!r} is not "
                           f"supported (this is {VERSION})")
    version = check_version(h.get("version"))
    fleet, entries = h.get("fleet"), h.get("files")
    if not isinstance(fleet, str) or not isinstance(entries, list) or not 1 <= len(entries) <= MAX_FILES:
        raise PayloadError("model package header needs a fleet name and 1-64 files")
    offset = 12 + hlen
    files: dict[str, bytes] = {}
    for e in entries:
        if not isinstance(e, dict) or set(e) != {"name", "bytes", "sha256"}:
            raise PayloadError("model package file entry must have exactly name, bytes, sha256")
        name, size, digest = e["name"], e["bytes"], e["sha256"]
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in files:
            raise PayloadError(f"model package file name {str(name)[:64]!r} is not a plain, unique file name")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= len(data) - offset:
            raise PayloadError(f"model package file {name}: size {str(size)[:32]} does not fit the package")
        body = data[offset : offset + size]
        if hashlib.sha256(body).hexdigest() != digest:
            raise PayloadError(f"model package file {name} does not match its sha256")
        files[name] = body
        offset += size
    if offset != len(data):
        raise PayloadError(f"model package has {len(data) - offset} bytes beyond its files")
    if MANIFEST_NAME not in files:
        raise PayloadError(f"model package has no {MANIFEST_NAME}")
    return ModelPackage(fleet, version, files)
