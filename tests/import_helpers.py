"""What a piece of code loads: run it in a fresh interpreter and list the modules it imported."""

from __future__ import annotations

import json
import subprocess
import sys


def modules_loaded(code: str, *prefixes: str) -> list[str]:
    """Run ``code`` in a new interpreter; the modules then loaded that are, or lie under, one of ``prefixes``
    (e.g. ``"torch"`` matches torch and torch.nn, not torchvision), sorted."""
    probe = (f"{code}\nimport json as _json, sys as _sys\n"
             f"_p = {list(prefixes)!r}\n"
             "_m = sorted(m for m in _sys.modules if any(m == p or m.startswith(p + '.') for p in _p))\n"
             "print(_json.dumps(_m))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))
