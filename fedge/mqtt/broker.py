"""Brokers fedge starts itself: the embedded default and a managed Mosquitto process.

* :class:`EmbeddedBroker` runs amqtt (pure Python, a declared dependency, so it
  is always there) on an asyncio loop in a background thread of this process,
  bound to loopback only: ``fedge simulate --transport mqtt`` and ``fedge
  coordinator run`` without ``--broker`` need no set-up at all. amqtt speaks MQTT
  3.1.1 only and has no authentication worth the name here, which is why it
  refuses to bind anything but loopback; real deployments use Mosquitto with the
  config ``fedge broker config`` writes.
* :class:`MosquittoProcess` starts the ``mosquitto`` binary on a free loopback
  port with a generated (or given) config; the tests and the benchmark use it,
  and ``fedge coordinator run --embedded mosquitto`` uses it as the embedded broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError, TransportError
from fedge.mqtt.connection import BrokerSettings

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (bind to 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether ``host:port`` can be bound right now (nothing listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_for_port(host: str, port: int, timeout_s: float = 10.0) -> None:
    """Block until something accepts TCP connections on ``host:port``."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError as exc:
            if time.monotonic() > end:
                raise TransportError(f"no broker listening on {host}:{port} after {timeout_s:.0f} s") from exc
            time.sleep(0.05)


def _check_loopback(host: str) -> None:
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ConfigError(f"the embedded broker binds loopback only, not {host!r}",
                          hint="run Mosquitto with the config from `fedge broker config` for a networked fleet")


class EmbeddedBroker:
    """amqtt inside this process, on loopback; ``port=0`` picks a free port."""

    def __init__(self, host: str = LOOPBACK, port: int = 0) -> None:
        _check_loopback(host)
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def settings(self, **kw: Any) -> BrokerSettings:
        """Client settings for this broker."""
        return BrokerSettings(host=self.host, port=self.port, **kw)

    def start(self, timeout_s: float = 15.0) -> EmbeddedBroker:
        from amqtt.broker import Broker  # heavy import, only when an embedded broker is wanted

        if self.port == 0:
            self.port = free_port(self.host)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            # Explicit plugin list: only anonymous auth (loopback only), no $SYS or packet logging.
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        ready = threading.Event()
        loop = self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)

            async def boot() -> None:
                self._broker = Broker(config, loop=loop)
                await self._broker.start()

            try:
                loop.run_until_complete(boot())
            except BaseException as exc:  # reported to the starting thread
                self._error = exc
                ready.set()
                return
            ready.set()
            loop.run_forever()

        # amqtt logs every connection at INFO; keep it quiet unless asked for debug output.
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            # amqtt also warns about benign races (a PUBACK for a message it already let go of).
            logging.getLogger("amqtt").setLevel(logging.ERROR)
            logging.getLogger("transitions").setLevel(logging.WARNING)
        self._thread = threading.Thread(target=run, name="fedge-embedded-broker", daemon=True)
        self._thread.start()
        # Broker.start() returns once the listener is bound, so no port probe is needed (amqtt
        # would log a probe that sends no CONNECT as an error).
        if not ready.wait(timeout_s) or self._error is not None:
            raise TransportError(f"the embedded MQTT broker did not start on {self.host}:{self.port}: {self._error}",
                                 hint="is another broker using the port? pick another with --port (0: any free "
                                      "port) or connect to it with --broker")
        log.info("embedded MQTT broker (amqtt) on %s", self.url)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        loop, broker = self._loop, self._broker
        if loop is None or broker is None or not loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
        with contextlib.suppress(Exception):
            fut.result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._broker = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mosquitto_binary() -> str | None:
    """Path of the ``mosquitto`` executable, if installed (Debian puts it in /usr/sbin)."""
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None)


def loopback_config(port: int, *, max_message_bytes: int = 64 * 1024 * 1024, extra: str = "",
                    persistence_dir: Path | None = None) -> str:
    """A minimal Mosquitto config: one anonymous listener on loopback; persistence in
    ``persistence_dir`` if given (then it runs as the current user, who owns that directory)."""
    persistence = ["persistence false"] if persistence_dir is None else [
        "persistence true", f"persistence_location {persistence_dir}/", "autosave_interval 30",
        f"user {pwd.getpwuid(os.geteuid()).pw_name}"]
    return "\n".join([
        f"listener {port} {LOOPBACK}",
        "allow_anonymous true",
        *persistence,
        # Mosquitto 2 bounds whole packets (message_size_limit is the deprecated payload-only option).
        f"max_packet_size {max_message_bytes + 64 * 1024}",
        # The coordinator's session may be offline for a moment (restart): keep its queue generous.
        "max_queued_messages 100000",
        "max_inflight_messages 100",
        # Small messages (descriptors, statistics) must not wait for Nagle's algorithm.
        "set_tcp_nodelay true",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        extra,
        "",
    ])


class MosquittoProcess:
    """A ``mosquitto`` child process with a config file; restartable on the same port."""

    def __init__(self, config: str | None = None, *, port: int | None = None, workdir: str | Path | None = None,
                 max_message_bytes: int = 64 * 1024 * 1024, persistence: bool = False) -> None:
        binary = mosquitto_binary()
        if binary is None:
            raise TransportError("mosquitto is not installed", hint="apt-get install mosquitto (Debian/Ubuntu)")
        self.binary = binary
        self.port = port or free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="fedge-mosquitto-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.config_path = self.workdir / "mosquitto.conf"
        if config is None:
            config = loopback_config(self.port, max_message_bytes=max_message_bytes,
                                     persistence_dir=self.workdir if persistence else None)
        self.config_path.write_text(config)
        self.log_path = self.workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{LOOPBACK}:{self.port}"

    def settings(self, **kw: Any) -> BrokerSettings:
        return BrokerSettings(host=LOOPBACK, port=self.port, **kw)

    def start(self, timeout_s: float = 10.0) -> MosquittoProcess:
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([self.binary, "-c", str(self.config_path)], stdout=logf, stderr=logf,
                                         stdin=subprocess.DEVNULL)
        try:
            wait_for_port(LOOPBACK, self.port, timeout_s)
        except TransportError as exc:
            self.stop()
            # the log may be gone with a temporary work directory (a start racing its owner's exit)
            log = self.log_path.read_text()[-2000:] if self.log_path.is_file() else f"no log at {self.log_path}"
            raise TransportError(f"mosquitto did not start: {log}") from exc
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate (SIGTERM, then SIGKILL)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def terminate(self) -> None:
        """SIGTERM: a graceful shutdown (it publishes every client's last-will and saves its database)."""
        self.stop()

    def kill(self) -> None:
        """SIGKILL: the broker vanishes with everything it held in memory."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> MosquittoProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
