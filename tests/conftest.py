"""Shared fixtures. MQTT: a real Mosquitto on a free loopback port per test (marker ``mqtt``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fedge.mqtt.broker import MosquittoProcess, mosquitto_binary


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``mqtt`` tests with a clear reason where Mosquitto is not installed (``.ci/run`` installs it)."""
    if mosquitto_binary() is not None:
        return
    skip = pytest.mark.skip(reason="mosquitto is not installed (apt-get install mosquitto)")
    for item in items:
        if "mqtt" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def mosquitto() -> Iterator[MosquittoProcess]:
    """A fresh anonymous Mosquitto on 127.0.0.1 and a free port, stopped after the test."""
    broker = MosquittoProcess()
    broker.start()
    try:
        yield broker
    finally:
        broker.close()
