"""Shared set-up of the identity, signed-state and OTA tests: Mosquitto with the config `fedge broker config --mtls`
writes, on a free loopback port, and waiting for a condition. Holds no tests itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedge.broker.config import BrokerOptions, write_broker_config
from fedge.mqtt.broker import MosquittoProcess, free_port
from fedge.mqtt.connection import BrokerSettings


@contextmanager
def configured_mosquitto(fleet: str, devices: list[str], *, fleet_config: Path | None = None,
                         **options: Any) -> Iterator[tuple[MosquittoProcess, Path]]:
    """(broker, broker directory): Mosquitto started exactly as `mosquitto -c` would be by this user (root in
    CI) with what `fedge broker config` writes for ``options`` (:class:`BrokerOptions` fields). Started as root,
    it drops to its `mosquitto` account, which must reach the files: pytest's tmp_path sits below a 0700
    directory, hence a directory of our own."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="fedge-broker-test-"))
    os.chmod(work, 0o755)
    out = work / "broker"
    files = write_broker_config(fleet, devices, out, BrokerOptions(port=port, bind="127.0.0.1", **options),
                                fleet_config=fleet_config)
    assert files.warnings == []
    broker = MosquittoProcess(files.config.read_text(), port=port, workdir=work)
    broker.start()
    try:
        yield broker, out
    finally:
        broker.close()
        shutil.rmtree(work, ignore_errors=True)


Running = tuple[MosquittoProcess, Path]


def mtls_mosquitto(fleet: str, devices: list[str], *,
                   fleet_config: Path | None = None) -> contextlib.AbstractContextManager[Running]:
    """:func:`configured_mosquitto` with `--mtls`."""
    return configured_mosquitto(fleet, devices, fleet_config=fleet_config, mtls=True)


def mtls_settings(broker: MosquittoProcess, out: Path, who: str) -> BrokerSettings:
    """How ``who`` (a device id, or "coordinator") connects to an :func:`mtls_mosquitto` broker: its certificate
    and key from the broker directory ``out``."""
    d = out / ("coordinator" if who == "coordinator" else f"bundles/{who}")
    stem = "client" if who == "coordinator" else "device"
    return BrokerSettings(host="localhost", port=broker.port, tls=True, ca_file=str(out / "tls/ca.crt"),
                          cert_file=str(d / f"{stem}.crt"), key_file=str(d / f"{stem}.key"))


def wait_until(cond: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``cond`` every 50 ms until it is true (True) or ``timeout`` seconds passed (False)."""
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False
