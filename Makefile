# The two commands of the README: `make demo` and `make test`. Both set everything up on a machine with
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

test: venv data
	$(PY) -m pytest -q tests

demo: venv data
	$(PY) demo.py --data_path $(DATA)

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf checkpoints demo_out .pytest_cache

# The GPU check (README, "GPU check"): on a CUDA machine with this repository, or offline from a bundle of wheels
# for the GPU machine's Python (`make gpu-bundle GPU_PYTHON=3.12`, then `bash gpu_bundle/gpu_check.sh gpu_bundle OUT`).
GPU_PYTHON ?= 3.12
GPU_BUNDLE ?= gpu_bundle

.PHONY: gpu-check gpu-bundle

gpu-check: venv
	$(PY) benchmarks/gpu_check.py --out benchmarks/results

gpu-bundle: venv
	$(PY) scripts/gpu_bundle.py --python-version $(GPU_PYTHON) --out $(GPU_BUNDLE)
