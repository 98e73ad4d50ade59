# szo developer entry points. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.szo-installed
OUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: help install demo test bench clean

help:
	@echo "make demo   - install into $(VENV) and run the digits quickstart (BPTT -> subspace -> SZO)"
	@echo "make test   - install into $(VENV) and run the whole test suite"
	@echo "make bench  - speed / memory / convergence benchmarks (writes bench/results/)"

$(STAMP): setup.py environment.yml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,dvs,corruptions,deploy,federated]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/szo demo digits --out $(OUT)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf runs bench/results .pytest_cache
