"""TCP sessions take messages in the connection's callbacks: a server's acknowledgements, a client's DOWN messages;
and a client acknowledges a message on the loop's next turn, while the consumers it woke work.

Per message sent, the peer acknowledges (flow control); per engine step, a client reads a DOWN message. Taking
them where the connection reads them, rather than waking a task per message, is what these check: what goes
where, in which order, and what a failing receiver does to the session. The full session protocol runs on TCP in
tests/component/test_session*.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshllm import errors
from meshllm.plane.request.session import SessionClient, SessionServer
from meshllm.plane.request.tcp_frames import DOWN, UP
from meshllm.plane.request.tcp_session import TcpCall, TcpSessionServer, _ServerConn
from meshllm.protocol.types import TokenRequest
from meshllm.v1 import session_pb2


def _server_conn() -> _ServerConn:
    owner = TcpSessionServer({"Worker": SessionServer(lambda r, c: None, "m")}, host="127.0.0.1", port=0)
    conn = _ServerConn(owner)
    conn.greeted = True  # past the hello
    conn._hello_timer.cancel()
    return conn


def _up(**fields: object) -> bytes:
    return session_pb2.SessionUp(**fields).SerializeToString()  # type: ignore[arg-type]


async def test_an_acknowledgement_alone_goes_to_the_session_and_anything_else_to_the_reader() -> None:
    conn = _server_conn()
    taken: list[int] = []
    conn._bind_acks(taken.append)
    conn._on_frame(UP, _up(acked=2))
    assert taken == [2] and not conn.ups
    conn._on_frame(UP, _up(acked=1, cancel=[7]))  # a cancel rides with it: the reader takes both, in order
    conn._on_frame(UP, _up(acked=1))  # behind a queued message: queued too, so nothing overtakes it
    assert taken == [2] and [m.acked for m in conn.ups] == [1, 1]
    conn.ups.clear()
    conn._on_frame(UP, _up(flow_control=True))
    assert len(conn.ups) == 1  # the flow switch is the reader's
    conn.ups.clear()
    conn._bind_acks(None)  # the session ended
    conn._on_frame(UP, _up(acked=1))
    assert taken == [2] and len(conn.ups) == 1


async def test_a_session_binds_its_acknowledgements_while_it_runs_and_unbinds_them_after() -> None:
    server = SessionServer(lambda r, c: None, "m")
    bound: list[object] = []
    was_bound = asyncio.Event()

    def bind(take: object) -> None:
        bound.append(take)
        was_bound.set()

    ups: asyncio.Queue[session_pb2.SessionUp | None] = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (m := await ups.get()) is not None:
            yield m

    async def run() -> None:
        async for _ in server.serve(requests(), None, bind_acks=bind):
            pass

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(was_bound.wait(), 5)
    assert len(bound) == 1 and callable(bound[0])
    await ups.put(None)  # the client closes its side: the session ends
    await asyncio.wait_for(task, 5)
    assert bound[-1] is None


def _down(*tokens: int) -> bytes:
    msg = session_pb2.SessionDown()
    for i, t in enumerate(tokens):
        msg.items.add(stream_id=i + 1).chunk.token_ids.append(t)
    return msg.SerializeToString()


async def test_a_client_receiver_gets_the_messages_read_before_it_first_and_then_each_as_it_is_read() -> None:
    call = TcpCall("127.0.0.1:9", "Worker", caller="test", connect_timeout_s=0.01)
    try:
        call._on_frame(DOWN, _down(1))
        call._on_frame(DOWN, _down(2))
        got: list[int] = []
        call.receive(lambda m: got.extend(i.chunk.token_ids[0] for i in m.items))
        assert got == [1, 2]
        call._on_frame(DOWN, _down(3, 4))
        assert got == [1, 2, 3, 4]
        call._eof = True
        assert await asyncio.wait_for(call.read(), 1) is grpc.aio.EOF  # read() now returns only the end
    finally:
        call.cancel()


async def test_a_receiver_that_raises_ends_the_session_as_disconnected() -> None:
    call = TcpCall("127.0.0.1:9", "Worker", caller="test", connect_timeout_s=0.01)
    try:

        def broken(msg: session_pb2.SessionDown) -> None:
            raise RuntimeError("a bug")

        call.receive(broken)
        call._on_frame(DOWN, _down(1))
        with pytest.raises(errors.Disconnected, match="failed on a message"):
            await asyncio.wait_for(call.read(), 1)
    finally:
        call.cancel()


class _Call:
    """A session call whose messages the test hands in, writing acknowledgements at once as a TcpCall does."""

    def __init__(self) -> None:
        self.downs: asyncio.Queue[session_pb2.SessionDown] = asyncio.Queue()
        self.log: list[str] = []
        self.opened = asyncio.Event()
        self.acked = asyncio.Event()

    async def read(self) -> session_pb2.SessionDown:
        return await self.downs.get()

    async def write(self, up: session_pb2.SessionUp) -> None:
        if up.open:
            self.opened.set()
        if up.acked:
            self._ack()

    def write_nowait(self, up: session_pb2.SessionUp) -> bool:
        self._ack()
        return True

    def _ack(self) -> None:
        self.log.append("ack")
        self.acked.set()

    def cancel(self) -> bool:
        return True


async def test_a_message_is_acknowledged_on_the_next_turn_of_the_loop_while_its_consumer_works() -> None:
    """The acknowledgement goes before the consumer tasks the message woke have run, so the server's next message
    travels while they work (one in flight); a relay's work is done before it, in the reader."""
    call = _Call()
    client = SessionClient(lambda: call, "peer", "/meshllm.v1.Worker/Generate")
    request: TokenRequest = {"request_id": "r", "model": "m", "token_ids": [1, 2, 3]}

    async def consume() -> None:
        async for chunk in client.generate(request):
            call.log.append(f"consumer {chunk['token_ids']}")

    task = asyncio.ensure_future(consume())
    try:
        await asyncio.wait_for(call.opened.wait(), 5)
        down = session_pb2.SessionDown()
        down.items.add(stream_id=1).chunk.token_ids.append(7)
        call.downs.put_nowait(down)
        await asyncio.wait_for(call.acked.wait(), 5)
        assert call.log[:2] == ["ack", "consumer [7]"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
