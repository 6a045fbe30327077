"""`write_ready` (meshllm.frontend.http.ready_writes): ready SSE events share a write; none waits for company.

Locks: events the source yields back to back go out as one write, in order; an event that needs a wait is
preceded by a write of what was ready, so nothing ready is held behind it; a source error sends what was ready
first; a cancelled write or wait unwinds the source as a cancelled `async for` would (its cleanup runs) and
leaves it closable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from meshllm.frontend.http.ready_writes import write_ready

WAIT_S = 5.0


class Source:
    """Events released by the test: `ready(*events)` queues events the source yields without waiting."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.cleaned = False
        self.error: Exception | None = None

    def ready(self, *events: bytes) -> None:
        for e in events:
            self.queue.put_nowait(e)

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while (e := await self.queue.get()) is not None:
                if e == b"boom":
                    raise RuntimeError("source failed")
                yield e
        finally:
            self.cleaned = True


async def test_events_ready_back_to_back_share_one_write_in_order() -> None:
    src, writes = Source(), []

    async def write(data: bytes) -> None:
        writes.append(data)

    src.ready(b"a", b"b", b"c", None)
    last = await asyncio.wait_for(write_ready(src.events(), write), WAIT_S)
    assert writes == [] and last == b"abc"  # the end's batch is the caller's, to send with the end


async def test_what_is_ready_is_written_before_the_source_waits() -> None:
    """The test sees the write of a and b while the source still waits for c: nothing ready waits for company."""
    src, writes = Source(), []
    written = asyncio.Event()

    async def write(data: bytes) -> None:
        writes.append(data)
        written.set()

    src.ready(b"a", b"b")
    task = asyncio.ensure_future(write_ready(src.events(), write))
    await asyncio.wait_for(written.wait(), WAIT_S)
    assert writes == [b"ab"] and not task.done()
    written.clear()
    src.ready(b"c")
    await asyncio.wait_for(written.wait(), WAIT_S)
    assert writes == [b"ab", b"c"]
    src.ready(b"d", b"e", None)
    assert await asyncio.wait_for(task, WAIT_S) == b"de"
    assert writes == [b"ab", b"c"]
    assert src.cleaned


async def test_a_source_error_follows_the_write_of_what_was_ready() -> None:
    src, writes = Source(), []

    async def write(data: bytes) -> None:
        writes.append(data)

    src.ready(b"a", b"b", b"boom")
    with pytest.raises(RuntimeError, match="source failed"):
        await asyncio.wait_for(write_ready(src.events(), write), WAIT_S)
    assert writes == [b"ab"]


async def test_a_cancelled_write_unwinds_the_source_that_was_about_to_wait() -> None:
    """The write of a stalls (a slow client) while the source waits for its next event; cancelling the task
    (a disconnect) runs the source's cleanup, and the source can be closed afterwards."""
    src = Source()
    stalled = asyncio.Event()

    async def write(data: bytes) -> None:
        stalled.set()
        await asyncio.Event().wait()  # never drains

    events = src.events()
    src.ready(b"a")
    task = asyncio.ensure_future(write_ready(events, write))
    await asyncio.wait_for(stalled.wait(), WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert src.cleaned
    await events.aclose()  # not "already running"


async def test_a_cancelled_wait_unwinds_the_source() -> None:
    src, writes = Source(), []
    written = asyncio.Event()

    async def write(data: bytes) -> None:
        writes.append(data)
        written.set()

    events = src.events()
    src.ready(b"a")
    task = asyncio.ensure_future(write_ready(events, write))
    await asyncio.wait_for(written.wait(), WAIT_S)
    task.cancel()  # the source waits for its next event
    with pytest.raises(asyncio.CancelledError):
        await task
    assert src.cleaned and writes == [b"a"]
    await events.aclose()
