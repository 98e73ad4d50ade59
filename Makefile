# szo developer entry points. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.szo-installed
OUT ?= runs/demo
PYTEST_ARGS ?=

# Intel Lava (lava-nc, the oracle of the fixed-point `loihi` arithmetic) installs on Python 3.10 only:
# `make lava` builds its own interpreter, .venv-lava, from LAVA_PYTHON (default: python3.10 on PATH,
# else a pyenv 3.10, also without pyenv on PATH); szo drives it through files and a subprocess
# (szo/hw/lava/runner.py).
LAVA_VENV ?= .venv-lava
LAVA_NC ?= 0.10.0
LAVA_STAMP := $(LAVA_VENV)/.lava-installed
IS_PY310 := -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))'
LAVA_PYTHON ?= $(shell for p in python3.10 $$(pyenv root 2>/dev/null)/versions/3.10*/bin/python \
	$${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.10*/bin/python; do \
	if "$$p" $(IS_PY310) >/dev/null 2>&1; then command -v "$$p"; break; fi; done)

.PHONY: help install demo lint test test-kernels quick bench data clean lava lava-python

help:
	@echo "make demo   - install into $(VENV) and run the digits quickstart (BPTT -> subspace -> SZO)"
	@echo "make test   - install into $(VENV), lint (ruff) and run the whole test suite"
	@echo "make quick  - the same without the slow (multi-process) tests"
	@echo "make test-kernels - the float-sensitive tests under PyTorch's generic kernels (part of make test)"
	@echo "make bench  - speed / memory / convergence benchmarks (writes bench/results/)"
	@echo "make data   - Fashion-MNIST for the fmnist recipes (Debian package as root, else torchvision's download)"
	@echo "make lava   - $(LAVA_VENV): lava-nc $(LAVA_NC) on Python 3.10 (LAVA_PYTHON=...); make test then runs the Lava oracle tests"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,dvs,corruptions,deploy,federated,log,lightning]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/szo demo digits --out $(OUT)

lint: $(STAMP)
	$(VENV)/bin/ruff check szo subspace_store tests bench examples

# The float-sensitive tests (marker `kernels`: golden runs, the integer learner) run first under PyTorch's
# generic kernels (ATEN_CPU_CAPABILITY=default, what another CPU may pick) and, on an AVX-512 CPU, under
# AVX2 too: a dependence on this CPU's kernels fails here before it fails on someone else's machine.
KERNEL_CAPS = $(PY) -c "import torch; c = torch.backends.cpu.get_cpu_capability().lower(); \
	print('default avx2' if c.startswith('avx512') else 'default')"

test-kernels: $(STAMP)
	@for cap in $$($(KERNEL_CAPS)); do echo "make test-kernels: ATEN_CPU_CAPABILITY=$$cap"; \
	ATEN_CPU_CAPABILITY=$$cap OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m kernels tests || exit 1; done

# one torch thread per test process (tiny tensors; tests/conftest.py does the same when OMP_NUM_THREADS is unset)
TEST_THREADS ?= 1

test: lint test-kernels
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(PYTEST_ARGS) tests

quick: lint
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) bench/run_all.py

# Fashion-MNIST (the fmnist-* recipes; `make test` does not need it). As root on Debian / Ubuntu the
# offline package; otherwise torchvision downloads the official files into $(SZO_DATA_DIR) or ./data.
data: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get install -y dataset-fashion-mnist; \
	then echo "dataset-fashion-mnist installed"; \
	else $(PY) -c "from szo.data import get_dataset as g; [g('fmnist', s, download=True) for s in ('train', 'test')]"; fi
	$(PY) -c "from szo.data import get_dataset as g; print('fmnist:', len(g('fmnist', 'train')), 'train,', len(g('fmnist', 'test')), 'test')"

lava-python:
	@if [ -z "$(LAVA_PYTHON)" ] || ! "$(LAVA_PYTHON)" $(IS_PY310) >/dev/null 2>&1; then echo "make lava: no Python 3.10 found$(if $(LAVA_PYTHON), (LAVA_PYTHON=$(LAVA_PYTHON) is not one)) - lava-nc $(LAVA_NC) needs >=3.10,<3.11: install one (pyenv install 3.10) or set LAVA_PYTHON=/path/to/python3.10" >&2; exit 1; fi
	@echo "$(LAVA_PYTHON)"

$(LAVA_STAMP):
	@$(MAKE) -s lava-python >/dev/null
	$(LAVA_PYTHON) -m venv $(LAVA_VENV)
	$(LAVA_VENV)/bin/python -m pip install --quiet "lava-nc==$(LAVA_NC)"
	$(LAVA_VENV)/bin/python -c "import lava.proc.lif.models, lava.proc.dense.models; print('lava-nc', '$(LAVA_NC)', 'in $(LAVA_VENV)')"
	touch $(LAVA_STAMP)

lava: $(LAVA_STAMP)

clean:
	rm -rf runs bench/results .pytest_cache
