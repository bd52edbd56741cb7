# Entry points: `make run` (local CPU example end to end) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# The CPU build of torch is installed first: a bare requirement would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: setup run test test-all lock tiny clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock requirements-checkov.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -c requirements.lock -e '.[dev]'
	$(PY) tools/k8s_tools.py
	# checkov in a venv of its own: its pins (packaging, networkx, ...) conflict with requirements.lock.
	test -x $(VENV)/tools/checkov/bin/python || $(PYTHON) -m venv $(VENV)/tools/checkov
	$(VENV)/tools/checkov/bin/pip install -q -r requirements-checkov.txt
	ln -sf ../tools/checkov/bin/checkov $(BIN)/checkov
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

# The chart's values.schema.json from the app's config models (tests fail when it is stale).
.PHONY: schema manifests
schema: setup
	$(PY) -m app.schema --write

# k8s/ = the chart rendered with its defaults, one file per purpose (tests fail when it is stale).
manifests: schema
	$(PY) tools/manifests.py

# checkov over the rendered chart (defaults + examples), k8s/ and the Dockerfile; `make test` runs it too.
# The checks that still fail, and why: tests/checkov-accepted.yaml.
.PHONY: checkov
checkov: setup
	$(BIN)/pytest -q tests/test_checkov.py

# Lints the Dockerfile with hadolint (a dev dependency), with the flags tests/test_image.py uses:
# strictest threshold, inline ignores disabled, Docker Hub only, OCI labels required. No container engine needed.
.PHONY: lint-image
lint-image: setup
	$(BIN)/hadolint --failure-threshold style --disable-ignore-pragma --trusted-registry docker.io \
	  --require-label org.opencontainers.image.version:text --require-label org.opencontainers.image.source:url \
	  --require-label org.opencontainers.image.revision:text --require-label org.opencontainers.image.licenses:spdx \
	  Dockerfile
