"""Flow control of a session (meshllm.plane.request.session, SessionUp.acked / flow_control), without a network.

A client that sets `flow_control` acknowledges each message it has taken; its
server then keeps at most `FLOW_WINDOW` messages unacknowledged, and what
engines make while it waits goes together in the next message (coalescing by
backpressure, no clock). A stream's first chunk never waits for the window,
heartbeats still flow while it is full, and a client that never sets the flag
gets every message as soon as it is ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from meshllm.engine.base import terminal
from meshllm.plane.request.session import FLOW_WINDOW, SessionServer, _ServerSession
from meshllm.protocol.convert import request_to_proto
from meshllm.protocol.types import TokenChunk
from meshllm.v1 import generate_pb2, session_pb2

WAIT_S = 5.0


def opens(*sids: int, flow: bool) -> session_pb2.SessionUp:
    up = session_pb2.SessionUp(flow_control=flow)
    for sid in sids:
        up.open.add(stream_id=sid, request=request_to_proto({"request_id": f"r{sid}", "token_ids": [1, 2, 3]}))
    return up


class Client:
    """The client's side of a session: what the test puts in `up` is what the server reads, in order."""

    def __init__(self) -> None:
        self.up: asyncio.Queue[session_pb2.SessionUp | None] = asyncio.Queue()

    async def messages(self) -> AsyncIterator[session_pb2.SessionUp]:
        while (msg := await self.up.get()) is not None:
            yield msg


def tokens(down: session_pb2.SessionDown, sid: int) -> list[int]:
    return [t for item in down.items if item.stream_id == sid for t in item.chunk.token_ids]


async def test_a_flow_controlled_client_gets_no_message_beyond_the_window_and_the_rest_merged_after_its_ack() -> None:
    """Locks: with the window full, tokens the engine keeps making are held (no message), and the client's
    acknowledgement releases them all, in order, as one message."""
    made = asyncio.Event()
    step = asyncio.Queue[int]()

    async def handler(req: Any, call: Any) -> AsyncIterator[TokenChunk]:
        for _ in range(12):
            yield {"token_ids": [await step.get()]}
        made.set()
        yield terminal("length", {"prompt_tokens": 3, "completion_tokens": 12, "cached_tokens": 0})

    client = Client()
    client.up.put_nowait(opens(1, flow=True))
    run = _ServerSession(SessionServer(handler, "/t", heartbeat_s=0.0)).run(client.messages())
    step.put_nowait(0)
    first = await asyncio.wait_for(anext(run), WAIT_S)
    assert tokens(first, 1) == [0]
    assert FLOW_WINDOW == 1  # what the rest of this test counts on
    for i in range(1, 12):
        step.put_nowait(i)  # the engine goes on while the message is unacknowledged
    await asyncio.wait_for(made.wait(), WAIT_S)
    held = asyncio.ensure_future(anext(run))
    await asyncio.sleep(0)  # let the writer look: it must not send (the check could fail: a message would be ready)
    await asyncio.sleep(0)
    assert not held.done(), "the server sent beyond its window before the client acknowledged"
    client.up.put_nowait(session_pb2.SessionUp(acked=1))
    second = await asyncio.wait_for(held, WAIT_S)
    chunks = [item.chunk for item in second.items]
    assert len(chunks) == 2, "the held tokens did not merge into one chunk"
    assert list(chunks[0].token_ids) == list(range(1, 12))
    assert chunks[1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    client.up.put_nowait(None)
    await run.aclose()


async def test_without_flow_control_every_ready_message_goes_at_once() -> None:
    """Locks: a client that never sets flow_control (an older peer) acknowledges nothing and still gets each
    step's tokens as their own message."""
    step = asyncio.Queue[int]()

    async def handler(req: Any, call: Any) -> AsyncIterator[TokenChunk]:
        for _ in range(5):
            yield {"token_ids": [await step.get()]}
        yield terminal("length", {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0})

    client = Client()
    client.up.put_nowait(opens(1, flow=False))
    run = _ServerSession(SessionServer(handler, "/t", heartbeat_s=0.0)).run(client.messages())
    for i in range(5):
        step.put_nowait(i)
        down = await asyncio.wait_for(anext(run), WAIT_S)
        assert tokens(down, 1) == [i]
    client.up.put_nowait(None)
    await run.aclose()


async def test_a_new_streams_first_chunk_goes_through_a_full_window() -> None:
    """Locks: stream 1's message is unacknowledged; stream 2's first token still goes at once (TTFT never waits
    for the window)."""
    go = {1: asyncio.Event(), 2: asyncio.Event()}

    async def handler(req: Any, call: Any) -> AsyncIterator[TokenChunk]:
        sid = int(req["request_id"][1:])
        await go[sid].wait()
        yield {"token_ids": [sid]}
        await asyncio.Event().wait()  # never ends: only the first tokens matter
        yield terminal("length", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0})

    client = Client()
    client.up.put_nowait(opens(1, flow=True))
    run = _ServerSession(SessionServer(handler, "/t", heartbeat_s=0.0)).run(client.messages())
    go[1].set()
    assert tokens(await asyncio.wait_for(anext(run), WAIT_S), 1) == [1]
    client.up.put_nowait(opens(2, flow=True))
    go[2].set()
    assert tokens(await asyncio.wait_for(anext(run), WAIT_S), 2) == [2]  # no ack was sent
    client.up.put_nowait(None)
    await run.aclose()


async def test_heartbeats_go_while_the_window_is_full() -> None:
    """Locks: a server waiting for an acknowledgement with tokens held still sends empty messages every
    heartbeat_s, so the client's liveness watch sees a live peer; the held tokens follow the ack."""
    step = asyncio.Queue[int]()

    async def handler(req: Any, call: Any) -> AsyncIterator[TokenChunk]:
        while True:
            yield {"token_ids": [await step.get()]}

    client = Client()
    client.up.put_nowait(opens(1, flow=True))
    run = _ServerSession(SessionServer(handler, "/t", heartbeat_s=0.05)).run(client.messages())
    step.put_nowait(0)
    assert tokens(await asyncio.wait_for(anext(run), WAIT_S), 1) == [0]
    step.put_nowait(1)
    beats = 0
    while beats < 2:
        down = await asyncio.wait_for(anext(run), WAIT_S)
        assert not down.items, "a held token was sent without an acknowledgement"
        beats += 1
    client.up.put_nowait(session_pb2.SessionUp(acked=1))
    while not (down := await asyncio.wait_for(anext(run), WAIT_S)).items:
        pass
    assert tokens(down, 1) == [1]
    client.up.put_nowait(None)
    await run.aclose()
