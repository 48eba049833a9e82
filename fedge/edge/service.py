"""The long-running device service: one :class:`DeviceAgent` driven over a real transport.

In-process, the simulator steps agents itself. On a device this loop does it:
announce, then wait for each new round descriptor and let the agent handle it,
until the run's final round is done. A failing round (the global state did not
arrive, the broker went away mid-upload) is logged and retried with back-off,
never fatal: the agent only marks a round done after its upload was handed to
the transport, so a retry redoes exactly the unfinished round.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from fedge.common.messages import Message
from fedge.common.rounds import RoundInfo
from fedge.common.transport import DeviceTransport
from fedge.edge.agent import DeviceAgent
from fedge.edge.health import DEFAULT_HEARTBEAT_S, HealthOverride, HealthSampler, Heartbeat
from fedge.errors import ConfigError, FedgeError, PayloadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeOptions:
    """How the device loop behaves."""

    exit_after_final: bool = True  # stop once the run's final (evaluation) round is handled
    poll_s: float = 1.0  # longest wait between checks of the round descriptor
    retry_min_s: float = 1.0  # back-off after a failed round: doubles up to retry_max_s
    retry_max_s: float = 30.0
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # health record every this many seconds (0: none)
    # Paths that must not leave the device in a health record's last error (a device's own data folder):
    # each is replaced by "<data>".
    private_paths: tuple[str, ...] = ()
    # Readings a JSON file overrides in every health record (fedge edge run --health-override; None: the sensors').
    health_override: HealthOverride | None = None


class EdgeService:
    """Runs ``agent`` over ``transport`` until the final round (or :meth:`stop`)."""

    def __init__(self, agent: DeviceAgent, transport: DeviceTransport, options: EdgeOptions | None = None) -> None:
        self.agent = agent
        self.transport = transport
        self.options = options or EdgeOptions()
        self._stop = threading.Event()
        self.rounds_handled = 0
        self.failures = 0
        self.finished = False
        self.last_error: str | None = None  # the last failure, for the health record
        info = agent.device
        sampler = HealthSampler(info.arch, override=self.options.health_override)
        self.heartbeat = Heartbeat(info.device_id, agent.fleet, sampler, transport.send_health,
                                   self._health_state, self.options.heartbeat_s)

    def _health_state(self) -> tuple[int, int, str | None]:
        """(last round, model round, last error) for the heartbeat: a refusal by the coordinator first."""
        refusal = getattr(self.transport, "refusal_text", None)
        error = refusal or self.last_error
        for path in sorted(self.options.private_paths, key=len, reverse=True):  # the longest first: a path's
            if error and path:                                                 # parent would leave its tail
                error = error.replace(path, "<data>")
        return self.agent.last_round, self.agent.model_round, error

    def stop(self) -> None:
        """Ask :meth:`run` to return at its next wait."""
        self._stop.set()

    def _current(self) -> RoundInfo | None:
        raw = self.transport.current_round()
        if raw is None:
            return None
        try:
            return RoundInfo.from_dict(Message.from_bytes(raw).info["round"])
        except (PayloadError, KeyError, TypeError):
            return None

    def run(self) -> int:
        """The device loop; returns the number of rounds handled."""
        self.agent.hello()
        self.heartbeat.start()
        try:
            return self._loop()
        finally:
            self.heartbeat.stop()

    def _loop(self) -> int:
        opts = self.options
        device = self.agent.device.device_id
        run_id = getattr(self.transport, "run_id", None)
        backoff = opts.retry_min_s
        while not self._stop.is_set():
            new_run = getattr(self.transport, "run_id", None)
            if new_run is not None and run_id is not None and new_run != run_id:
                # A new run on the same fleet (the coordinator started over): its rounds count from 1 again.
                log.info("%s: a new run started (%s); following it from its first round", device, new_run[:8])
                self.agent.last_round = 0
            run_id = new_run if new_run is not None else run_id
            try:
                handled = self.agent.step()
            except FedgeError as exc:
                self.failures += 1
                self.last_error = f"round failed: {exc.message}"
                log.warning("%s: round failed, retrying in %.0f s: %s", device, backoff, exc.message)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, opts.retry_max_s)
                continue
            except Exception as exc:
                self.failures += 1
                self.last_error = f"round failed: {type(exc).__name__}: {exc}"
                log.exception("%s: round failed with an unexpected error, retrying in %.0f s", device, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, opts.retry_max_s)
                continue
            backoff = opts.retry_min_s
            if handled:
                self.rounds_handled += 1
                info = self._current()
                if info is not None and info.is_final and info.round == self.agent.last_round:
                    log.info("%s: final round %d done", device, info.round)
                    self.finished = True
                    if opts.exit_after_final:
                        break
                continue
            self.transport.wait_for_round(opts.poll_s)
        return self.rounds_handled


BUNDLE_FILE = "bundle.toml"


@dataclass(frozen=True)
class Bundle:
    """What a device needs to join its fleet (``DIR/bundle.toml``; paths relative to DIR).

    Example::

        device_id = "rpi4-2gb-1"
        fleet_config = "fleet.toml"     # the fleet config: method, data share, plan
        broker = "mqtts://broker.lan:8883"
        username = "rpi4-2gb-1"
        password_file = "password"      # mode 0600
        ca_file = "ca.crt"              # only with mqtts://
        # with `fedge broker config --mtls` instead of username and password_file:
        cert_file = "device.crt"        # CN = the device id
        key_file = "device.key"         # mode 0600
        # with --sign or --mtls: the fleet's Ed25519 public key; the device then accepts only signed
        # round descriptors, global state and model updates
        fleet_key = "fleet.pub"
    """

    device_id: str
    fleet_config: str
    broker: str
    username: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    fleet_key: str | None = None
    source: str = ""

    @classmethod
    def load(cls, directory: str | Path) -> Bundle:
        """Read and validate ``directory/bundle.toml``; relative paths become absolute."""
        from fedge.common.tomlconf import build, read_toml

        base = Path(directory)
        path = base / BUNDLE_FILE
        if not path.is_file():
            raise ConfigError(f"{base} is not a device bundle (no {BUNDLE_FILE})",
                              hint="write bundles with `fedge broker config --fleet FLEET.toml --out DIR`")
        b = build(cls, read_toml(path), source=str(path))

        def resolve(p: str | None) -> str | None:
            return None if p is None else str(p if Path(p).is_absolute() else (base / p).resolve())

        bundle = Bundle(b.device_id, str(resolve(b.fleet_config)), b.broker, b.username, resolve(b.password_file),
                        resolve(b.ca_file), resolve(b.cert_file), resolve(b.key_file), resolve(b.fleet_key), str(path))
        for what, p in (("fleet_config", bundle.fleet_config), ("password_file", bundle.password_file),
                        ("ca_file", bundle.ca_file), ("cert_file", bundle.cert_file), ("key_file", bundle.key_file),
                        ("fleet_key", bundle.fleet_key)):
            if p is not None and not Path(p).is_file():
                raise ConfigError(f"{path}: {what} {p} does not exist",
                                  hint="flash the device again (a revoked device needs `fedge broker rotate` first)")
        return bundle

    def password(self) -> str | None:
        return None if self.password_file is None else Path(self.password_file).read_text().strip()
