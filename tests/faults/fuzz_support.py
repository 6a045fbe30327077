"""Support for the fuzz tests: an event loop on a thread for synchronous hypothesis tests, a traceback recorder.

hypothesis runs each example synchronously, so the mesh under test
(`meshllm.testing.minimesh`: mocker worker, router server, frontend with its
HTTP and Inference gRPC servers, on memory planes and real sockets) lives on
a background event loop; `Loop.run(coro)` runs one coroutine there and waits
for it with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings

T = TypeVar("T")


class Loop:
    """An event loop on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class TracebackLog(logging.Handler):
    """Records every log record that carries a traceback, keyed by where its exception was raised."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.keys: list[tuple[str, str, int]] = []
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.exc_info or record.exc_info[1] is None:
            return
        exc = record.exc_info[1]
        frames = traceback.extract_tb(exc.__traceback__)
        where = (frames[-1].filename, frames[-1].lineno or 0) if frames else ("", 0)
        self.keys.append((type(exc).__qualname__, *where))
        self.texts.append(f"{record.getMessage()}: {type(exc).__name__}: {exc}")

    def repeated(self) -> list[str]:
        """Distinct errors whose traceback was logged more than once."""
        return [self.texts[i] for i, k in enumerate(self.keys) if self.keys.index(k) != i]


def capture_tracebacks() -> Iterator[TracebackLog]:
    """Attach a TracebackLog to the root logger for the duration of a fixture."""
    handler = TracebackLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def fuzz_settings(examples: int) -> Callable[[T], T]:
    """The hypothesis settings of every fuzz test: `examples` derandomized examples, no deadline, no database."""
    return settings(  # type: ignore[no-any-return]
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
