# The README's commands: `make demo`, `make test` and `make test-long`. Each sets everything up on a machine with
# nothing installed: a local virtual environment (.venv) and the exported digits dataset (data/digits).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA := data/digits
PIP_NOISE := is ignored: it is neither a file nor a directory

.PHONY: venv data test demo lint clean

venv: $(STAMP)

# vissl 0.1.6 goes in with --no-deps: its wheel pins numpy 1.19.5 / scikit-learn 0.24.1 (no Python 3.11 builds);
# its real runtime needs are in requirements.txt.
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	$(PY) -m pip install -q --no-deps vissl==0.1.6 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	touch $(STAMP)

data: $(DATA)/train/.complete

$(DATA)/train/.complete: $(STAMP) scripts/export_digits.py
	$(PY) scripts/export_digits.py --out $(DATA)

# Fashion-MNIST (60,000 train / 10,000 test 28x28 grey images) for configs/swav_fashion.yaml, from the IDX files of
# Debian's dataset-fashion-mnist package: installed here if missing and we are root with apt-get; elsewhere, the
# error says what to do. FASHION_IDX=<folder> uses IDX files downloaded from the Fashion-MNIST GitHub instead.
FASHION := data/fashion
FASHION_DEB_IDX := /usr/share/datasets/fashion-mnist
FASHION_IDX ?= $(FASHION_DEB_IDX)

.PHONY: data-fashion

data-fashion: $(FASHION)/train/.complete

$(FASHION)/train/.complete: $(STAMP) scripts/export_fashion_mnist.py
	@if [ ! -d "$(FASHION_IDX)" ]; then \
	  if [ "$(FASHION_IDX)" = "$(FASHION_DEB_IDX)" ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update && apt-get install -y dataset-fashion-mnist; \
	  else \
	    echo "error: no Fashion-MNIST IDX files in $(FASHION_IDX). Either install Debian's package" \
	         "(sudo apt-get update && sudo apt-get install -y dataset-fashion-mnist, then make data-fashion again)," \
	         "or download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and" \
	         "t10k-labels-idx1-ubyte.gz from https://github.com/zalandoresearch/fashion-mnist (folder data/fashion)" \
	         "into a folder DIR and run: make data-fashion FASHION_IDX=DIR" \
	         "(or $(PY) scripts/export_fashion_mnist.py --idx_dir DIR --out $(FASHION))" >&2; \
	    exit 1; \
	  fi; \
	fi
	$(PY) scripts/export_fashion_mnist.py --idx_dir "$(FASHION_IDX)" --out $(FASHION)

# two pytest-xdist workers: the scenarios of many processes on one, one after the other, the rest on the other
# (tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process. `make test` is the suite (CI's command);
# the tests marked long (pyproject.toml: several trainers for minutes, benchmarks' smoke runs) are `make test-long`:
# pytest-xdist's summary does not count them, so the target says so. The short summary (-rfEs) names each failed test,
# error and skip just above the last line, where a log's tail shows them.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -rfEs -n $(TEST_WORKERS) --dist loadgroup

.PHONY: test-long

test: venv data test-tools
	$(PYTEST) -m "not long" tests
	@echo "make test leaves out the tests marked long (several trainers for minutes, benchmarks' smoke runs): make test-long runs them"

test-long: venv data test-tools
	$(PYTEST) -rp -m long tests

# The NAT tests build masquerading routers in network namespaces (tests/nat_testbed.py) and need iptables: installed
# here if missing and we are root with apt-get; elsewhere they are skipped, and the short summary says why.
.PHONY: test-tools

test-tools:
	@if ! command -v iptables >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing iptables for the NAT tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables 2>&1 >/dev/null \
	      | { grep -v "^debconf: delaying package configuration" >&2 || true; }; \
	  else \
	    echo "warning: no iptables: the NAT tests will be skipped (sudo apt-get install -y iptables)" >&2; \
	  fi; \
	fi

demo: venv data
	$(PY) demo.py --data_path $(DATA)

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf checkpoints demo_out .pytest_cache

# The GPU check (README, "GPU check"): on a CUDA machine with this repository, or offline from a bundle of wheels
# for the GPU machine's Python (`make gpu-bundle GPU_PYTHON=3.12`, then `bash gpu_bundle/gpu_check.sh gpu_bundle OUT`).
GPU_PYTHON ?= 3.12
GPU_BUNDLE ?= gpu_bundle

.PHONY: gpu-check gpu-bundle

gpu-check: venv
	$(PY) -m scripts.gpu_check --out benchmarks/results

gpu-bundle: venv
	$(PY) scripts/gpu_bundle.py --python-version $(GPU_PYTHON) --out $(GPU_BUNDLE)
