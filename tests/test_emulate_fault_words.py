"""Operator commands answer in words: a fault the container's state rules out (killing an exited device,
pausing a paused one, partitioning a partitioned one) is an error that says why and what to do, never a
Docker traceback. Against a stand-in for the engine (every state), and once against a real engine: the
409 that ``fedge emulate fault kill`` on an exited container used to print as a traceback."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from emulate_helpers import Client, Container

from fedge.cli import main
from fedge.emulate import faults
from fedge.emulate.compose import NETWORK, Images
from fedge.emulate.discovery import PROJECT_LABEL, SERVICE_LABEL, docker_sdk
from fedge.emulate.emulation import Emulation
from fedge.errors import EmulationError


def emulation(out: Path, project: str = "p") -> Emulation:
    out.mkdir(parents=True, exist_ok=True)
    emu = Emulation(out.resolve(), project, "amd64", "f", Images("d", "c", "b"), {"dev-1": {}},
                    {"dev-1": {"profile": "rpi4-4gb", "mem_limit_mb": 100}})
    emu.save()
    return emu


@pytest.mark.parametrize(("status", "action", "words"), [
    ("exited", "kill", "dev-1 is not running, so there is nothing to kill: it exited (killed with SIGKILL) at "
                       "2026-12-01 04:47:51 UTC"),
    ("exited", "pause", "dev-1 is not running, so there is nothing to pause"),
    ("exited", "partition", "dev-1 is not running, so there is nothing to partition"),
    ("created", "kill", "dev-1 is not running, so there is nothing to kill: it was never started"),
    ("paused", "pause", "dev-1 is already paused"),
])
def test_a_fault_the_state_rules_out_says_why(tmp_path: Path, status: str, action: str, words: str) -> None:
    c = Container(status, 137)
    with pytest.raises(EmulationError) as err:
        faults.fault(emulation(tmp_path), Client(c), action, "dev-1")
    assert err.value.message.startswith(words)
    if status == "exited":
        assert err.value.hint is not None and "fedge emulate fault resume dev-1" in err.value.hint
    assert c.calls == []  # nothing was done to the container


def test_partitioning_twice_and_resuming_say_what_they_did(tmp_path: Path) -> None:
    emu = emulation(tmp_path)
    c = Container("running")
    client = Client(c)
    assert faults.fault(emu, client, "partition", "dev-1") == "cut dev-1 off the fleet network"
    with pytest.raises(EmulationError, match="already cut off the fleet network"):
        faults.fault(emu, client, "partition", "dev-1")
    assert faults.fault(emu, client, "resume", "dev-1") == "resumed dev-1: reconnected to the fleet network"
    assert faults.fault(emu, client, "resume", "dev-1") == "dev-1 is running and connected: nothing to resume"
    assert faults.fault(emu, client, "kill", "dev-1") == "killed dev-1"
    assert faults.fault(emu, client, "resume", "dev-1") == "started dev-1 again"  # a killed device boots again
    # reconnected, its link was shaped again; then killed and started
    assert c.calls == ["exec /bin/sh /usr/local/bin/fedge-shape-link", "kill", "start"]


def test_an_engine_refusal_becomes_words(tmp_path: Path) -> None:
    """A race (the container exits between the check and the kill): the engine's 409 in words."""
    errors = docker_sdk().errors

    class Racing(Container):
        def kill(self) -> None:
            raise errors.APIError("409 Client Error: Conflict", explanation="Container abc is not running")

    with pytest.raises(EmulationError) as err:
        faults.fault(emulation(tmp_path), Client(Racing("running")), "kill", "dev-1")
    assert err.value.message == "the Docker engine refused to kill dev-1: Container abc is not running"


def test_fault_kill_on_an_exited_container_of_a_real_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           docker_env: tuple[Any, Images]) -> None:
    """One small container (the broker image's sleep), killed, then killed again through the command line."""
    client, images = docker_env
    image = images.broker
    project = f"fedge-words-{uuid.uuid4().hex[:6]}"
    emu = emulation(tmp_path / "emu", project)
    net = client.networks.create(f"{project}_{NETWORK}")
    c = client.containers.run(image, ["300"], entrypoint=["sleep"], detach=True, network=net.name,
                              labels={PROJECT_LABEL: project, SERVICE_LABEL: "dev-1"})
    try:
        assert main(["emulate", "fault", "kill", "dev-1", "--dir", str(emu.out)]) == 0
        assert capsys.readouterr().out.strip() == "killed dev-1"
        deadline = time.time() + 20
        while time.time() < deadline:
            c.reload()
            if c.attrs["State"]["Status"] == "exited":
                break
            time.sleep(0.2)
        code = main(["emulate", "fault", "kill", "dev-1", "--dir", str(emu.out)])
        err = capsys.readouterr().err
        assert code == EmulationError.exit_code
        assert err.startswith("fedge: error: dev-1 is not running, so there is nothing to kill: it exited "
                              "(killed with SIGKILL) at "), err
        assert f"fix: start it again with `fedge emulate fault resume dev-1 --dir {emu.out}`" in err
        assert "Traceback" not in err and "409" not in err
        assert main(["emulate", "fault", "resume", "dev-1", "--dir", str(emu.out)]) == 0
        assert capsys.readouterr().out.strip() == "started dev-1 again"
    finally:
        c.remove(force=True)
        net.remove()
    assert json.loads((emu.out / "emulation.json").read_text())["project"] == project
