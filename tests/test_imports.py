"""The coordinator side must not load torch (a broker-side box need not carry it)."""

from __future__ import annotations

import subprocess
import sys


def test_coordinator_side_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import fedge.coordinator.engine, fedge.coordinator.strategies, fedge.coordinator.cli\n"
        "import fedge.fleet.config, fedge.profiles, fedge.mqtt.transport\n"
        "from fedge.fleet.methods import METHODS\n"
        "assert {'local', 'fedavg', 'lgfedavg', 'fedproto', 'gefl', 'geflf', 'fedvtc'} <= set(METHODS)\n"
        "for entry in METHODS.values(): entry.coordinator_half()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
