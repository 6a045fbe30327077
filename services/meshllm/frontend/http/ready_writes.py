"""`write_ready`: SSE events that are ready one after the other leave in one write, and no event waits for company.

A stream's events often come several at once: at one event per engine step
(`--no-coalesce`) a session message may carry a few steps of one stream, and
every stream ends with its last delta, the usage event and `[DONE]` back to
back. Each `send` of the ASGI server is a socket write (a system call) per
event. Here the next event is asked for; if the source produces it without
waiting (its pipe already holds the chunk), it joins the batch, and the first
time the source would have to wait, the batch is written before the wait. So
events keep their order and their framing (the client still parses one SSE
event each), a lone event is written as soon as it exists, and a burst costs
one write.

Knowing whether the next event needs a wait means starting the source's
`__anext__` by hand (`send(None)`): it either finishes (ready) or stops at the
future it waits on, which `resumed` then awaits on the task's behalf. A
write that fails or is cancelled while such a step is in flight throws the
cancellation into the step, so the source unwinds as it would under a
cancelled `async for`.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from typing import Any

__all__ = ["resumed", "write_ready"]

Step = Coroutine[Any, Any, bytes]


@types.coroutine
def resumed(step: Step, waiting: Any) -> Generator[Any, Any, bytes]:
    """Await the rest of a step that `send(None)` started and that waits on `waiting`."""
    value = waiting
    while True:
        try:
            sent = yield value
        except BaseException as exc:  # the task's cancellation goes on into the step
            try:
                value = step.throw(exc)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        else:
            try:
                value = step.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


def _unwind(step: Step) -> None:
    """End an in-flight step as a cancelled await would: its source runs its cleanup."""
    try:
        step.throw(asyncio.CancelledError())
    except BaseException:  # the step's end, whatever it is, is what was wanted
        pass


async def write_ready(events: AsyncIterator[bytes], write: Callable[[bytes], Awaitable[None]]) -> bytes:
    """Write the events of `events` through `write`, those ready back to back joined into one write.

    Returns the last batch, the events that were ready when the source ended, unwritten: the caller sends
    them with the end of the response (one write for the last events and the end).
    """
    pending: list[bytes] = []
    while True:
        step: Step = events.__anext__()  # type: ignore[assignment]
        try:
            waiting = step.send(None)
        except StopIteration as done:
            pending.append(done.value)
            continue
        except StopAsyncIteration:
            break
        except BaseException:
            if pending:
                await write(b"".join(pending))  # what was ready goes out before the source's error
            raise
        if pending:
            try:
                await write(b"".join(pending))
            except BaseException:
                _unwind(step)
                raise
            pending = []
        try:
            pending.append(await resumed(step, waiting))
        except StopAsyncIteration:
            break
    return b"".join(pending)
