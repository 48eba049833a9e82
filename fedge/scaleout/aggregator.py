"""A partial aggregator: the update gate and a strategy's accumulators over a share of a round.

What an aggregation worker (``fedge coordinator worker``) and a relay (``fedge relay``) run between
the network and their parent: devices register from their hellos exactly as at the coordinator
(the same fleet config, the same checks), every update passes the same :class:`UpdateGate` into the
strategy's streaming ``accumulate``, a child relay's partial passes the :class:`PartialMerger`, and
:meth:`PartialAggregator.flush` turns what accumulated since the last flush into one ``partial``
message (:mod:`fedge.coordinator.partial`), then starts the accumulators afresh. Numpy only: no
transport here (``fedge.scaleout.worker`` and ``fedge.scaleout.relay`` move the bytes).

A partial is **compact** by default: it lists its devices as runs of ids and one :class:`Summary` of their
reports (bytes, metric sums, training time), so what it weighs does not grow with the devices it covers;
``detail=True`` sends each device's report entry (bytes up, update info) as before, ~100 B per device. Either
way the node keeps each device's entry of the current and the previous round (:attr:`round_devices`,
:attr:`last_round_devices`) for its own report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fedge.common.asyncmode import refuse_in_parts
from fedge.common.messages import Message
from fedge.common.transport import Inbound
from fedge.coordinator.config import EngineConfig
from fedge.coordinator.gate import Admitted, UpdateGate
from fedge.coordinator.merge import MergedDevice, MergedSummary, PartialMerger, Summary, partial_info
from fedge.coordinator.partial import check_splittable, export_partial, pack_ids
from fedge.coordinator.strategy import Strategy

log = logging.getLogger(__name__)


class PartialAggregator:
    """Gate + accumulators for one node (worker or relay) named ``name`` (its broker account)."""

    def __init__(self, strategy: Strategy, config: EngineConfig, name: str, *, detail: bool = False,
                 exact: bool = True) -> None:
        check_splittable(strategy)
        self.detail = detail
        self.exact = exact  # float64 sums as hi + lo float32 halves (False: hi only, half the bytes)
        refuse_in_parts(config.asynchronous, f"a partial aggregator ({name}: a worker or relay)")
        self.strategy = strategy
        self.config = config
        self.name = name
        strategy.aggregation = config.aggregation
        self.gate = UpdateGate(strategy, config)  # refusals of hellos are the root's to tell devices
        self.merger = PartialMerger(strategy, self.gate, fleet=config.fleet, max_bytes=config.max_update_bytes,
                                    allowed=config.partial_reporters)
        self.round = 0
        self.final = False
        self.descriptor = ""
        self.answered: set[str] = set()  # devices counted in this round (every flush)
        self._pending: dict[str, tuple[int, dict[str, Any]]] = {}  # since the last flush: id -> (bytes, info)
        self._pending_summary = Summary()  # ... the same devices' reports, summarised
        self._compact: list[str] = []  # since the last flush: devices of child partials that came compact
        self._compact_summary = Summary()
        # this node's own record: each device's (bytes up, update info) in the current / the previous round
        # (devices a child reported compactly: under the child's name, as a summary)
        self.round_devices: dict[str, dict[str, Any]] = {}
        self.last_round_devices: dict[str, dict[str, Any]] = {}
        self.flushed = 0

    # -- registration and rounds ------------------------------------------------------------
    def register(self, hellos: Iterable[Inbound]) -> list[str]:
        """Register devices from hellos (the coordinator's checks); the new ids."""
        return self.gate.register(hellos)

    def begin(self, rnd: int, *, final: bool, descriptor: str, sampled: Iterable[str] | None = None) -> bool:
        """Round ``rnd`` was announced (descriptor id ``descriptor``; ``sampled``: the devices it samples, None
        for all, refused here as at the coordinator); True if it is a new round here.

        The same round announced again (the coordinator re-announced it, or this node restarted)
        keeps what was accumulated: the gate refuses a second update from the same device.
        """
        self.descriptor = descriptor
        if rnd == self.round:
            return False
        self.gate.end_round(())
        self.gate.drain()
        self.round, self.final = rnd, final
        self.gate.begin_round(rnd, final=final, sampled=sampled)
        self.merger.begin_round(rnd, final=final)
        if not final:
            self.strategy.begin_round(rnd)
        self.answered = set()
        self._reset_pending()
        self.last_round_devices, self.round_devices = self.round_devices, {}
        return True

    def _reset_pending(self) -> None:
        self._pending, self._pending_summary = {}, Summary()
        self._compact, self._compact_summary = [], Summary()

    def mark_answered(self, device_ids: Iterable[str]) -> None:
        """Devices whose updates this node already forwarded in this round (its saved state after a restart):
        their resent copies are refused as duplicates instead of being counted twice."""
        for d in device_ids:
            self.answered.add(d)
            self.gate._seen.add(d)

    @staticmethod
    def sampled_of(round_info: object) -> list[str] | None:
        """The ``sampled`` list of a descriptor's ``round`` info (None: every device; docs/protocol.md section 4)."""
        sampled = round_info.get("sampled") if isinstance(round_info, dict) else None
        return [str(d) for d in sampled] if isinstance(sampled, list) else None

    # -- inbound ----------------------------------------------------------------------------
    def admit(self, item: Inbound) -> bool:
        """One device update through the gate into the accumulators; False if refused (counted)."""
        if self.round == 0:
            return False

        def accept(up: Admitted) -> None:
            if not self.final and not self.strategy.secure_sums:  # secure: metrics only, the sums come masked
                self.strategy.accumulate(up.device, up.msg.tensors, up.msg.info)
            self._detailed(up.msg.sender, up.size, up.msg.info, up.bytes_down, up.metrics, up.info.get("train_s"))
            self.answered.add(up.msg.sender)

        return self.gate.admit(item, accept)

    def admit_partial(self, item: Inbound) -> list[str]:
        """A child relay's partial, merged into this node's accumulators; the devices it added."""
        if self.round == 0:
            return []

        def sink(e: MergedDevice | MergedSummary) -> None:
            if isinstance(e, MergedSummary):
                ids = [d.device_id for d in e.devices]
                self._compact += ids
                self._compact_summary.merge(e.summary)
                self.round_devices[f"{item.origin or '?'}#{len(self.round_devices)}"] = {
                    "devices": ids, "summary": e.summary.to_json()}
            else:
                self._detailed(e.device.device_id, e.bytes_up, e.raw_info, e.bytes_down, e.metrics,
                               e.info.get("train_s"))

        added = self.merger.admit(item, self.answered, sink)
        self.answered.update(added)
        return added

    def _detailed(self, device: str, up: int, raw_info: dict[str, Any], down: int, metrics: dict[str, float],
                  train_s: object) -> None:
        self._pending[device] = (up, raw_info)
        self._pending_summary.add(up, down, metrics, train_s)
        self.round_devices[device] = {"up": up, "info": raw_info}

    # -- outbound ---------------------------------------------------------------------------
    @property
    def dirty(self) -> bool:
        """Whether a flush would carry something (accepted updates or refusals)."""
        return (bool(self._pending) or bool(self._compact)
                or any(not r.startswith("hello-") for r in self.gate.rejections.by_reason))

    def flush(self) -> bytes | None:
        """What accumulated since the last flush as one encoded ``partial`` (None: nothing to send); the
        accumulators start afresh, so consecutive partials of a round never share a device."""
        if self.round == 0 or not self.dirty:
            return None
        rejections = self.gate.drain()
        tensors = {} if self.final or self.strategy.secure_sums else export_partial(self.strategy, exact=self.exact)
        if self.detail:  # each device's entry; a compact child's devices stay compact
            info = partial_info(self.descriptor, self._pending, rejections.by_device,
                                ids=pack_ids(self._compact) if self._compact else None, summary=self._compact_summary)
        else:
            summary = self._pending_summary
            summary.merge(self._compact_summary)
            info = partial_info(self.descriptor, {}, rejections.by_device,
                                ids=pack_ids([*self._pending, *self._compact]), summary=summary)
        msg = Message("partial", self.name, self.round, self.config.fleet, tensors=tensors, info=info)
        n = len(self._pending) + len(self._compact)
        self._reset_pending()
        if not self.final:
            self.strategy.begin_round(self.round)
        self.flushed += 1
        data = msg.to_bytes()
        log.debug("%s: round %d partial of %d devices (%d bytes)", self.name, self.round, n, len(data))
        return data
