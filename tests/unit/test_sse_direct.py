"""`DirectSse` (frontend/http/sse_direct.py) against a scripted ASGI send: what it takes, in what order it writes.

Locks: nothing is taken before the stream's first event or while the
request's own write is in flight; only plain content deltas of choice 0 are
taken, as `sse_events`' bytes; a send that has to wait for the client goes on
by itself and nothing overtakes it; a send that fails surfaces at the
request's next write.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from meshllm.frontend.http.sse_direct import DirectSse
from meshllm.frontend.openai.bodies import content_event_frame
from meshllm.frontend.openai.inference import Completion
from meshllm.frontend.text.postprocess import Delta
from meshllm.protocol.openai.objects import LogprobEntry


class Send:
    """Records each body; `gate` (when set) makes a send wait for the client; `fail` makes the next one raise."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        if self.gate is not None:
            await self.gate.wait()  # uvicorn waits for a paused transport before it writes
        self.bodies.append(message["body"])


def completion() -> Completion:
    req = SimpleNamespace(model="m", include_usage=False)
    return cast(Completion, SimpleNamespace(id="chatcmpl-1", created=7, request=req))


async def next_turn() -> None:
    """Return after what was already scheduled on the loop (a flush, a new task's first step) has run."""
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


def event(text: str) -> bytes:
    prefix, suffix = content_event_frame("chatcmpl-1", 7, "m", 0, False)
    return prefix + orjson.dumps(text) + suffix


async def test_nothing_is_taken_before_the_first_event() -> None:
    send = Send()
    direct = DirectSse(send, completion())
    assert not direct.take(Delta(0, "a"))
    assert send.bodies == []


async def test_plain_deltas_are_written_as_sse_events_writes_them_together_at_the_end_of_the_loop_turn() -> None:
    send = Send()
    direct = DirectSse(send, completion())
    direct.live = True
    assert direct.take(Delta(0, 'héllo "x"'))
    assert direct.take(Delta(0, ""))  # held-back bytes: nothing to write, as sse_events skips it
    assert direct.take(Delta(0, " world"))
    assert send.bodies == []  # not yet: one write for what this turn of the loop took
    await direct.settle()
    assert send.bodies == [event('héllo "x"') + event(" world")]


async def test_the_taken_events_leave_on_the_next_turn_of_the_loop_without_the_request() -> None:
    send = Send()
    direct = DirectSse(send, completion())
    direct.live = True
    assert direct.take(Delta(0, "a"))
    await next_turn()
    assert send.bodies == [event("a")]


@pytest.mark.parametrize(
    "delta",
    [
        Delta(1, "a"),
        Delta(0, "a", finish_reason="stop"),
        Delta(0, "a", logprobs=[cast(LogprobEntry, {})]),
        Delta(0, "a", reasoning="r"),
        Delta(0, "", tool_calls=[cast(Any, {})]),
        Delta(0, "a", prompt_logprobs=[cast(LogprobEntry, {})]),
    ],
)
async def test_deltas_with_more_than_content_are_left_to_the_request(delta: Delta) -> None:
    send = Send()
    direct = DirectSse(send, completion())
    direct.live = True
    assert not direct.take(delta)
    assert send.bodies == []


async def test_nothing_overtakes_a_send_that_waits_for_the_client() -> None:
    send = Send()
    direct = DirectSse(send, completion())
    direct.live = True
    send.gate = asyncio.Event()
    assert direct.take(Delta(0, "first"))  # taken: its write goes on by itself
    await next_turn()  # the flush ran and its send waits for the client
    assert not direct.take(Delta(0, "second"))  # the request writes it, after the first
    writing = asyncio.create_task(direct.write(b"second"))
    await next_turn()  # the task's first step: its write waits behind the first
    assert direct.writing and send.bodies == []
    assert not direct.take(Delta(0, "third"))  # the request's write is in flight
    send.gate.set()
    await writing
    assert send.bodies == [event("first"), b"second"]
    assert not direct.writing
    assert direct.take(Delta(0, "third"))
    await direct.settle()
    assert send.bodies[-1] == event("third")


async def test_a_failed_direct_write_is_raised_by_the_next_write() -> None:
    send = Send()
    direct = DirectSse(send, completion())
    direct.live = True
    send.fail = OSError("client gone")
    assert direct.take(Delta(0, "a"))
    with pytest.raises(OSError, match="client gone"):
        await direct.write(b"end")
    assert not direct.live  # nothing more is taken
    assert not direct.take(Delta(0, "b"))


async def test_close_drops_a_write_still_waiting() -> None:
    send = Send()
    direct = DirectSse(send, completion())
    direct.live = True
    send.gate = asyncio.Event()
    assert direct.take(Delta(0, "a"))
    direct._flush()
    inflight = direct._inflight
    assert inflight is not None
    direct.close()
    await asyncio.gather(inflight, return_exceptions=True)
    assert inflight.cancelled()
    assert not direct.take(Delta(0, "b"))
    await direct.settle()  # nothing left to wait for
