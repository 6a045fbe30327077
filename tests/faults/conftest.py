"""Fixtures of the fuzz tests (fuzz_support.py): a background event loop, the mini mesh on it, a traceback recorder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fuzz_support import Loop, TracebackLog, capture_tracebacks

from meshllm.testing.minimesh import MiniMesh, start_mini_mesh


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def fuzz_mesh(loop: Loop) -> Iterator[MiniMesh]:
    m = loop.run(start_mini_mesh(), timeout_s=60)
    yield m
    loop.run(m.aclose(), timeout_s=60)


@pytest.fixture(scope="module")
def tracebacks() -> Iterator[TracebackLog]:
    yield from capture_tracebacks()
