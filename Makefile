# Entry points: `make run` (local CPU example end to end) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# torch is installed first and pinned: PyPI serves only its CUDA build for Linux (several GB; it runs on CPU).
TORCH_CPU := torch==2.13.0
# torch's own stack, left out of requirements.lock: PyPI's torch for Linux is the CUDA build, which brings
# nvidia-*, cuda-* (bindings, pathfinder, toolkit) and triton; the image installs its own CUDA build instead.
TORCH_STACK := torch|nvidia-|cuda-|triton

.PHONY: setup run test test-all lint lock tiny clean distclean
setup: $(VENV)/.installed

# What running needs, no more (the test tools are $(VENV)/.test-tools, below). Each phase says what it does and how long
# it takes on 2 cores (docs/getting-started.md, "What make run does"), so nothing is silent for long.
$(VENV)/.installed: pyproject.toml requirements.lock
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: this needs Python >= 3.11;" \
	  "$(PYTHON) is $$($(PYTHON) -V 2>&1): run make PYTHON=python3.11 (or newer)" >&2; exit 2; }
	@command -v c++ >/dev/null || { echo "error: no C++ compiler (c++): DeepSpeed builds its CPU ops with one on first use;" \
	  "install g++ (Debian/Ubuntu: apt-get install g++)" >&2; exit 2; }
	@echo "==> install 1/4: virtual environment $(VENV) and pip"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "==> install 2/4: $(TORCH_CPU) (the largest download; 1-2 min)"
	$(PY) -m pip install -q $(TORCH_CPU)
	@echo "==> install 3/4: Ray, DeepSpeed, transformers and the rest from requirements.lock, helm and kubectl (1-2 min)"
	$(PY) -m pip install -q -c requirements.lock -e '.[dev]'
	$(PY) tools/k8s_tools.py
	@echo "==> install 4/4: DeepSpeed's shared-memory collectives for CPU workers (compiled once per machine, 1-2 min)"
	# Built now rather than in the first run's workers (every CPU run loads it; kept in ~/.cache/torch_extensions),
	# as the image builds it (Dockerfile, step 4).
	DS_ACCELERATOR=cpu $(PY) -m app.opbuild deepspeed_shm_comm
	touch $@
	@echo "==> installed: finetune, helm and kubectl are in $(BIN)/ (add it to PATH, or source $(BIN)/activate)"

# The tools only the tests use, each in a venv of its own: `make test`, `make test-all`, `make checkov` and `make e2e`
# install them, `make run` does not (a first run needs neither).
.PHONY: test-tools
test-tools: $(VENV)/.test-tools

# Order-only on setup: reinstalling the app leaves the tools as they are.
$(VENV)/.test-tools: requirements-checkov.txt requirements-mlflow.txt | $(VENV)/.installed
	@echo "==> test tools: checkov (the policy checks) and the MLflow server (the tracking tests), each in a venv of its own"
	# checkov in a venv of its own: its pins (packaging, networkx, ...) conflict with requirements.lock.
	test -x $(VENV)/tools/checkov/bin/python || $(PYTHON) -m venv $(VENV)/tools/checkov
	$(VENV)/tools/checkov/bin/pip install -q -r requirements-checkov.txt
	ln -sf ../tools/checkov/bin/checkov $(BIN)/checkov
	# The full mlflow (the server) pins pyarrow and python-dateutil below requirements.lock's.
	test -x $(VENV)/tools/mlflow/bin/python || $(PYTHON) -m venv $(VENV)/tools/mlflow
	$(VENV)/tools/mlflow/bin/pip install -q -r requirements-mlflow.txt
	touch $@

tiny: setup
	@echo "==> tiny model and corpus, built offline (about 15 s)"
	$(BIN)/finetune tiny --model-dir .local/tiny-gpt2 --corpus examples/data/tiny-news.jsonl

run: tiny
	@echo "==> training: local Ray cluster, 2 CPU workers, ZeRO-3, 40 steps, then export (1-2 min; a first run also builds a DeepSpeed op, 1-2 min more)"
	$(BIN)/finetune train examples/local-cpu.yaml

# The chat example: LoRA on the bundled chat dataset, loss on the assistant turns only, merged final/ + final/adapter/.
.PHONY: run-chat
run-chat: tiny
	@echo "==> chat SFT with LoRA: local Ray cluster, 2 CPU workers, ZeRO-3, 30 steps, then merge and export (1-2 min)"
	$(BIN)/finetune train examples/local-cpu-chat.yaml

# The preference example: DPO with LoRA on the bundled preference pairs; the log shows rewards/accuracies and margins.
.PHONY: run-dpo
run-dpo: tiny
	@echo "==> DPO with LoRA: local Ray cluster, 2 CPU workers, ZeRO-3, 30 steps, then merge and export (1-2 min)"
	$(BIN)/finetune train examples/local-cpu-dpo.yaml

