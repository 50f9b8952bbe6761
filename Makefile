# wscompress — set-up and common jobs. Everything installs into .venv on first use.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# test processes side by side (one a core, one thread each; a test file stays on one process
# so that its module fixtures are built once); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
PYTEST      := $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: install demo test test-fast test-cross-build test-scripts test-bf16 test-compat bench small-tables paper-tables clean

install: $(STAMP)

# torch goes first and alone: an unpinned torch pulled in by a dependency would fetch
# gigabytes of CUDA wheels. Override for a GPU build: make install TORCH_SPEC="torch --index-url ..."
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[all,dev]"
	$(PY) -m wscompress.kernels.build  # compiled LUT kernels; without a compiler the torch path runs
	touch $(STAMP)

demo: install
	$(VENV)/bin/wscompress run configs/demo.yaml

test: install
	$(PYTEST) -m "not cross_build and not kernel_build and not scripts" --durations=10

test-fast: install
	$(PYTEST) -m "not slow and not cross_build and not kernel_build and not scripts"

# the tests that compile kernels from scratch: another CPU's build compiled and tested on this one
# (the AVX2 build on an AVX-512 machine: ~2 minutes, which kept `make test` over 10) and a build
# killed midway, then rebuilt (~1 minute); .ci/run calls it after `make test`
test-cross-build: install
	$(PY) -m pytest -q -m "cross_build or kernel_build" tests/test_kernels.py

# every benchmark of scripts/ run by its --dry-run (toy sizes, seconds each), so none rots between
# uses: they kept `make test` over 10 minutes; .ci/run calls it after `make test`. The tests share no
# fixtures, so they are spread one by one over the test processes, not file by file
test-scripts: install
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist load) -m scripts --durations=0

# Folders written today load with the oldest transformers pyproject.toml claims and the newest in
# the registry: one small virtual environment per bound holding transformers (and what it pins)
# only, the rest (torch, wscompress) read from .venv through a .pth line; tests/test_compat.py
# writes folders here and loads them there, both ways. .ci/run calls it after `make test`.
COMPAT              ?= .venv-compat
TRANSFORMERS_OLDEST := $(shell sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)

$(COMPAT)/oldest/.installed: SPEC = transformers==$(TRANSFORMERS_OLDEST)
$(COMPAT)/newest/.installed: SPEC = --upgrade transformers
$(COMPAT)/%/.installed: $(STAMP)
	rm -rf $(COMPAT)/$*
	$(PYTHON) -m venv $(COMPAT)/$*
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
	  > "$$($(COMPAT)/$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_wscompress_venv.pth"
	$(COMPAT)/$*/bin/python -m pip install -q $(SPEC)
	touch $@

test-compat: $(COMPAT)/oldest/.installed $(COMPAT)/newest/.installed
	WSCOMPRESS_COMPAT_PYTHONS="$(abspath $(COMPAT))/oldest/bin/python $(abspath $(COMPAT))/newest/bin/python" \
	  $(PY) -m pytest -q tests/test_compat.py

# the suite as a CPU with native bfloat16 runs it (calibration passes in bfloat16), emulated on any CPU
test-bf16: install
	WSCOMPRESS_TEST_BF16=1 $(PYTEST) -m "not slow and not cross_build and not kernel_build and not scripts"

# Paper tables: every recipe of a set at every ratio, one run folder each, then one merged table
# and plot (wscompress report). Calibration statistics are collected once per set and copied into
# each run (compress reuses them when model and data match). Basis Sharing refits its
# coefficients on the compressed model's activations (its default: it won at every ratio on the
# protocol); the paper refits from 40 % on only, which REFIT_FROM=0.4 follows.
SMALL_RATIOS ?= 0.2 0.4
PAPER_RATIOS ?= 0.2 0.3 0.4 0.5
PAPER_MODELS ?= llama-7b llama2-7b mistral-7b opt-6.7b
REFIT_FROM   ?= 0
WS           := $(VENV)/bin/wscompress

# $(1): recipe glob, $(2): ratios, $(3): runs folder, $(4): table folder
define sweep
$(WS) calibrate $(firstword $(wildcard $(1))) -o $(3)/calibration -q
for cfg in $(wildcard $(1)); do for r in $(2); do \
  run=$(3)/$$(basename $$cfg .yaml)-$$r; extra=""; \
  case $$cfg in *basis_sharing*) extra="--set compress.0.refit=$$(awk "BEGIN{print ($$r >= $(REFIT_FROM)) ? \"true\" : \"false\"}")";; esac; \
  echo "== $$cfg ratio $$r $$extra"; mkdir -p $$run && rm -rf $$run/calibration && cp -r $(3)/calibration/calibration $$run/ && \
  $(WS) run $$cfg --set compress.0.ratio=$$r $$extra -o $$run -q || exit 1; \
done; done
$(WS) report $(3) --out $(4)
endef

# SmolLM2-135M equivalents of the paper's setups (configs/small): runs here, on CPU, in minutes
small-tables: install
	$(call sweep,configs/small/*.yaml,$(SMALL_RATIOS),outputs/small,outputs/small-tables)

# The paper's setups (configs/paper): a GPU and hub access (models, WikiText-2, PTB, C4, lm-eval tasks)
paper-tables: export HF_HUB_OFFLINE = 0
paper-tables: export HF_DATASETS_OFFLINE = 0
paper-tables: install
	$(foreach m,$(PAPER_MODELS),$(call sweep,configs/paper/$(m)-*.yaml,$(PAPER_RATIOS),outputs/paper/$(m),outputs/paper-tables/$(m)))

clean:
	rm -rf outputs .pytest_cache
