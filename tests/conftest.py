"""Shared fixtures; the markers that follow from them; the quick loop (``pytest --quick``, ``make check``).

**Markers come from fixtures.** A test that needs something outside Python asks for it through a fixture
below, and the fixture's marker follows by itself (:func:`pytest_collection_modifyitems`), whether the test
names the fixture, reaches it through another fixture (pytest's fixture closure: ``mosquitto`` needs
``mosquitto_bin``), or through a parametrized fixture whose parameter is the fixture's name (the transport
contract's ``net`` fixture picks its broker with ``request.getfixturevalue(request.param)``):

============================  ==========  =============================================================
fixture                       marker      what the test needs
============================  ==========  =============================================================
``mosquitto``                 ``mqtt``    a fresh Mosquitto on loopback
``mosquitto_bin``             ``mqtt``    the ``mosquitto`` binary (``mosquitto`` uses it, and so do tests
                                          starting their own broker with a config of theirs)
``mosquitto_passwd``          ``mqtt``    Mosquitto's ``mosquitto_passwd``
``embedded_broker``           ``mqtt``    fedge's embedded amqtt broker, a server on loopback
``docker_env``                ``docker``  a running Docker engine and the emulation's images
``sshd``                      ``sshd``    OpenSSH's server on loopback (as root)
============================  ==========  =============================================================

``browser`` (a headless Chromium) gives no marker: the tests using it also need a broker or Docker. Missing,
it fails in ``make test`` and skips in the quick loop, saying what to install, as ``fashion_mnist`` does.

``slow`` (more than ~20 s on the shared 2-core machine) is the one marker written on tests by hand.

**Two loops.** ``make test`` (CI, through ``.ci/run``) runs everything: a missing Mosquitto is a failure,
never a skip. ``make check`` runs ``pytest --quick``: tests marked ``mqtt``, ``docker``, ``sshd`` or ``slow``
are skipped, each with its reason, so the summary says what the quick loop left to ``make test``; and a test
whose system package is missing (``fashion_mnist``) skips there saying what to install, where ``make test``
fails.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

from fedge.mqtt.broker import MosquittoProcess, mosquitto_binary

# fixture -> the marker it gives every test that uses it
FIXTURE_MARKERS: dict[str, str] = {
    "mosquitto_bin": "mqtt",
    "mosquitto": "mqtt",  # needs mosquitto_bin, so its closure has it; listed for fixtures naming it as a parameter
    "mosquitto_passwd": "mqtt",
    "embedded_broker": "mqtt",
    "docker_env": "docker",
    "sshd": "sshd",
}

# marker -> why the quick loop leaves its tests to `make test`
QUICK_SKIPS: dict[str, str] = {
    "mqtt": "needs Mosquitto or an MQTT broker on loopback",
    "docker": "needs a Docker engine",
    "sshd": "starts sshd, a network server",
    "slow": "slow (> ~20 s)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", default=False,
                     help="the quick loop (make check): skip, with the reason, every test that needs a broker, "
                          "Docker or sshd, or is slow")


def _needed_fixtures(item: pytest.Item) -> set[str]:
    """Every fixture the test uses: its closure, plus fixture names chosen by a fixture's parameter."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {v for v in callspec.params.values() if isinstance(v, str) and v in FIXTURE_MARKERS}
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    quick = bool(config.getoption("--quick"))
    for item in items:
        for marker in sorted({FIXTURE_MARKERS[f] for f in _needed_fixtures(item) & FIXTURE_MARKERS.keys()}):
            item.add_marker(marker)
        if quick:
            why = [QUICK_SKIPS[m] for m in QUICK_SKIPS if item.get_closest_marker(m) is not None]
            if why:
                item.add_marker(pytest.mark.skip(reason=f"quick loop: {'; '.join(why)} (make test runs it)"))
    # The Docker tests last (in their order): their images build in the background meanwhile (see below).
    items.sort(key=lambda item: item.get_closest_marker("docker") is not None)


# -- one intra-op thread for torch, set when torch is first imported ---------------------------------------
# One thread makes float reductions happen in the same order on every machine and whichever test files run,
# so seeded training gives the same numbers. Importing torch here (as this file once did) cost every run,
# the quick loop included, ~2 s before the first test; instead the thread count is set the moment anything,
# a test module or fedge inside a test, imports torch.

