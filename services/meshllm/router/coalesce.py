"""Token coalescing: when the caller reads slower than the worker writes, queued chunks merge into one.

`coalesce(source)` runs `source` in a reader task that puts chunks on a tiny
queue. A non-terminal chunk arriving while the previous non-terminal chunk
is still queued is merged into it (token ids and logprobs appended, the
newer usage kept), so the queue never holds more than one token chunk and
one terminal, the reader never waits for the caller, and a slow caller gets
fewer, larger chunks. Terminal chunks (and chunks carrying an error or
DisaggParams) are never merged: nothing is merged past a terminal.

Closing the returned iterator (the caller went away) cancels the reader
task, which closes `source` — and with it the worker call — at once.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

from meshllm.protocol.chunks import merge_into
from meshllm.protocol.chunks import mergeable as _mergeable
from meshllm.protocol.types import GenerateChunk

__all__ = ["coalesce", "merge_into"]


class _Pipe:
    def __init__(self) -> None:
        self.queue: collections.deque[GenerateChunk] = collections.deque()
        self.ready = asyncio.Event()
        self.done = False
        self.error: BaseException | None = None
        self.merged = 0

    def put(self, chunk: GenerateChunk) -> None:
        q = self.queue
        if q and _mergeable(chunk) and _mergeable(q[-1]):
            merge_into(q[-1], chunk)
            self.merged += 1
        else:
            q.append(dict(chunk))  # type: ignore[arg-type]  # a private copy we may extend
        self.ready.set()


async def _pump(source: AsyncIterator[GenerateChunk], pipe: _Pipe) -> None:
    try:
        async for chunk in source:
            pipe.put(chunk)
            if "finish_reason" in chunk:
                break
    except Exception as exc:
        pipe.error = exc
    finally:
        pipe.done = True
        pipe.ready.set()
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


async def coalesce(source: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
    """Yield `source`'s chunks, merging those the caller was too slow to take one by one."""
    pipe = _Pipe()
    reader = asyncio.create_task(_pump(source, pipe), name="router-stream-reader")
    finished = False
    try:
        while True:
            if pipe.queue:
                chunk = pipe.queue.popleft()
                if "finish_reason" in chunk:
                    finished = True  # the reader is closing its source: let it finish, do not cancel
                yield chunk
                if finished:
                    return
                continue
            if pipe.done:
                if pipe.error is not None:
                    raise pipe.error
                return
            pipe.ready.clear()
            await pipe.ready.wait()
    finally:
        if not finished and not reader.done():
            reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
