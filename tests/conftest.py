"""Settings for the whole suite."""

from __future__ import annotations

import gc
import os

import pytest

# The suite runs several llama.cpp engines at once (in this process and in child processes) on few cores, where
# llama.cpp's OpenMP threads should sleep at barriers rather than spin (meshllm/engine/llamacpp/openmp.py). What an
# operator does too; the tests of `--omp-wait auto` clear it for their own processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_finish(session: pytest.Session) -> None:
    # What imports and collection made lives for the whole run: out of the collector's sight, so the collection
    # after each test (below) scans only what tests made.
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    # grpc.aio objects sit in reference cycles. Collected later, while another test's event loop runs, a call of
    # a closed loop makes grpc's poller log "Event loop is closed" tracebacks into that test. Each test's garbage
    # is collected once it is done, when no loop of its own runs any more; what survives (modules a test imported,
    # torch's among them) is frozen, so the next collection scans only what the next test makes.
    yield
    gc.collect()
    gc.freeze()
