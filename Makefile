# wscompress — set-up and common jobs. Everything installs into .venv on first use.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast bench small-tables paper-tables clean

install: $(STAMP)

# torch goes first and alone: an unpinned torch pulled in by a dependency would fetch
# gigabytes of CUDA wheels. Override for a GPU build: make install TORCH_SPEC="torch --index-url ..."
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/wscompress run configs/demo.yaml

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf outputs .pytest_cache
