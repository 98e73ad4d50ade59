# szo developer entry points. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.szo-installed
OUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: help install demo lint test quick bench clean

help:
	@echo "make demo   - install into $(VENV) and run the digits quickstart (BPTT -> subspace -> SZO)"
	@echo "make test   - install into $(VENV), lint (ruff) and run the whole test suite"
	@echo "make quick  - the same without the slow (multi-process) tests"
	@echo "make bench  - speed / memory / convergence benchmarks (writes bench/results/)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,dvs,corruptions,deploy,federated,log]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/szo demo digits --out $(OUT)

lint: $(STAMP)
	$(VENV)/bin/ruff check szo subspace_store tests bench examples

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

quick: lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf runs bench/results .pytest_cache
