# fedge: the two commands of the README, each doing its own set-up.
#   make demo   create .venv if missing, install, run a heterogeneous fleet on digits
#   make test   same set-up, then ruff, the import contract (lint-imports), mypy and pytest
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch/torchvision pinned to the releases on this kind of machine (see README, "Installing").
TORCH  ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest install clean bench-baselines

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
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

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

bench-baselines: $(STAMP)
	$(BIN)/python -m benchmarks.baselines

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
