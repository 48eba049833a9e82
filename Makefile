# fedge: the commands of the README, each doing its own set-up.
#   make demo   create .venv if missing, install, run a heterogeneous fleet on digits
#   make check  the quick loop: same set-up, ruff, the import contracts, mypy and every test that needs
#               no broker, no Docker, no sshd and no long training (the others are skipped, saying why)
#   make test   the whole suite (CI: .ci/run): ruff, the import contracts, mypy and every test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch/torchvision pinned to the releases on this kind of machine (see README, "Installing").
TORCH  ?= torch==2.14.1 torchvision==0.29.1
# Ray (fedge[ray], in fedge[all]) pinned to the release the Ray backend was tested with (docs/simulation.md).
RAY    ?= ray==2.60.0
STAMP  := $(VENV)/.installed

.PHONY: demo check test lint typecheck pytest pytest-quick install clean bench-baselines

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH) $(RAY)
	$(BIN)/pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedge simulate examples/demo.toml --transport mqtt --out runs/demo

lint: $(STAMP)
	$(BIN)/ruff check fedge tests benchmarks
	$(BIN)/lint-imports --no-cache  # the package DAG: [tool.importlinter] in pyproject.toml

typecheck: $(STAMP)
	$(BIN)/mypy

# Two passes, each on pytest-xdist workers (a test file stays on one worker, its module fixtures built once).
# First what is CPU-bound and independent, slow training included, on every core; then the tests marked
# mqtt, docker or sshd (tests/conftest.py) on two workers: they mostly wait (on brokers, containers, a browser),
# each starts its own broker on a free port, and the Docker images are built once under a file lock.
WAITING = mqtt or docker or sshd
pytest: $(STAMP)
	$(BIN)/pytest -q -n auto --dist loadfile -m "not ($(WAITING))"
	$(BIN)/pytest -q -n 2 --dist loadfile -m "$(WAITING)"

# --quick: the first pass of make test without its slow tests; those and the second pass's are skipped, each saying why.
pytest-quick: $(STAMP)
	$(BIN)/pytest -q --quick -n auto --dist loadfile

check: lint typecheck pytest-quick

test: lint typecheck pytest

bench-baselines: $(STAMP)
	$(BIN)/python -m benchmarks.baselines

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