def _one_thread(torch: Any) -> None:
    torch.set_num_threads(1)


class _TorchOneThread(importlib.abc.MetaPathFinder):
    """Finds ``torch`` through the other finders and pins its thread count right after it loads."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once; and importlib.util.find_spec below must not find us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_pin(module: ModuleType) -> None:
            exec_module(module)
            _one_thread(module)

        loader.exec_module = exec_then_pin  # type: ignore[method-assign]
        return spec


if "torch" in sys.modules:  # a plugin got there first
    _one_thread(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _TorchOneThread())


# -- what tests need from outside Python ----------------------------------------------------------------------

def _missing(request: pytest.FixtureRequest, what: str) -> NoReturn:
    """Something from outside Python is not installed: ``make test`` fails (CI installs it), never skips;
    the quick loop skips, saying what to install."""
    if request.config.getoption("--quick"):
        pytest.skip(f"quick loop: {what}")
    pytest.fail(what)


def _check_marked(request: pytest.FixtureRequest, fixture: str) -> None:
    """A test that reached ``fixture`` without its marker would dodge ``-m`` and the quick loop."""
    marker = FIXTURE_MARKERS[fixture]
    if request.node.get_closest_marker(marker) is None:
        pytest.fail(f"{request.node.nodeid} uses {fixture} but is not marked {marker!r}: name the fixture in the "
                    f"test's (or a fixture's) arguments, or as a fixture parameter, so the marker follows")


@pytest.fixture
def mosquitto_bin(request: pytest.FixtureRequest) -> str:
    """The ``mosquitto`` executable, for tests that start a broker (the ``mosquitto`` fixture, or their own).

    Without Mosquitto the MQTT tests fail (they are never skipped in ``make test``): ``.ci/run`` installs it,
    locally ``apt-get install mosquitto``, or run ``make check`` / ``pytest -m 'not mqtt'``.
    """
    _check_marked(request, "mosquitto_bin")
    binary = mosquitto_binary()
    if binary is None:
        _missing(request, "mosquitto is not installed: apt-get install mosquitto (or run make check / pytest -m "
                          "'not mqtt')")
    return binary


@pytest.fixture
def mosquitto(mosquitto_bin: str) -> Iterator[MosquittoProcess]:
    """A fresh anonymous Mosquitto on 127.0.0.1 and a free port, stopped after the test."""
    broker = MosquittoProcess()
    broker.start()
    try:
        yield broker
    finally:
        broker.close()


@pytest.fixture
def mosquitto_passwd(request: pytest.FixtureRequest) -> str:
    """The ``mosquitto_passwd`` tool (package ``mosquitto``); missing, the test fails (``make test``)."""
    _check_marked(request, "mosquitto_passwd")
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        _missing(request, "mosquitto_passwd comes with the mosquitto package: apt-get install mosquitto")
    return tool


@pytest.fixture
def fashion_mnist(request: pytest.FixtureRequest) -> Path:
    """Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (``.ci/run`` installs it)."""
    from fedge.edge.data.datasets import FMNIST_DIR

    if not FMNIST_DIR.is_dir():
        _missing(request, "apt-get install dataset-fashion-mnist")
    return FMNIST_DIR


@pytest.fixture(scope="session")
def espeak_kws(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic keyword set of ``audio_helpers.SMALL_KWS``, spoken by Debian's ``espeak-ng`` once per session
    (``.ci/run`` installs it; missing, the test fails in ``make test`` and skips in the quick loop)."""
    if shutil.which("espeak-ng") is None:
        _missing(request, "apt-get install espeak-ng (the synthetic keyword set is spoken by it)")
    from audio_helpers import SMALL_KWS

    from fedge.edge.data.espeak import make_keyword_set

    return make_keyword_set(tmp_path_factory.mktemp("espeak-kws"), SMALL_KWS)


@pytest.fixture
def browser(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A headless Chromium with a fresh profile, driven by selenium through Debian's ``chromedriver`` (packages
    ``chromium chromium-driver``; ``.ci/run`` installs them, nothing is downloaded); quit after the test."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        _missing(request, "chromium and chromium-driver are not installed: apt-get install chromium chromium-driver")
    import tempfile

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    with tempfile.TemporaryDirectory(prefix="fedge-chromium-") as profile:
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                    f"--user-data-dir={profile}", "--window-size=1400,1800"):
            opts.add_argument(arg)
        chrome = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
        try:
            yield chrome
        finally:
            chrome.quit()


