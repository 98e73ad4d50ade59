# szo developer entry points. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.szo-installed
OUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: help install demo lint test quick bench data clean

help:
	@echo "make demo   - install into $(VENV) and run the digits quickstart (BPTT -> subspace -> SZO)"
	@echo "make test   - install into $(VENV), lint (ruff) and run the whole test suite"
	@echo "make quick  - the same without the slow (multi-process) tests"
	@echo "make bench  - speed / memory / convergence benchmarks (writes bench/results/)"
	@echo "make data   - Fashion-MNIST for the fmnist recipes (Debian package as root, else torchvision's download)"

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

# Fashion-MNIST (the fmnist-* recipes; `make test` does not need it). As root on Debian / Ubuntu the
# offline package; otherwise torchvision downloads the official files into $(SZO_DATA_DIR) or ./data.
data: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get install -y dataset-fashion-mnist; \
	then echo "dataset-fashion-mnist installed"; \
	else $(PY) -c "from szo.data import get_dataset as g; [g('fmnist', s, download=True) for s in ('train', 'test')]"; fi
	$(PY) -c "from szo.data import get_dataset as g; print('fmnist:', len(g('fmnist', 'train')), 'train,', len(g('fmnist', 'test')), 'test')"

clean:
	rm -rf runs bench/results .pytest_cache
