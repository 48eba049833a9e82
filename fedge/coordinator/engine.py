"""The round loop, written once for every method and every transport.

Per round the engine announces a :class:`RoundInfo`, streams the updates the
transport delivers through validation into the strategy, publishes the
artifacts the strategy returns, and checkpoints. After the last training round
it announces a final round in which devices evaluate the final global state and
upload only their metrics.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.messages import Message
from fedge.common.rounds import FINAL_PHASE, DeviceInfo, RoundInfo
from fedge.common.tensorcodec import Payload, decode, encode
from fedge.common.transport import CoordinatorTransport, Inbound
from fedge.coordinator.strategy import Arrays, Strategy
from fedge.coordinator.validation import Rejected, check_arrays
from fedge.errors import PayloadError, TransportError

log = logging.getLogger(__name__)

COORDINATOR_ID = "coordinator"
REPORTS_FILE = "reports.jsonl"  # one line per completed round, appended (state.json stays small)
DEFAULT_MAX_UPDATE_BYTES = 64 * 1024 * 1024


@dataclass
class RoundReport:
    """What happened in one round (saved in the state and in results.json)."""

    round: int
    phase: str
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    missing: list[str] = field(default_factory=list)  # expected devices whose update did not arrive
    deadline_s: float = 0.0  # the round's time budget (0: none, waited for every expected device)


@dataclass
class EngineConfig:
    """Round-loop settings (fleet config → engine)."""

    fleet: str = "default"
    method: str = "fedavg"
    round_timeout_s: float = 0.0  # budget for a round with an unknown device; 0: wait for every online device
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    global_precision: str = "fp32"
    # Quorum: a round starts once max(min_devices, ceil(quorum_fraction * expected_devices))
    # registered devices are online; waiting longer than quorum_timeout_s is an error.
    min_devices: int = 0
    quorum_fraction: float = 0.0
    expected_devices: int = 0
    quorum_timeout_s: float = 600.0
    # Deadline from the slowest expected device: slack * its estimated round time (its measured
    # latency in earlier rounds of the same phase, else the ``est_round_s`` of its hello),
    # clamped to [min_round_s, max_round_s]. slack 0 disables it (round_timeout_s alone applies).
    deadline_slack: float = 0.0
    min_round_s: float = 5.0
    max_round_s: float = 0.0  # 0: no upper bound
    # Devices allowed to register (None: any device that says hello).
    allowed_devices: frozenset[str] | None = None
    # Round reports kept in memory (0: all). With a state dir every report is in reports.jsonl, so a
    # long-running coordinator keeps only the last few: per-device report entries would otherwise grow
    # its memory by ~1 KB per device per round.
    keep_reports: int = 0


class RoundEngine:
    """Drives a :class:`Strategy` over a :class:`CoordinatorTransport`."""

    def __init__(self, strategy: Strategy, transport: CoordinatorTransport, config: EngineConfig,
                 *, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.strategy = strategy
        self.transport = transport
        self.config = config
        self.devices: dict[str, DeviceInfo] = {}
        self.globals: dict[str, Arrays] = {}
        self.reports: list[RoundReport] = []
        self.completed = 0
        self._report_lines = 0  # reports appended to REPORTS_FILE so far
        self.run_id = uuid.uuid4().hex  # lets devices tell a new run from a resumed one
        self.global_rounds: dict[str, int] = {}  # artifact -> round that produced the published version
        self.latency: dict[str, dict[str, float]] = {}  # phase -> device -> seconds announce→update
        # Message ids accepted in this round and the previous one (replay guard; older rounds are
        # refused by their round number anyway).
        self._recent_ids: set[str] = set()
        self._previous_ids: set[str] = set()
        self._last_missing: set[str] = set()
        self._pending_rejects: Counter[str] = Counter()  # hellos refused between rounds
        self.state_dir = Path(state_dir) if state_dir else None
        if self.state_dir and (self.state_dir / "state.json").is_file():
            self._load_state()

    # -- registration ---------------------------------------------------------------------
    def register_pending(self) -> list[str]:
        """Register devices from hellos received so far; returns the new ids."""
        new = []
        for item in self.transport.hellos():
            try:
                msg = Message.from_bytes(item.data, max_bytes=1 << 20)
                if msg.kind != "hello":
                    raise Rejected("kind", f"expected a hello, got {msg.kind}")
                dev = DeviceInfo.from_dict(msg.info["device"])
                if dev.device_id != msg.sender:
                    raise Rejected("spoofed", f"hello sender {msg.sender!r} != device id {dev.device_id!r}")
                if item.origin is not None and item.origin != msg.sender:
                    raise Rejected("spoofed", f"hello on {item.origin}'s topic claims to be {msg.sender!r}")
                allowed = self.config.allowed_devices
                if allowed is not None and dev.device_id not in allowed:
                    raise Rejected("unauthorized", f"{dev.device_id!r} is not a device of this fleet")
            except (PayloadError, KeyError, TypeError) as exc:
                reason = exc.reason if isinstance(exc, Rejected) else "malformed"
                self._pending_rejects[f"hello-{reason}"] += 1
                log.warning("ignored hello: %s", getattr(exc, "message", exc))
                continue
            if dev.device_id not in self.devices:
                new.append(dev.device_id)
            self.devices[dev.device_id] = dev
        return new

    def online_devices(self) -> set[str]:
        """Registered devices not known to be offline."""
        return set(self.devices) - self.transport.offline()

    def quorum(self) -> int:
        """Devices that must be online before a round starts."""
        c = self.config
        return max(c.min_devices, math.ceil(c.quorum_fraction * c.expected_devices))

    def await_quorum(self) -> None:
        """Register hellos until the quorum is online; :class:`TransportError` after ``quorum_timeout_s``."""
        need = self.quorum()
        end = time.monotonic() + self.config.quorum_timeout_s
        announced = False
        while True:
            self.register_pending()
            online = len(self.online_devices())
            if online >= need:
                return
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"quorum not reached: {online} of {need} devices online after {self.config.quorum_timeout_s:.0f} s",
                    hint="start more devices, or lower min_devices / quorum_fraction",
                )
            if not announced:
                log.info("waiting for a quorum of %d devices (%d online)", need, online)
                announced = True
            self.transport.wait_for_devices(min(1.0, remaining))

    # -- one round ------------------------------------------------------------------------
    def round_budget(self, phase: str, expected: set[str]) -> float:
        """Seconds the round may take: from the slowest expected device (0: no deadline)."""
        c = self.config
        if not expected:
            return c.round_timeout_s
        estimates = [self._estimate(d, phase) for d in expected] if c.deadline_slack > 0 else [None]
        if any(e is None for e in estimates):
            budget = c.round_timeout_s
        else:
            budget = max(c.min_round_s, c.deadline_slack * max(e for e in estimates if e is not None))
        if c.max_round_s > 0:
            budget = min(budget, c.max_round_s) if budget > 0 else c.max_round_s
        return budget

    def _estimate(self, device_id: str, phase: str) -> float | None:
        seen = self.latency.get(phase, {}).get(device_id)
        if seen is not None:
            return seen
        est = self.devices[device_id].extra.get("est_round_s") if device_id in self.devices else None
        return float(est) if isinstance(est, int | float) and est > 0 else None

    def round_info(self, rnd: int, expected: set[str] | None = None) -> RoundInfo:
        final = rnd > self.strategy.total_rounds()
        phase = FINAL_PHASE if final else self.strategy.phase(rnd)
        budget = self.round_budget(phase, set(self.devices) if expected is None else expected)
        return RoundInfo(
            round=rnd,
            phase=phase,
            method=self.config.method,
            deadline=time.time() + budget if budget else 0.0,
            config={} if final else self.strategy.round_config(rnd),
        )

    def run_round(self, rnd: int) -> RoundReport:
        """Announce round ``rnd``, aggregate what arrives, publish the new global state."""
        t0 = time.perf_counter()
        self.await_quorum()
        expected = self.online_devices()
        info = self.round_info(rnd, expected)
        report = RoundReport(round=rnd, phase=info.phase, deadline_s=max(0.0, info.deadline - time.time()))
        # "run" tells devices a resumed run from a new one; "globals" names the version of each
        # artifact this round starts from, so a device waits for exactly that one.
        announce = Message("round", COORDINATOR_ID, rnd, self.config.fleet,
                           info={"round": info.to_dict(), "run": self.run_id, "globals": dict(self.global_rounds)})
        announced_at = time.time()
        self.transport.announce_round(announce.to_bytes())
        if not info.is_final:
            self.strategy.begin_round(rnd)
        seen: set[str] = set()
        rejected: Counter[str] = self._pending_rejects  # hellos refused before or during this round count here
        pending = set(expected)  # live: the transport stops once it is empty
        for item in self.transport.collect(rnd, pending, info.deadline):
            try:
                msg = self._validate(item, rnd, seen, final=info.is_final)
            except Rejected as exc:
                rejected[exc.reason] += 1
                log.warning("round %d: rejected update: %s", rnd, exc.message)
                continue
            seen.add(msg.sender)
            pending.discard(msg.sender)
            self._recent_ids.add(msg.msg_id)
            if item.received > 0:
                self.latency.setdefault(info.phase, {})[msg.sender] = max(0.0, item.received - announced_at)
            if not info.is_final:
                self.strategy.accumulate(self.devices[msg.sender], msg.tensors, msg.info)
            report.accepted.append(msg.sender)
            report.bytes_up[msg.sender] = len(item.data)
            report.bytes_down[msg.sender] = int(msg.info.get("bytes_down", 0))
            report.metrics[msg.sender] = dict(msg.info.get("metrics", {}))
            report.info[msg.sender] = {k: v for k, v in msg.info.items() if k not in ("metrics", "bytes_down")}
        report.rejected = dict(rejected)
        self._pending_rejects = Counter()
        missing = sorted(set(self.devices) - seen)
        if missing:
            log.warning("round %d: no update from %s", rnd, ", ".join(missing))
        report.missing = missing
        self._last_missing = set(missing)
        if not info.is_final:
            self._publish(self.strategy.finish_round(rnd), rnd)
        report.seconds = time.perf_counter() - t0
        self.reports.append(report)
        self._previous_ids, self._recent_ids = self._recent_ids, set()
        self.completed = rnd
        self._save_state()
        self._trim_reports()
        return report

    def _trim_reports(self) -> None:
        keep = self.config.keep_reports
        if keep and len(self.reports) > keep:
            del self.reports[: len(self.reports) - keep]

    def _validate(self, item: Inbound, rnd: int, seen: set[str], *, final: bool) -> Message:
        if item.reject is not None:
            raise Rejected(*item.reject)
        try:
            msg = Message.from_bytes(item.data, max_bytes=self.config.max_update_bytes)
        except PayloadError as exc:
            reason = "oversize" if "exceeds the limit" in exc.message else "malformed"
            raise Rejected(reason, exc.message) from exc
        if item.origin is not None and msg.sender != item.origin:
            raise Rejected("spoofed", f"an update on {item.origin}'s topic claims to come from {msg.sender!r}")
        if msg.kind != "update":
            raise Rejected("kind", f"expected an update, got a {msg.kind} from {msg.sender}")
        if msg.fleet != self.config.fleet:
            raise Rejected("fleet", f"{msg.sender} sent an update for fleet {msg.fleet!r}")
        if msg.sender not in self.devices:
            self.register_pending()  # its hello may have arrived during this round
        if msg.sender not in self.devices:
            raise Rejected("unregistered", f"{msg.sender!r} sent an update without a hello")
        if msg.round < rnd:
            if msg.round == rnd - 1 and msg.sender in self._last_missing:
                raise Rejected("late", f"{msg.sender}'s update for round {msg.round} came after its deadline; dropped")
            raise Rejected("stale", f"{msg.sender} sent round {msg.round} during round {rnd}")
        if msg.round > rnd:
            raise Rejected("future", f"{msg.sender} sent round {msg.round} during round {rnd}")
        if msg.sender in seen:
            raise Rejected("duplicate", f"{msg.sender} already sent its update for round {rnd}")
        if msg.msg_id in self._recent_ids or msg.msg_id in self._previous_ids:
            raise Rejected("replay", f"{msg.sender} reused message id {msg.msg_id}")
        spec = {} if final else self.strategy.expected_update(self.devices[msg.sender], rnd)
        check_arrays(msg.tensors, spec, msg.sender)
        return msg

    def _publish(self, artifacts: dict[str, Arrays], rnd: int) -> None:
        for name, arrays in artifacts.items():
            self.globals[name] = arrays
            self.global_rounds[name] = rnd
            msg = Message("global", COORDINATOR_ID, rnd, self.config.fleet, tensors=arrays,
                          info={"artifact": name})
            self.transport.publish_global(name, msg.to_bytes(self.config.global_precision))

    # -- the loop -------------------------------------------------------------------------
    def run(self, on_round: Any = None) -> list[RoundReport]:
        """Run every remaining round (resuming after the last completed one)."""
        self.register_pending()
        if self.completed:
            log.info("resuming after round %d", self.completed)
            self._republish()
        for rnd in range(self.completed + 1, self.strategy.total_rounds() + 2):
            report = self.run_round(rnd)
            if on_round is not None:
                on_round(report)
        return self.reports

    def _republish(self) -> None:
        for name, arrays in self.globals.items():
            rnd = self.global_rounds.setdefault(name, self.completed)
            msg = Message("global", COORDINATOR_ID, rnd, self.config.fleet, tensors=arrays,
                          info={"artifact": name})
            self.transport.publish_global(name, msg.to_bytes(self.config.global_precision))

    # -- checkpoints ----------------------------------------------------------------------
    def _save_state(self) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"{a}/{k}": v for a, arrays in self.globals.items() for k, v in arrays.items()}
        _atomic_write(self.state_dir / "globals.safetensors", encode(Payload(tensors)))
        # Reports are appended, not rewritten: rewriting every round's per-device report each round
        # costs O(rounds x devices) per round (seconds at 1000 devices).
        if self.reports:  # called once per round, right after that round's report was added
            with open(self.state_dir / REPORTS_FILE, "ab") as f:
                f.write(json.dumps(asdict(self.reports[-1]), separators=(",", ":")).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            self._report_lines += 1
        state = {
            "completed": self.completed,
            "method": self.config.method,
            "devices": [d.to_dict() for d in self.devices.values()],
            "strategy": self.strategy.state_dict(),
            "reports_saved": self._report_lines,
            "artifacts": sorted(self.globals),
            "run_id": self.run_id,
            "global_rounds": self.global_rounds,
            "latency": self.latency,
        }
        # Written last: a crash before it leaves the previous state.json pointing at round N-1
        # (and at N-1 report lines: a report line of round N beyond them is cut off on load), and
        # round N is simply run again.
        _atomic_write(self.state_dir / "state.json", json.dumps(state, indent=1).encode())

    def _load_state(self) -> None:
        assert self.state_dir is not None
        state = json.loads((self.state_dir / "state.json").read_text())
        if state.get("method") != self.config.method:
            raise PayloadError(
                f"{self.state_dir} holds a {state.get('method')} run, not {self.config.method}",
                hint="use another --state-dir or the same method",
            )
        self.completed = int(state["completed"])
        self.devices = {d["device_id"]: DeviceInfo.from_dict(d) for d in state["devices"]}
        self.strategy.load_state_dict(state.get("strategy", {}))
        self._report_lines = int(state.get("reports_saved", 0))
        self.reports = self._load_reports(self._report_lines)
        self.run_id = str(state.get("run_id") or self.run_id)
        self.global_rounds = {str(k): int(v) for k, v in state.get("global_rounds", {}).items()}
        self.latency = state.get("latency", {})
        self._last_missing = set(self.reports[-1].missing) if self.reports else set()
        self._trim_reports()
        flat = decode((self.state_dir / "globals.safetensors").read_bytes()).tensors
        self.globals = {}
        for key, arr in flat.items():
            artifact, name = key.split("/", 1)
            self.globals.setdefault(artifact, {})[name] = arr


    def _load_reports(self, count: int) -> list[RoundReport]:
        """The first ``count`` report lines; lines beyond them (a crash before state.json) are cut off."""
        assert self.state_dir is not None
        path = self.state_dir / REPORTS_FILE
        lines = path.read_bytes().splitlines(keepends=True) if path.is_file() else []
        if len(lines) < count:
            raise PayloadError(f"{path} holds {len(lines)} round reports, {count} expected",
                               hint="the state directory is damaged; restore it or start another --state-dir")
        if len(lines) > count:
            _atomic_write(path, b"".join(lines[:count]))
        return [RoundReport(**json.loads(line)) for line in lines[:count]]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

