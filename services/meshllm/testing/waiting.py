"""Wait for a condition with a deadline: the one sanctioned polling loop of the tests.

Used where nothing announces the state a test waits for (another process's
registration, a health status). It polls a predicate, never sleeps a fixed
time hoping something happened, and fails with a message naming what it
waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

__all__ = ["wait_until"]


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"
) -> float:
    """Return the seconds it took for `predicate()` to become true; AssertionError after `timeout_s`."""
    t0 = time.monotonic()
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        await asyncio.sleep(interval_s)  # polling a predicate under a deadline
