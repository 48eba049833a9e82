"""JSON from untrusted bytes, with size and nesting limits checked before parsing.

``json.loads`` recurses once per nesting level: a document nested 100,000 deep
raises ``RecursionError`` (not a ``ValueError``), and one nested a few hundred
deep parses but breaks whoever serializes it again. :func:`loads` measures the
nesting depth first without recursing (strings blanked with one regular
expression, the brackets' +1/-1 steps summed in order) and refuses deep documents
with a :class:`~fedge.errors.PayloadError`, as it does oversize ones, ``NaN``,
``Infinity``, numbers that overflow to infinity and integers of absurd length.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from fedge.errors import PayloadError

# A JSON string: quote, then runs of plain characters or escapes, then quote (no backtracking blow-up).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# bytes.translate deletes everything but brackets; each bracket's step: +1 opens, -1 closes
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int64)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_SHORT = 64  # brackets counted in Python below this many (numpy's per-call cost is larger)
MAX_INT_DIGITS = 40  # far beyond any count or size fedge exchanges (2**63 has 19 digits)


class JsonLimitError(PayloadError):
    """A JSON document is too large, too deep, or holds a number fedge refuses."""


def nesting_depth(data: bytes) -> int:
    """Deepest ``[``/``{`` nesting of ``data`` (brackets inside strings do not count); no recursion."""
    if b"[" not in data and b"{" not in data:
        return 0
    brackets = _STRING.sub(b'""', data).translate(None, _NOT_BRACKETS)
    if len(brackets) < _SHORT:  # every message fedge sends: a few brackets
        depth = deepest = 0
        for c in brackets:
            depth += 1 if c in b"[{" else -1
            deepest = max(deepest, depth)
        return deepest
    return int(_STEP[np.frombuffer(brackets, np.uint8)].cumsum().max(initial=0))


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonLimitError(f"JSON number {text[:20]!r} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonLimitError(f"JSON integer of {len(text)} digits is out of range")
    return int(text)


def _no_constant(name: str) -> Any:
    raise JsonLimitError(f"JSON constant {name} is not allowed")


def loads(data: bytes | str, *, max_bytes: int, max_depth: int, what: str = "JSON") -> Any:
    """Parse ``data`` as JSON within limits; :class:`PayloadError` naming ``what`` otherwise."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise JsonLimitError(f"{what} of {len(raw)} bytes exceeds the limit of {max_bytes} bytes")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise JsonLimitError(f"{what} is nested {depth} deep (the limit is {max_depth})")
    try:
        return json.loads(raw, parse_float=_finite_float, parse_int=_bounded_int, parse_constant=_no_constant)
    except JsonLimitError as exc:
        raise JsonLimitError(f"{what}: {exc.message}") from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise PayloadError(f"{what} is not valid JSON: {exc}") from exc
