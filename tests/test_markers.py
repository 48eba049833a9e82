"""The test harness itself (tests/conftest.py): markers follow from fixtures, ``--quick`` skips what needs a
broker, Docker, sshd or long training and says why, and torch runs on one intra-op thread without the
conftest importing it. Run in a fresh pytest process on a small test file, with the real conftest and the
real marker registry."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''
import sys

import pytest


def test_the_conftest_did_not_import_torch():
    assert "torch" not in sys.modules


def test_torch_imported_by_a_test_runs_on_one_thread():
    import torch

    assert torch.get_num_threads() == 1


def test_plain():
    pass


def test_broker(mosquitto_bin):
    pass


@pytest.fixture
def via_broker(mosquitto):
    return mosquitto


def test_through_a_fixture(via_broker):
    pass


@pytest.fixture(params=["inmemory", "mosquitto"], ids=["inmemory", "mqtt"])
def net(request):
    return request.param


def test_net(net):
    pass


def test_passwd(mosquitto_passwd):
    pass


def test_docker(docker_env):
    pass


def test_ssh(sshd):
    pass


@pytest.mark.slow
def test_slow():
    pass


def test_dynamic(request):
    request.getfixturevalue("mosquitto_bin")
'''


# A plugin for the probe run: each test's markers, as collection left them.
REPORT = '''
def pytest_collection_finish(session):
    for item in session.items:
        print("markers", item.name, sorted({m.name for m in item.iter_markers()} - {"parametrize"}))
'''


@pytest.fixture
def probe(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    pytester.makeini("[pytest]\naddopts = --strict-markers\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    pytester.makepyfile(test_probe=PROBE, report_markers=REPORT)
    return pytester


def test_markers_follow_the_fixtures(probe: pytest.Pytester) -> None:
    lines = probe.runpytest_subprocess("--collect-only", "-q", "-p", "report_markers").stdout.lines
    marked = dict(line.split(" ", 2)[1:] for line in lines if line.startswith("markers "))
    assert marked == {"test_the_conftest_did_not_import_torch": "[]",
                      "test_torch_imported_by_a_test_runs_on_one_thread": "[]", "test_plain": "[]",
                      "test_broker": "['mqtt']", "test_through_a_fixture": "['mqtt']", "test_net[inmemory]": "[]",
                      "test_net[mqtt]": "['mqtt']", "test_passwd": "['mqtt']", "test_docker": "['docker']",
                      "test_ssh": "['sshd']", "test_slow": "['slow']", "test_dynamic": "[]"}


def test_the_quick_loop_skips_with_the_reason_and_a_hidden_broker_fails(probe: pytest.Pytester) -> None:
    result = probe.runpytest_subprocess("--quick", "-rsf", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, skipped=7, failed=1)
    out = "\n".join(result.stdout.lines)
    for why in ("needs Mosquitto or an MQTT broker on loopback", "needs a Docker engine",
                "starts sshd, a network server", "slow (> ~20 s)"):
        assert f"quick loop: {why} (make test runs it)" in out, why
    # A test reaching the broker without naming it would dodge -m and the quick loop: it fails, saying so.
    assert "test_dynamic uses mosquitto_bin but is not marked 'mqtt'" in out
