"""Retries and bounded cancellation for the etcd backend's background tasks (lease keep-alive, watches)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection

__all__ = ["REVOKE_BOUND_S", "Backoff", "cancel_and_wait", "log_failure"]

log = logging.getLogger("meshllm.plane.discovery.etcd")

REVOKE_BOUND_S = 2.0


def log_failure(failures: int, msg: str, *args: object) -> None:
    """Warn on the first failure of a streak and every tenth after it; the rest go to debug."""
    log.log(logging.WARNING if failures == 1 or failures % 10 == 0 else logging.DEBUG, msg, *args)


class Backoff:
    """Retry delays: doubling from `initial` up to `cap`, with ±20 % jitter."""

    def __init__(self, cap: float, initial: float = 0.2) -> None:
        self.cap = max(cap, initial)
        self.initial = initial
        self._next = initial

    @property
    def fresh(self) -> bool:
        """True when no delay was taken since the last reset (the first failure of a streak)."""
        return self._next == self.initial

    def reset(self) -> None:
        self._next = self.initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay * random.uniform(0.8, 1.2)


async def cancel_and_wait(tasks: Collection[asyncio.Task[None]], bound_s: float = REVOKE_BOUND_S) -> None:
    """Cancel background tasks and wait for them to end, bounded.

    Cancels again until each task is done: a cancellation can be swallowed
    inside a library (Python 3.11's `asyncio.wait_for` does so when its
    future completes at the same moment), and closing must not hang on it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    pending = {t for t in tasks if not t.done()}
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.2, max(0.0, deadline - loop.time())))
    if pending:
        log.warning("%d etcd background task(s) did not stop in %gs", len(pending), bound_s)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("etcd background task %s failed", task.get_name(), exc_info=task.exception())
