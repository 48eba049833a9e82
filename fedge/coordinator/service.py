"""The long-running coordinator: the round engine over a real transport, with checkpoints.

Transport-agnostic like the engine: ``fedge coordinator run`` (see
:mod:`fedge.coordinator.cli`) builds the strategy from the fleet config, the
MQTT transport and an embedded broker when no ``--broker`` is given, and hands
them to :class:`CoordinatorService`.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from fedge.common.transport import CoordinatorTransport
from fedge.coordinator.engine import EngineConfig, RoundEngine, RoundReport
from fedge.coordinator.observer import EngineObserver
from fedge.coordinator.strategy import Strategy

log = logging.getLogger(__name__)

# Round reports a long-running coordinator keeps in memory; all of them are in STATE_DIR/reports.jsonl.
KEEP_REPORTS = 8


class CoordinatorService:
    """Runs every remaining round of a strategy, checkpointing to ``state_dir`` after each.

    Restarted with the same ``state_dir`` it resumes after the last completed
    round (see :class:`RoundEngine`); SIGTERM/SIGINT stop it between two
    messages, and since every round is checkpointed as it completes, nothing but
    the round in progress is redone.
    """

    def __init__(self, strategy: Strategy, transport: CoordinatorTransport, config: EngineConfig,
                 state_dir: str | Path, *, observers: Sequence[EngineObserver] = ()) -> None:
        self.transport = transport
        self.engine = RoundEngine(strategy, transport, config, state_dir=state_dir, observers=observers)
        self.state_dir = Path(state_dir)

    @property
    def resumed_from(self) -> int:
        """Rounds already completed in ``state_dir`` before this process started."""
        return self.engine.completed

    def run(self, on_round: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
        """Run to the end of the final round; returns every round's report (also those before a restart)."""
        restore = install_stop_signals()
        try:
            return self.engine.run(on_round=on_round)
        finally:
            restore()
            self.transport.close()


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM, so ``finally`` blocks close connections cleanly."""


def install_stop_signals() -> Callable[[], None]:
    """SIGTERM raises :class:`Stopped` in the main thread (a no-op elsewhere); returns the restorer."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("received signal %d: stopping (state is checkpointed after every round)", signum)
        raise Stopped()

    old = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, old)

    return restore