@pytest.fixture
def embedded_broker(request: pytest.FixtureRequest) -> None:
    """Declares that the test starts fedge's embedded amqtt broker itself (``fedge simulate --transport
    mqtt`` does): a network server on loopback, so the test is ``mqtt`` and not in the quick loop."""
    _check_marked(request, "embedded_broker")


@pytest.fixture
def sshd(request: pytest.FixtureRequest) -> str:
    """OpenSSH's ``sshd`` (with ``ssh-keygen`` and ``scp``), for a test that runs one on loopback as root.

    Skipped with the reason without openssh or without root (CI runs as root and installs openssh-server).
    """
    _check_marked(request, "sshd")
    server = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").is_file() else None)
    if server is None or shutil.which("ssh-keygen") is None or shutil.which("scp") is None:
        pytest.skip("needs openssh-server and openssh-client (apt-get install openssh-server; .ci/run installs it)")
    if os.geteuid() != 0:
        pytest.skip("sshd needs root here (privilege separation directory /run/sshd); run as root, as CI does")
    return server


# -- Docker: the images, built once per session, from the start of the run ----------------------------------
# Building them takes minutes (the wheelhouse, the device and coordinator images; more from nothing) and is
# mostly the engine's work, so when the run has Docker tests to run the build starts as soon as collection
# ends, in a thread, while the tests that need no engine run (the Docker tests are moved to the end of the
# run for that, by pytest_collection_modifyitems); docker_env waits for it.
_IMAGES = pytest.StashKey[Future[Any]]()


def _docker_cli_missing() -> bool:
    return shutil.which("docker-compose") is None and shutil.which("docker") is None


def _ensure_images(client: Any) -> Any:
    """``images.ensure_images`` under a file lock: under pytest-xdist (make test) each worker may run Docker tests,
    and the first builds what is missing while the others wait, then find it built."""
    import fcntl

    from fedge.emulate import images

    with open(Path(tempfile.gettempdir()) / "fedge-test-images.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return images.ensure_images(client, "amd64")


def pytest_collection_finish(session: pytest.Session) -> None:
    # Under xdist every worker collects every test: one (gw0) starts the build early, any other waits in
    # docker_env for the lock of _ensure_images.
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    if session.config.option.collectonly or _docker_cli_missing() or not any(
            item.get_closest_marker("docker") is not None and item.get_closest_marker("skip") is None
            for item in session.items):
        return
    from fedge.emulate import discovery
    from fedge.errors import EmulationError

    try:
        client = discovery.docker_client()
        discovery.compose_command()
    except EmulationError:
        return  # no engine: docker_env skips, saying why
    built: Future[Any] = Future()

    def build() -> None:
        try:
            built.set_result(_ensure_images(client))
        except BaseException as exc:  # raised again by docker_env, in the tests that need the images
            built.set_exception(exc)

    # A daemon thread: a run stopped early (-x, Ctrl-C) does not wait for a build nobody needs any more.
    threading.Thread(target=build, name="docker-images", daemon=True).start()
    session.config.stash[_IMAGES] = built


@pytest.fixture(scope="session")
def docker_env(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """A Docker client and the emulation's amd64 images (``fedge.emulate.compose.Images``), built if missing.

    Without an engine every test using it is skipped with the reason (``.ci/run`` starts one).
    """
    from fedge.emulate import discovery
    from fedge.errors import EmulationError

    if _docker_cli_missing():
        pytest.skip("no docker-compose / docker CLI: apt-get install docker.io docker-compose (.ci/run does it)")
    try:
        client = discovery.docker_client()
        discovery.compose_command()
    except EmulationError as exc:
        pytest.skip(f"Docker tests need a running engine: {exc.message} ({exc.hint})")
    building = request.config.stash.get(_IMAGES, None)
    return client, (building.result() if building is not None else _ensure_images(client))


@pytest.fixture
def emulation() -> Iterator[list[Any]]:
    """The emulations (``fedge.emulate.emulation.Emulation``) a test starts: taken down afterwards whatever
    happens. Used with ``docker_env``."""
    started: list[Any] = []
    yield started
    for emu in started:
        emu.compose("down", "--remove-orphans", "--timeout", "2", check=False)
