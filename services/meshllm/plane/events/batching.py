"""`FlushPacer`: when to publish what accumulated — at once after a quiet period, then at most once per interval.

Publishers of many small events (a worker's KV events, a router replica's
sync events) collect them and publish one message per flush. The first event
after a quiet period goes on the next loop turn, so an idle system adds no
delay; events made within `interval_s` of the last flush wait for the next
one, so a busy publisher pays one message per interval instead of one per
event. Call from the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["FlushPacer"]


class FlushPacer:
    """Schedules `flush()` after `request()`; `flush_now()` runs it at once (snapshots, close)."""

    def __init__(self, flush: Callable[[], None], interval_s: float) -> None:
        self._flush = flush
        self.interval_s = interval_s
        self.scheduled = False
        self._flushed_at = 0.0

    def request(self) -> None:
        """Something is waiting: flush on the next loop turn, or when the interval since the last flush ends."""
        if self.scheduled:
            return
        self.scheduled = True
        loop = asyncio.get_running_loop()
        wait = self._flushed_at + self.interval_s - time.monotonic()
        if wait <= 0:
            loop.call_soon(self._run)
        else:
            loop.call_later(wait, self._run)

    def flush_now(self) -> None:
        """Flush at once (a scheduled flush still runs later and finds nothing, or the next events)."""
        self._run()

    def _run(self) -> None:
        self.scheduled = False
        self._flushed_at = time.monotonic()
        self._flush()
