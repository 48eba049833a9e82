"""A one-line progress display on a terminal, with no dependencies.

``fedge infer`` runs on the device-sized install (numpy, ONNX Runtime, Pillow),
which has no tqdm; classifying a directory of thousands of images still shows
how far it got. Like tqdm's ``disable=None``, the line is drawn only when the
stream is a terminal, so redirected output and logs stay clean.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO


class Progress:
    """``desc: done/total unit (pct%)``, redrawn in place at most every ``interval`` seconds."""

    def __init__(self, total: int, *, desc: str, unit: str, stream: TextIO | None = None,
                 enabled: bool | None = None, interval: float = 0.1) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.interval = interval
        self.done = 0
        self._drawn = False
        self._last = 0.0

    def line(self) -> str:
        """The text of the progress line."""
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.desc}: {self.done}/{self.total} {self.unit}s ({pct:.0f}%)"

    def update(self, n: int = 1) -> None:
        """Count ``n`` more; redraw if enough time passed or the work is done."""
        self.done += n
        now = time.monotonic()
        if self.enabled and (self.done >= self.total or now - self._last >= self.interval):
            self.stream.write("\r" + self.line())
            self.stream.flush()
            self._drawn, self._last = True, now

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._drawn:  # end the line, so what follows starts on its own
            self.stream.write("\n")
            self.stream.flush()
