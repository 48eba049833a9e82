"""Shared fixtures. MQTT: a real Mosquitto on a free loopback port per test (marker ``mqtt``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fedge.mqtt.broker import MosquittoProcess, mosquitto_binary

# One intra-op thread for the whole session: float reductions then happen in the same order on
# every machine and whichever test files run, so seeded training gives the same numbers.
torch.set_num_threads(1)


@pytest.fixture
def mosquitto() -> Iterator[MosquittoProcess]:
    """A fresh anonymous Mosquitto on 127.0.0.1 and a free port, stopped after the test.

    Without Mosquitto the MQTT tests fail (they are never skipped): ``.ci/run`` installs it,
    locally ``apt-get install mosquitto``, or deselect them with ``-m "not mqtt"``.
    """
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed: apt-get install mosquitto (or run pytest -m 'not mqtt')")
    broker = MosquittoProcess()
    broker.start()
    try:
        yield broker
    finally:
        broker.close()
