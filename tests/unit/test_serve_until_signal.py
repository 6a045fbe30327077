"""`serve_until_signal`: any startup failure is one line on stderr and a non-zero status, never a traceback."""

from __future__ import annotations

import pytest

from meshllm.config import ConfigError
from meshllm.lifecycle import AsyncCloseable, serve_until_signal


async def _serve(exc: Exception) -> int:
    async def start() -> AsyncCloseable:
        raise exc

    return await serve_until_signal("worker", start, lambda s: [], service_name="t", otlp_endpoint=None)


@pytest.mark.parametrize(
    ("exc", "status", "line"),
    [
        (ConfigError("port 9 is already in use; choose another with --port or MESHLLM_PORT"), 2,
         "meshllm worker: error: port 9 is already in use; choose another with --port or MESHLLM_PORT"),
        (OSError(24, "Too many open files"), 1, "meshllm worker: error: OSError: [Errno 24] Too many open files"),
    ],
)  # fmt: skip
async def test_a_startup_failure_is_one_line_and_a_status(
    exc: Exception, status: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await _serve(exc) == status
    out = capsys.readouterr()
    assert out.err.splitlines() == [line] and not out.out
