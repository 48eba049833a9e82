"""The package DAG: torch stays off the coordinator side, and the import contract in
pyproject.toml ([tool.importlinter], run by ``make lint``) covers every module and bites."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest
from import_helpers import modules_loaded

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_coordinator_side_does_not_import_torch() -> None:
    code = (
        "import fedge.coordinator.engine, fedge.coordinator.strategies, fedge.coordinator.cli\n"
        "import fedge.fleet.config, fedge.fleet.slots, fedge.profiles, fedge.mqtt.coordinator_transport\n"
        "import fedge.scaleout.relay, fedge.scaleout.worker, fedge.scaleout.cli, fedge.coordinator.fromfleet\n"
        "import fedge.observe.monitor, fedge.observe.metrics, fedge.observe.dashboard, fedge.observe.fileview\n"
        "import fedge.observe.tensorboard\n"
        "from fedge.fleet.registry import METHODS\n"
        "assert {'local', 'fedavg', 'lgfedavg', 'fedproto', 'gefl', 'geflf', 'fedvtc'} <= set(METHODS)\n"
        "for entry in METHODS.values(): entry.coordinator_half()\n"
    )
    assert modules_loaded(code, "torch") == []


def _layer_modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [m.strip().strip("()") for layer in layers for m in re.split(r"[|:]", layer)]


def test_every_module_is_placed_in_a_layer() -> None:
    """A module under no layer would be unchecked: only the package markers may be, and they import nothing."""
    placed = _layer_modules()
    graph = grimp.build_graph("fedge")
    unplaced = sorted(m for m in graph.modules if not any(m == p or m.startswith(p + ".") for p in placed))
    assert unplaced == ["fedge", "fedge.coordinator", "fedge.edge", "fedge.fleet", "fedge.observe", "fedge.scaleout"], (
        "place these modules in a layer of [tool.importlinter] in pyproject.toml")
    assert {m: sorted(graph.find_modules_directly_imported_by(m)) for m in unplaced} == {m: [] for m in unplaced}


def _lint_copy(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """lint-imports on a copy of the package with ``line`` appended to ``module``."""
    shutil.copytree(ROOT / "fedge", tmp_path / "fedge", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / (module.replace(".", "/") + ".py")
    target.write_text(target.read_text() + f"\n{line}\n")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})


def test_the_contract_holds_on_this_checkout(tmp_path: Path) -> None:
    out = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" not in out.stdout.split("Contracts:")[-1].replace("0 broken", "")


@pytest.mark.parametrize(
    ("module", "line", "contract", "named"),
    [
        # Upward: the common layer reaching into the round loop.
        ("fedge.common.rounds", "from fedge.coordinator.engine import RoundEngine",
         "fedge's packages form a DAG", "fedge.common.rounds -> fedge.coordinator.engine"),
        # Sideways between the roles, inside one layer.
        ("fedge.coordinator.accumulators", "import fedge.edge.models.zoo",
         "the device side and the coordinator side never import each other",
         "fedge.coordinator.accumulators -> fedge.edge.models.zoo"),
        # The transport reaching up into the services that run over it (the cycle issue 46 removed).
        ("fedge.mqtt.topics", "from fedge.scaleout.aggregator import PartialAggregator",
         "fedge's packages form a DAG", "fedge.mqtt.topics -> fedge.scaleout.aggregator"),
        # One role's command line reaching into another's.
        ("fedge.edge.cli", "from fedge.coordinator.cli import add_parser",
         "no command line imports another area's command line", "fedge.edge.cli -> fedge.coordinator.cli"),
        # fedge infer reaching for the exporter (torch, onnx): the device-sized install would not have it.
        ("fedge.runtime.cli", "import fedge.export.quantize",
         "the runtime (fedge infer, a device's model store) runs on the device-sized install",
         "fedge.runtime.cli -> fedge.export.quantize"),
        # The coordinator's library reaching up into what watches it.
        ("fedge.coordinator.engine", "from fedge.observe.monitor import FleetMonitor",
         "fedge's packages form a DAG", "fedge.coordinator.engine -> fedge.observe.monitor"),
        # The fleet monitor reaching into the MQTT package (it reads heartbeats through the transport protocol).
        ("fedge.observe.heartbeats", "from fedge.mqtt.topics import FleetTopics",
         "never import paho or the MQTT package", "fedge.observe.heartbeats -> fedge.mqtt.topics"),
    ],
)
def test_an_injected_import_breaks_the_contract(tmp_path: Path, module: str, line: str, contract: str,
                                                named: str) -> None:
    out = _lint_copy(tmp_path, module, line)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{contract} BROKEN" in " ".join(out.stdout.split())
    assert named in out.stdout
