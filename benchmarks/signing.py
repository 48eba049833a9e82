"""What signing costs per device per round (issue 31; target: signing + verifying <= 5 ms on this machine).

Per round the coordinator signs one round descriptor and one global state per artifact (shared by every
device); each device verifies the descriptor and the artifacts its method needs (sha256 of the body, the
Ed25519 signature of the header, the topic, the replay guard). The messages are the real encodings
(:class:`fedge.common.messages.Message`) of what three methods publish:

* FedProto: the global prototypes, 10 x 64 fp32 + 10 counts (3 kB);
* FedAvg on ``tier-xs`` and on ``tier-xl``: the group's whole state dict at fp32 (the largest global a
  fleet publishes: 1.5 MB for tier-xl). Above the chunk size (256 KiB) what is signed on the artifact's topic is
  the manifest of its chunks, which carries the message's sha256; the chunk layer hashes the reassembled message
  anyway (shown for reference, not counted as the cost of signing).

Each figure is the median of ``--repeats`` timed calls (after a warm-up). "device, persisted guard" adds
writing the replay guard's file (``fedge edge run --state-dir``: a small JSON renamed into place, not fsync'd) per
verified message.

    python -m benchmarks.signing                      # writes benchmarks/results/signing.json, prints the table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.common import RESULTS, markdown_table
from fedge.common.archs import arch_by_name
from fedge.common.messages import Message
from fedge.common.signing import ReplayGuard, Signer, Verifier
from fedge.mqtt.chunking import DEFAULT_CHUNK_BYTES, chunk_frames
from fedge.mqtt.topics import FleetTopics

OUT = RESULTS / "signing.json"
FLEET = "bench"
TARGET_MS = 5.0


def _globals(method: str) -> bytes:
    """The encoded global state one round of ``method`` publishes (random values, real names and shapes)."""
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray]
    if method == "fedproto":
        tensors = {"protos": rng.standard_normal((10, 64)).astype(np.float32),
                   "counts": rng.integers(0, 100, 10).astype(np.int64)}
    else:
        arch = method.split(":")[1]
        tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in arch_by_name(arch).param_shapes().items()}
    return Message("global", "coordinator", 3, FLEET, tensors=tensors, info={"artifact": "a"}).to_bytes()


def _descriptor() -> bytes:
    return Message("round", "coordinator", 3, FLEET, info={
        "round": {"round": 3, "phase": "train", "method": "fedproto", "deadline": time.time() + 60, "config": {}},
        "run": "0" * 32, "globals": {"a": 2}}).to_bytes()


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(method: str, repeats: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """Milliseconds to sign and to verify one round's descriptor + global state of ``method``."""
    topics = FleetTopics(FLEET)
    signer = Signer(Ed25519PrivateKey.generate())
    public = signer.key.public_key()
    desc, message = _descriptor(), _globals(method)
    # What the transports sign on the artifact's topic: the whole message, or, above the chunk size, the manifest
    # of its chunks (which carries the message's sha256, checked by the chunk layer after reassembly anyway).
    chunked = len(message) > chunk_bytes
    glob = chunk_frames(message, chunk_bytes)[0] if chunked else message
    sign = _median_ms(lambda: (signer.seal(topics.round, desc), signer.seal(topics.global_("a"), glob)), repeats)

    def verify_with(guard_path: Path | None) -> float:
        verifier = Verifier(public, guard=ReplayGuard(guard_path))

        def one() -> None:  # fresh frames each time: a real round's messages are new ones
            d, g = signer.seal(topics.round, desc), signer.seal(topics.global_("a"), glob)
            t0 = time.perf_counter()
            verifier.open(topics.round, d)
            verifier.open(topics.global_("a"), g)
            spent.append(time.perf_counter() - t0)

        spent: list[float] = []
        for _ in range(repeats + 3):
            one()
        return statistics.median(spent[3:]) * 1e3

    # what the chunk layer hashes anyway (the whole message), under the same load: not a cost of signing
    floor = _median_ms(lambda: hashlib.sha256(message).digest(), repeats)
    verify = verify_with(None)
    with tempfile.TemporaryDirectory() as tmp:
        persisted = verify_with(Path(tmp) / "seen.json")
    return {"method": method, "descriptor_bytes": len(desc), "global_bytes": len(message), "chunked": chunked,
            "signed_global_payload_bytes": len(glob), "chunk_sha256_ms": floor,
            "sign_ms": sign,
            "verify_ms": verify, "verify_persisted_ms": persisted, "total_ms": sign + verify,
            "total_persisted_ms": sign + persisted}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200, help="timed calls per figure (median; default 200)")
    p.add_argument("--methods", nargs="+", default=["fedproto", "fedavg:tier-xs", "fedavg:tier-xl"])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    cells = [measure(m, args.repeats) for m in args.methods]
    try:
        load = list(__import__("os").getloadavg())
    except OSError:
        load = []
    doc = {"cells": cells, "repeats": args.repeats, "target_ms": TARGET_MS, "machine": platform.machine(),
           "processor": platform.processor(), "python": platform.python_version(), "load_average": load,
           "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    rows = [[c["method"], f"{c['descriptor_bytes']:,}", f"{c['global_bytes']:,}",
             f"{c['signed_global_payload_bytes']:,}" + (" (manifest)" if c["chunked"] else ""), f"{c['sign_ms']:.3f}",
             f"{c['verify_ms']:.3f}", f"{c['verify_persisted_ms']:.3f}", f"**{c['total_ms']:.3f}**",
             f"{c['total_persisted_ms']:.3f}", f"{c['chunk_sha256_ms']:.3f}"] for c in cells]
    print(markdown_table(["global state", "descriptor B", "global B", "signed on its topic B", "coordinator signs ms",
                          "device verifies ms",
                          "device verifies, persisted guard ms", "sign + verify ms", "… persisted ms",
                          "(chunk layer's sha256, not signing) ms"], rows))
    worst = max(c["total_persisted_ms"] for c in cells)
    print(f"target: sign + verify <= {TARGET_MS} ms per device per round; worst here {worst:.3f} ms "
          f"({'met' if worst <= TARGET_MS else 'NOT met'}); load average {load}; {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
