"""The session writer's heartbeats (meshllm.plane.request.session `_ServerSession.run`), without a network.

A server with open streams that has sent nothing for `heartbeat_s` sends an
empty `SessionDown`; while a stream's chunks flow it sends none, and it arms
one heartbeat timer per quiet spell rather than one per wait (the writer waits
for a push after every message it sends).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from meshllm.engine.base import terminal
from meshllm.plane.request.session import SessionServer, _ServerSession
from meshllm.protocol.convert import request_to_proto
from meshllm.protocol.types import TokenChunk
from meshllm.v1 import session_pb2

HEARTBEAT_S = 0.05


def open_one() -> session_pb2.SessionUp:
    up = session_pb2.SessionUp()
    up.open.add(stream_id=1, request=request_to_proto({"request_id": "r1", "token_ids": [1, 2, 3]}))
    return up


async def client(done: asyncio.Event) -> AsyncIterator[session_pb2.SessionUp]:
    yield open_one()
    await done.wait()  # the client's side stays open until the test has read what it needs


async def test_a_quiet_stream_gets_heartbeats_and_its_tokens_right_after() -> None:
    """Locks: while the handler makes nothing (a long prefill), empty messages arrive about every heartbeat_s; the
    first token goes out as soon as it is pushed, and the stream ends with its terminal."""
    release, done = asyncio.Event(), asyncio.Event()

    async def handler(req: Any, call: Any) -> AsyncIterator[TokenChunk]:
        await release.wait()
        yield {"token_ids": [7]}
        yield terminal("length", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0})

    session = _ServerSession(SessionServer(handler, "/test", min_interval_s=0.0, heartbeat_s=HEARTBEAT_S))
    beats, tokens, finished = 0, [], False
    run = session.run(client(done))
    async for down in run:
        if not down.items:
            beats += 1
            if beats == 3:
                release.set()
            continue
        for item in down.items:
            tokens.extend(item.chunk.token_ids)
            finished = finished or bool(item.chunk.finish_reason)
        if finished:
            break
    done.set()
    await run.aclose()
    assert beats == 3
    assert tokens == [7] and finished


async def test_flowing_tokens_send_no_heartbeat_and_arm_one_timer() -> None:
    """Locks: a stream whose tokens come far faster than heartbeat_s gets no empty message in between, and the
    writer's waits between its messages arm at most a couple of timers, not one per message."""
    done = asyncio.Event()
    n = 40

    async def handler(req: Any, call: Any) -> AsyncIterator[TokenChunk]:
        for i in range(n):
            await asyncio.sleep(HEARTBEAT_S / 20)  # the engine's step time: the writer waits for every token
            yield {"token_ids": [i]}
        yield terminal("length", {"prompt_tokens": 3, "completion_tokens": n, "cached_tokens": 0})

    loop = asyncio.get_running_loop()
    timers: list[Any] = []
    call_later = loop.call_later

    def counted(delay: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        handle = call_later(delay, callback, *args, **kw)
        if getattr(callback, "__name__", "") != "_set_result_unless_cancelled":  # not the handler's asyncio.sleep
            timers.append(handle)
        return handle

    session = _ServerSession(SessionServer(handler, "/test", min_interval_s=0.0, heartbeat_s=HEARTBEAT_S * 20))
    messages, beats, tokens = 0, 0, []
    loop.call_later = counted  # type: ignore[method-assign]
    try:
        run = session.run(client(done))
        async for down in run:
            messages += 1
            if not down.items:
                beats += 1
            for item in down.items:
                tokens.extend(item.chunk.token_ids)
            if any(bool(item.chunk.finish_reason) for item in down.items):
                break
        done.set()
        await run.aclose()
    finally:
        del loop.call_later
    assert tokens == list(range(n))
    assert beats == 0
    assert messages > n // 2  # the writer did wait between tokens (it did not batch them all into a few messages)
    assert 1 <= len(timers) <= 2
