"""The signature in an exported model's ``manifest.json``: who vouches for the model.

``fedge export --signing-key`` (and ``fedge deploy``, for every model version it publishes) adds::

    "signature": {"alg": "ed25519", "key": "<16 hex: the fleet key's id>", "value": "<base64, 64 bytes>"}

The signature is Ed25519 with the fleet key over ``b"fedge-signed-v1\\x00"`` followed by the manifest's
*canonical form*: the manifest without its ``signature`` entry, serialised as
``json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)`` (UTF-8).
The manifest lists every file with its size and sha256 (:func:`fedge.runtime.manifest.verify_files`), so
a verified manifest and verified files are the whole model, byte for byte: a changed graph, class list or
normalisation fails.

``fedge infer --fleet-key FILE`` and :meth:`fedge.runtime.EdgeModel.load` with a verifier refuse an
unsigned manifest, one signed by another key and one whose signature does not match.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedge.common.atomicfile import write_atomic
from fedge.common.signing import SignatureError, Signer, Verifier
from fedge.errors import ExportError
from fedge.runtime.manifest import MANIFEST_NAME, read_manifest_json

SIGNATURE = "signature"


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a manifest's signature covers: the manifest without ``signature``, canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    try:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    except ValueError as exc:  # NaN or infinity in a metric
        raise ExportError(f"the manifest cannot be signed: {exc}") from exc


def sign_manifest(model_dir: str | os.PathLike[str], signer: Signer) -> dict[str, str]:
    """Sign ``model_dir/manifest.json`` in place (atomically); returns the signature record."""
    root = Path(model_dir)
    data = read_manifest_json(root)
    record = signer.sign_detached(canonical(data))
    data[SIGNATURE] = record
    path = root / MANIFEST_NAME
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))
    return record


def verify_manifest(model_dir: str | os.PathLike[str], verifier: Verifier) -> str:
    """Check the manifest's signature against the fleet key; returns the key id. An :class:`ExportError`
    naming the manifest otherwise (nothing is loaded)."""
    root = Path(model_dir)
    data = read_manifest_json(root)
    what = str(root / MANIFEST_NAME)
    try:
        verifier.verify_detached(canonical(data), data.get(SIGNATURE), what)
    except SignatureError as exc:
        hint = {"unsigned": "sign it: fedge export --signing-key KEY (fedge deploy signs what it publishes)",
                "key": "it was signed by another fleet's key: use this fleet's export, or the matching --fleet-key"}
        raise ExportError(f"{exc.message}", hint=hint.get(exc.reason, "the manifest was modified after it was "
                                                                        "signed: re-export or re-copy the model")
                          ) from exc
    return str(data[SIGNATURE]["key"])
