"""What the round engine tells whoever watches it: the hook the monitor, the dashboard and TensorBoard hang on.

The engine calls these methods on its own thread, at the moments named below, and never waits for
anything else: an observer must be quick (a few dictionary updates) and must not block. One that
raises is logged and ignored — watching a fleet must never stop it.
"""

from __future__ import annotations

from collections.abc import Collection

from fedge.common.rounds import DeviceInfo, RoundInfo
from fedge.coordinator.report import RoundReport


class EngineObserver:
    """No-op base class: override what you need."""

    def fleet_wait(self, device_ids: Collection[str], until: float) -> None:
        """The engine waits (until unix time ``until``) for a hello from each of ``device_ids``."""

    def quorum_wait(self, need: int, until: float) -> None:
        """The engine waits (until unix time ``until``) for ``need`` registered devices to be online."""

    def registered(self, device: DeviceInfo) -> None:
        """A valid hello registered (or re-registered) ``device``."""

    def refused(self, device_id: str, what: str, reason: str, message: str) -> None:
        """A message from ``device_id`` was refused (``what``: hello or update; ``reason``: the counter key
        of the round report, e.g. ``hello-slot``; ``message``: the words the log has)."""

    def round_started(self, info: RoundInfo, expected: Collection[str], pending: Collection[str]) -> None:
        """Round ``info.round`` was announced to ``expected``; ``pending`` is the engine's live set of the
        devices it still waits for (it shrinks as updates are accepted: copy it to read it). In asynchronous
        mode (``info.assigned`` set) the round is a global version, announced again each time it hands out
        tasks: this is called at each announcement, ``expected`` the devices holding a task then and ``pending``
        the engine's live task table (device -> the version it was asked at)."""

    def round_finished(self, report: RoundReport, aggregation_s: float) -> None:
        """The round is over and checkpointed; ``aggregation_s``: the strategy's ``finish_round`` time."""

    def run_finished(self) -> None:
        """The final round is done."""
