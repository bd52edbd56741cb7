# Entry points: `make run` (local CPU example end to end) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# The CPU build of torch is installed first: a bare requirement would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: setup run test test-all lock tiny clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -c requirements.lock -e '.[dev]'
	touch $@

tiny: setup
	$(BIN)/finetune tiny --model-dir .local/tiny-gpt2 --corpus examples/data/tiny-news.jsonl

run: tiny
	$(BIN)/finetune train examples/local-cpu.yaml

test: setup
	$(BIN)/pytest -q -m "not slow" tests

test-all: setup
	$(BIN)/pytest -q tests

# Regenerates the committed lock from the current venv (same versions CI and the image install).
lock: setup
	$(PY) -m pip freeze --exclude-editable | grep -vE '^(torch|nvidia-|triton|ray-deepspeed-finetune)' > requirements.lock

clean:
	rm -rf .local .pytest_cache
