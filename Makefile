# Everything runs from the project's own virtual environment, built on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RANKS ?= 4
NUMEL ?= 25000000

.PHONY: setup test lint format smoke bench-comm clean

setup: $(STAMP)

# torch first and exactly pinned: an unpinned resolve could pull a multi-GB build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# LAMB vs 1-bit LAMB on a small network, 2 local gloo workers, one JSON line.
smoke: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node=2 -m pipeline.smoke

# Compressed vs fp32 all-reduce on $(RANKS) gloo ranks, $(NUMEL) elements; JSON last line.
bench-comm: setup
	$(PY) bench/comm.py --world-size $(RANKS) --numel $(NUMEL)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
