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
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedge.common.messages import Message
from fedge.common.rounds import FINAL_PHASE, DeviceInfo, RoundInfo
from fedge.common.tensorcodec import Payload, decode, encode
from fedge.common.transport import CoordinatorTransport
from fedge.coordinator.strategy import Arrays, Strategy
from fedge.coordinator.validation import Rejected, check_arrays
from fedge.errors import PayloadError

log = logging.getLogger(__name__)

COORDINATOR_ID = "coordinator"
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


@dataclass
class EngineConfig:
    """Round-loop settings (fleet config → engine)."""

    fleet: str = "default"
    method: str = "fedavg"
    round_timeout_s: float = 0.0  # 0: wait for every registered device
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    global_precision: str = "fp32"


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
        self.state_dir = Path(state_dir) if state_dir else None
        if self.state_dir and (self.state_dir / "state.json").is_file():
            self._load_state()

    # -- registration ---------------------------------------------------------------------
    def register_pending(self) -> list[str]:
        """Register devices from hellos received so far; returns the new ids."""
        new = []
        for raw in self.transport.hellos():
            try:
                msg = Message.from_bytes(raw, max_bytes=1 << 20)
                if msg.kind != "hello":
                    raise PayloadError(f"expected a hello, got {msg.kind}")
                dev = DeviceInfo.from_dict(msg.info["device"])
                if dev.device_id != msg.sender:
                    raise PayloadError(f"hello sender {msg.sender!r} != device id {dev.device_id!r}")
            except (PayloadError, KeyError, TypeError) as exc:
                log.warning("ignored hello: %s", exc)
                continue
            if dev.device_id not in self.devices:
                new.append(dev.device_id)
            self.devices[dev.device_id] = dev
        return new

    # -- one round ------------------------------------------------------------------------
    def round_info(self, rnd: int) -> RoundInfo:
        final = rnd > self.strategy.total_rounds()
        deadline = time.time() + self.config.round_timeout_s if self.config.round_timeout_s else 0.0
        return RoundInfo(
            round=rnd,
            phase=FINAL_PHASE if final else self.strategy.phase(rnd),
            method=self.config.method,
            deadline=deadline,
            config={} if final else self.strategy.round_config(rnd),
        )

    def run_round(self, rnd: int) -> RoundReport:
        """Announce round ``rnd``, aggregate what arrives, publish the new global state."""
        t0 = time.perf_counter()
        self.register_pending()
        info = self.round_info(rnd)
        report = RoundReport(round=rnd, phase=info.phase)
        announce = Message("round", COORDINATOR_ID, rnd, self.config.fleet, info={"round": info.to_dict()})
        self.transport.announce_round(announce.to_bytes())
        if not info.is_final:
            self.strategy.begin_round(rnd)
        seen: set[str] = set()
        rejected: Counter[str] = Counter()
        for raw in self.transport.collect(rnd, set(self.devices), info.deadline):
            try:
                msg = self._validate(raw, rnd, seen, final=info.is_final)
            except Rejected as exc:
                rejected[exc.reason] += 1
                log.warning("round %d: rejected update: %s", rnd, exc.message)
                continue
            seen.add(msg.sender)
            if not info.is_final:
                self.strategy.accumulate(self.devices[msg.sender], msg.tensors, msg.info)
            report.accepted.append(msg.sender)
            report.bytes_up[msg.sender] = len(raw)
            report.bytes_down[msg.sender] = int(msg.info.get("bytes_down", 0))
            report.metrics[msg.sender] = dict(msg.info.get("metrics", {}))
            report.info[msg.sender] = {k: v for k, v in msg.info.items() if k not in ("metrics", "bytes_down")}
        report.rejected = dict(rejected)
        missing = sorted(set(self.devices) - seen)
        if missing:
            log.warning("round %d: no update from %s", rnd, ", ".join(missing))
        if not info.is_final:
            self._publish(self.strategy.finish_round(rnd), rnd)
        report.seconds = time.perf_counter() - t0
        self.reports.append(report)
        self.completed = rnd
        self._save_state()
        return report

    def _validate(self, raw: bytes, rnd: int, seen: set[str], *, final: bool) -> Message:
        try:
            msg = Message.from_bytes(raw, max_bytes=self.config.max_update_bytes)
        except PayloadError as exc:
            reason = "oversize" if "exceeds the limit" in exc.message else "malformed"
            raise Rejected(reason, exc.message) from exc
        if msg.kind != "update":
            raise Rejected("kind", f"expected an update, got a {msg.kind} from {msg.sender}")
        if msg.sender not in self.devices:
            raise Rejected("unregistered", f"{msg.sender!r} sent an update without a hello")
        if msg.round != rnd:
            raise Rejected("stale", f"{msg.sender} sent round {msg.round} during round {rnd}")
        if msg.sender in seen:
            raise Rejected("duplicate", f"{msg.sender} already sent its update for round {rnd}")
        spec = {} if final else self.strategy.expected_update(self.devices[msg.sender], rnd)
        check_arrays(msg.tensors, spec, msg.sender)
        return msg

    def _publish(self, artifacts: dict[str, Arrays], rnd: int) -> None:
        for name, arrays in artifacts.items():
            self.globals[name] = arrays
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
            msg = Message("global", COORDINATOR_ID, self.completed, self.config.fleet, tensors=arrays,
                          info={"artifact": name})
            self.transport.publish_global(name, msg.to_bytes(self.config.global_precision))

    # -- checkpoints ----------------------------------------------------------------------
    def _save_state(self) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"{a}/{k}": v for a, arrays in self.globals.items() for k, v in arrays.items()}
        _atomic_write(self.state_dir / "globals.safetensors", encode(Payload(tensors)))
        state = {
            "completed": self.completed,
            "method": self.config.method,
            "devices": [d.to_dict() for d in self.devices.values()],
            "strategy": self.strategy.state_dict(),
            "reports": [asdict(r) for r in self.reports],
            "artifacts": sorted(self.globals),
        }
        # Written last: a crash between the two files leaves the previous state.json pointing at
        # round N-1, and the globals of round N are simply recomputed.
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
        self.reports = [RoundReport(**r) for r in state.get("reports", [])]
        flat = decode((self.state_dir / "globals.safetensors").read_bytes()).tensors
        self.globals = {}
        for key, arr in flat.items():
            artifact, name = key.split("/", 1)
            self.globals.setdefault(artifact, {})[name] = arr


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