# --durations: the 15 slowest tests in every run, to keep the unit suite inside CI's 20-minute budget. Three files at
# a time (-n 3, each file whole on one worker): on CI's 2 cores the suite is CPU-bound (mostly Ray's worker processes,
# which Ray runs niced: /proc/stat counts them as "nice", not "user"), and a third file keeps both cores busy while
# the other two wait on a held save or each other's ranks; more would only share the same 2 cores.
# --no-loadscope-reorder: the files in tests/conftest.py's order, the longest first (xdist's own
# order, by number of tests, started the longest files last).
test: lint test-tools
	$(BIN)/pytest -q -m "not slow and not e2e" -n 3 --dist loadfile --no-loadscope-reorder --durations=15 tests

# ruff on every file: lint (pycodestyle, pyflakes, import order, line length 120) and `ruff format`'s style.
# `make format` rewrites the files that the check would refuse.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

.PHONY: format
format: setup
	$(BIN)/ruff check --fix --select I001 .
	$(BIN)/ruff format .

test-all: test-tools
	$(BIN)/pytest -q -m "not e2e" tests

# The tests on a real cluster (tests/e2e): builds or reuses etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, the kubelet, kube-proxy, CoreDNS and the KubeRay operator (tools/controlplane/build.sh; cold about
# 20-30 minutes on 2 cores, cached in $${FINETUNE_E2E_CACHE:-~/.cache/finetune-e2e}) and the image (make image),
# starts them with containerd, runc and the CNI bridge (tools/node/install.sh installs Debian's when missing), runs
# the tests, whose pods all run from the image on that node, and stops everything. Root and Debian.
.PHONY: e2e
e2e: test-tools
	@test "$$(id -u)" = 0 || { echo "error: make e2e runs containerd and a kubelet: run it as root" >&2; exit 2; }
	@# Built here, outside pytest's output capture, so a cold build's progress shows; the suite then reuses them.
	bash tools/node/install.sh
	bash tools/controlplane/build.sh >/dev/null
	bash tools/image/build.sh >/dev/null
	$(BIN)/pytest -q -m e2e --durations=15 tests/e2e

# The real node alone (tests/e2e/node.py, tests/e2e/test_node.py): restricted pods of a busybox image on it (the
# node pulls the project's image at its start, as for make e2e); does not depend on setup (it uses the venv as it is).
.PHONY: e2e-node
e2e-node:
	@test "$$(id -u)" = 0 || { echo "error: make e2e-node runs containerd and a kubelet: run it as root" >&2; exit 2; }
	bash tools/node/install.sh
	bash tools/controlplane/build.sh >/dev/null
	bash tools/image/build.sh >/dev/null
	$(BIN)/pytest -q -m e2e tests/e2e/test_node.py

# The image from the Dockerfile, built with buildah and pushed to a local registry (tools/image/build.sh): on a
# stand-in base built here from Debian and PyPI, with torch from PyPI and without the fused-Adam prebuild, since
# Docker Hub, PyTorch's index and nvcc are not available (docs/container.md). Needs root; installs buildah,
# skopeo, docker-registry and debootstrap when missing. Cold about 30 minutes on 2 cores; cached by a key of
# everything that goes into the image in $${FINETUNE_E2E_CACHE:-~/.cache/finetune-e2e}/image, so a warm run
# (and make e2e) builds nothing. Prints IMAGE=localhost:5000/ray-finetune:VERSION, IMAGE_DIGEST=... at the end.
.PHONY: image
image:
	bash tools/image/build.sh

# Regenerates the committed lock from the current venv (same versions CI and the image install).
lock: setup
	$(PY) -m pip freeze --exclude-editable | grep -vE '^($(TORCH_STACK)|ray-deepspeed-finetune)' > requirements.lock

# Starting over: `make clean` forgets the local runs (.local: the tiny model and .local/storage, where make run's
# experiment and its checkpoints live), so the next `make run` trains from scratch; `make distclean` also removes
# the virtual environment (the next make reinstalls).
clean:
	rm -rf .local .pytest_cache

distclean: clean
	rm -rf $(VENV)

# The chart's values.schema.json from the app's config models (tests fail when it is stale), and their reference page.
.PHONY: schema manifests config-docs
schema: config-docs
	$(PY) -m app.schema --write

# docs/configuration.md from the same models: one table per config section (tests/test_config_docs.py fails when
# it is stale). `make schema` runs it too.
config-docs: setup
	$(PY) tools/config_docs.py --write

# k8s/ = the chart rendered with its defaults, one file per purpose (tests fail when it is stale).
manifests: schema
	$(PY) tools/manifests.py

# checkov over the rendered chart (defaults + examples), k8s/ and the Dockerfile; `make test` runs it too.
# The checks that still fail, and why: tests/checkov-accepted.yaml.
.PHONY: checkov
checkov: test-tools
	$(BIN)/pytest -q tests/test_checkov.py

# Lints the Dockerfile with hadolint (a dev dependency), with the flags tests/test_image.py uses:
# strictest threshold, inline ignores disabled, Docker Hub only, OCI labels required. No container engine needed.
.PHONY: lint-image
lint-image: setup
	$(BIN)/hadolint --failure-threshold style --disable-ignore-pragma --trusted-registry docker.io \
	  --require-label org.opencontainers.image.version:text --require-label org.opencontainers.image.source:url \
	  --require-label org.opencontainers.image.revision:text --require-label org.opencontainers.image.licenses:spdx \
	  Dockerfile
