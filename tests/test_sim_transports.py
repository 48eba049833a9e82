"""``fedge simulate --transport``: a table of runners, each imported only when chosen."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet
from fedge.sim.simulate import simulate
from fedge.sim.transports import TRANSPORTS, transport_runner


def test_unknown_transport_names_the_choices() -> None:
    cfg = parse_fleet({"run": {"method": "local", "rounds": 1}, "devices": [{"profile": "rpi5-8gb"}]})
    with pytest.raises(ConfigError, match="unknown transport 'pigeon'") as e:
        simulate(cfg, transport="pigeon")
    assert e.value.hint == "use one of inprocess, mqtt"


def test_every_entry_names_a_runner() -> None:
    assert {name: transport_runner(name).__name__ for name in TRANSPORTS} == {
        "inprocess": "run_inprocess", "mqtt": "run_mqtt"}


def test_choosing_inprocess_never_loads_mqtt() -> None:
    """Nothing registers itself by being imported: the simulator and its in-process runner load
    neither paho nor the MQTT runner."""
    code = (
        "import sys\n"
        "import fedge.sim.simulate\n"
        "from fedge.sim.transports import transport_runner\n"
        "transport_runner('inprocess')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('paho', 'fedge.mqtt', 'fedge.sim.over_mqtt'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
