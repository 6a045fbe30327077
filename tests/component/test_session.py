"""Generate streams on one session call over a real grpc.aio server (meshllm.plane.request.session).

A tiny Worker servicer hands each `GenerateSession` call to a `SessionServer`
whose handler a test scripts (session_support.py); the client is a
`SessionClient` over a `ChannelCache` channel, as `WorkerClient.generate`
builds it. Every test runs on both carriers of a session: a gRPC
GenerateSession call, and frames on a TCP connection (plane/request/tcp_session.py).
Locks: one call carries many streams, each with its own chunks in
order and one terminal; the interval rule (batching under a fast engine, at
once when idle); merging for a slow reader; cancel; errors as the same class
as a unary Generate call gives; incomplete streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from session_support import (
    WAIT_S,
    SessionWorker,
    assert_one_terminal_last,
    carrier,
    close,
    collect,
    counted,
    done,
    req,
    serve,
    session_client,
    tokens_of,
    unary,
)

from meshllm import errors
from meshllm.engine.base import terminal
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.convert import request_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.testing.waiting import wait_until
from meshllm.v1 import session_pb2, worker_pb2_grpc

pytestmark = pytest.mark.usefixtures("carrier")
__all__ = ["carrier"]  # the fixture, imported to parametrize this module

# ---------------------------------------------------------------- one call, many streams


async def test_concurrent_streams_share_one_call_each_with_its_own_chunks_in_order() -> None:
    """Locks: 24 streams of one client ride one GenerateSession call; each gets its own tokens in order and one terminal."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        k = int(request.get("annotations", {})["k"])
        async for chunk in counted(10 + k, base=1000 * k):
            yield chunk

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        results = await asyncio.gather(*(collect(client.generate(req(f"r{k}", k=str(k)))) for k in range(24)))
        assert servicer.calls == 1
        for k, chunks in enumerate(results):
            assert tokens_of(chunks) == [1000 * k + i for i in range(10 + k)]
            assert_one_terminal_last(chunks)
            assert chunks[-1]["usage"]["completion_tokens"] == 10 + k
        # A later stream reuses the same call.
        assert tokens_of(await collect(client.generate(req("again", k="0")))) == list(range(10))
        assert servicer.calls == 1
        assert servicer.sessions.open_streams == 0


# ---------------------------------------------------------------- the interval rule


async def test_a_fast_engine_batches_into_few_messages_within_the_interval() -> None:
    """Locks: with min_interval_s = 0.05, 50 tokens made back to back arrive all, in order, in far fewer than 50 messages."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        async for chunk in counted(50):
            yield chunk

    servicer = SessionWorker(handler, min_interval_s=0.05)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        chunks = await collect(client.generate(req("r")))
        assert tokens_of(chunks) == list(range(50))
        assert_one_terminal_last(chunks)
        messages, items = client.stats
        assert messages <= 10, f"{messages} messages for 50 tokens"
        assert items < 51


async def test_with_no_interval_each_token_reaches_the_client_as_soon_as_it_exists() -> None:
    """Locks: min_interval_s = 0 and an engine that makes the next token only after the client saw the last:
    every token is its own chunk (nothing waits for company)."""
    permits: asyncio.Queue[None] = asyncio.Queue()

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        for i in range(20):
            await permits.get()
            yield {"token_ids": [i]}
        yield done(20)

    servicer = SessionWorker(handler, min_interval_s=0.0)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        stream = session_client(channels, srv.address).generate(req("r"))
        seen = []
        for i in range(20):
            permits.put_nowait(None)
            chunk = await asyncio.wait_for(anext(stream), WAIT_S)
            assert chunk == {"token_ids": [i]}
            seen.append(chunk)
        last = await asyncio.wait_for(anext(stream), WAIT_S)
        assert last["finish_reason"] == "length"
        with pytest.raises(StopAsyncIteration):
            await anext(stream)


async def test_the_first_message_never_waits_for_the_interval() -> None:
    """Locks: a token made when no message left within the interval goes at once (interval 60 s, answer well within it)."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [7]}
        await asyncio.Event().wait()  # never ends: only the first token matters
        yield done(1)

    servicer = SessionWorker(handler, min_interval_s=60.0)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        stream = session_client(channels, srv.address).generate(req("r"))
        try:
            assert await asyncio.wait_for(anext(stream), WAIT_S) == {"token_ids": [7]}
        finally:
            await close(stream)


async def test_a_streams_first_chunk_never_waits_for_the_interval_of_a_busy_session() -> None:
    """Locks: stream A's token has just gone (interval 60 s running); stream B's first token still goes at once (TTFT)."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1 if request["request_id"] == "a" else 9]}
        await asyncio.Event().wait()  # never ends: only the early tokens matter
        yield done(1)

    servicer = SessionWorker(handler, min_interval_s=60.0)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        a = client.generate(req("a"))
        try:
            assert await asyncio.wait_for(anext(a), WAIT_S) == {"token_ids": [1]}
            b = client.generate(req("b"))
            try:
                assert await asyncio.wait_for(anext(b), WAIT_S) == {"token_ids": [9]}
            finally:
                await close(b)
        finally:
            await close(a)


async def test_a_fast_engine_sends_one_message_per_client_turn_not_one_per_step() -> None:
    """Locks flow control with no interval: an engine stepping at loop speed (200 steps, no clock anywhere) reaches
    the client in far fewer messages than steps, since the server sends its next message only once the client has
    taken the last; every token arrives, in order."""
    n = 200

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        for i in range(n):
            await asyncio.sleep(0)  # an engine step: one loop turn
            yield {"token_ids": [i]}
        yield done(n)

    servicer = SessionWorker(handler, min_interval_s=0.0)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        chunks = await collect(client.generate(req("r")))
        assert tokens_of(chunks) == list(range(n))
        assert_one_terminal_last(chunks)
        messages, _ = client.stats
        assert messages < n // 2, f"{messages} messages for {n} engine steps: the server did not wait for the client"


# ---------------------------------------------------------------- a slow reader


async def test_a_slow_reader_gets_merged_chunks_with_every_token_and_logprob_in_order() -> None:
    """Locks: tokens a lagging reader has not taken merge (token ids and logprobs concatenated, in order);
    the terminal is never merged into them."""
    n = 200

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        for i in range(n):
            await asyncio.sleep(0)  # an engine step
            yield {"token_ids": [i], "logprobs": [{"token_id": i, "logprob": -i / 1024}]}  # exact in the proto's float32
        yield terminal("eos", {"prompt_tokens": 1, "completion_tokens": n + 1, "cached_tokens": 0}, token_ids=[n])

    servicer = SessionWorker(handler, min_interval_s=0.0)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        chunks = []
        async for chunk in session_client(channels, srv.address).generate(req("r")):
            chunks.append(chunk)
            await asyncio.sleep(0.01)  # the behaviour under test: a reader slower than the engine
    body, last = chunks[:-1], chunks[-1]
    assert tokens_of(body) == list(range(n))
    assert [lp["token_id"] for c in body for lp in c["logprobs"]] == list(range(n))
    assert [lp["logprob"] for c in body for lp in c["logprobs"]] == [-i / 1024 for i in range(n)]
    assert all(len(c["token_ids"]) == len(c["logprobs"]) for c in body)
    assert len(body) < n, "a reader 10 ms per chunk behind an engine at loop speed saw no merged chunk"
    assert last["finish_reason"] == "eos" and last["token_ids"] == [n]
    assert all("finish_reason" not in c for c in body)


# ---------------------------------------------------------------- cancel


@pytest.mark.parametrize("drop", ["aclose", "break"])
async def test_dropping_a_stream_cancels_its_handler_and_the_others_keep_going(drop: str) -> None:
    """Locks: a stream closed (or abandoned by `break`) sends a cancel: its handler sees CancelledError;
    another stream of the same session runs to its terminal."""
    cancelled = asyncio.Event()
    other_go = asyncio.Event()

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        if request["request_id"] == "victim":
            try:
                yield {"token_ids": [1]}
                await asyncio.Event().wait()  # until cancelled
            except asyncio.CancelledError:
                cancelled.set()
                raise
        else:
            yield {"token_ids": [2]}
            await other_go.wait()
            for i in range(3, 6):
                yield {"token_ids": [i]}
            yield done(4)

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        other = client.generate(req("other"))
        assert await asyncio.wait_for(anext(other), WAIT_S) == {"token_ids": [2]}
        if drop == "aclose":
            victim = client.generate(req("victim"))
            assert await asyncio.wait_for(anext(victim), WAIT_S) == {"token_ids": [1]}
            await close(victim)
        else:
            async for chunk in client.generate(req("victim")):
                assert chunk == {"token_ids": [1]}
                break  # the iterator is dropped here; its finalizer sends the cancel
        await asyncio.wait_for(cancelled.wait(), WAIT_S)
        other_go.set()
        rest = await asyncio.wait_for(collect(other), WAIT_S)
        assert tokens_of(rest) == [3, 4, 5]
        assert_one_terminal_last(rest)
        assert servicer.calls == 1
        await wait_until(lambda: servicer.sessions.open_streams == 0, what="no open server streams")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "exc",
    [
        errors.InvalidArgument("temperature must be <= 2", param="temperature"),
        errors.NotFound("no such model"),
        errors.EngineShutdown("engine is going away"),
        errors.ContextLengthExceeded("prompt is 9000 tokens"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_mesh_error_arrives_as_the_same_class_with_its_message(exc: errors.MeshError) -> None:
    """Locks: a MeshError raised by the handler (before or after chunks) ends only its stream, as the same class."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        if request.get("annotations", {}).get("after"):
            yield {"token_ids": [9]}
        raise exc

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        with pytest.raises(type(exc)) as info:
            await collect(client.generate(req("before")))
        assert type(info.value) is type(exc) and info.value.message == exc.message
        got: list[TokenChunk] = []
        with pytest.raises(type(exc)) as info:
            async for chunk in client.generate(req("after", after="1")):
                got.append(chunk)
        assert type(info.value) is type(exc) and got == [{"token_ids": [9]}]
        assert servicer.calls == 1
        with pytest.raises(type(exc)) as unary_info:
            await collect(unary(channels, srv.address, req("unary")))
        assert type(unary_info.value) is type(exc) and unary_info.value.message == exc.message


async def test_an_unexpected_exception_is_unknown_and_the_session_keeps_serving() -> None:
    """Locks: a bare exception in a handler becomes Unknown("Type: message") on its stream only;
    the next stream on the same call works."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        if request.get("annotations", {}).get("boom"):
            raise ZeroDivisionError("boom")
        async for chunk in counted(3):
            yield chunk

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        with pytest.raises(errors.Unknown, match="ZeroDivisionError: boom"):
            await collect(client.generate(req("bad", boom="1")))
        assert tokens_of(await collect(client.generate(req("good")))) == [0, 1, 2]
        assert servicer.calls == 1
        with pytest.raises(errors.Unknown, match="ZeroDivisionError: boom"):
            await collect(unary(channels, srv.address, req("bad", boom="1")))


async def test_a_timeout_error_of_the_handler_itself_is_unknown_as_in_a_generate_call() -> None:
    """Locks: only the stream's own deadline makes ResponseTimeout; a TimeoutError the engine raises
    (no deadline set) is an unexpected exception, Unknown, exactly as the unary Generate call maps it."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}
        raise TimeoutError("engine step took too long")

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        with pytest.raises(errors.Unknown, match="TimeoutError: engine step took too long"):
            await collect(unary(channels, srv.address, req("unary")))
        with pytest.raises(errors.Unknown, match="TimeoutError: engine step took too long"):
            await collect(session_client(channels, srv.address).generate(req("session")))


async def test_a_handler_ending_without_a_terminal_is_stream_incomplete() -> None:
    """Locks: a handler that just stops yields StreamIncomplete after the chunks it did send."""

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        got: list[TokenChunk] = []
        with pytest.raises(errors.StreamIncomplete):
            async for chunk in session_client(channels, srv.address).generate(req("r")):
                got.append(chunk)
        assert got == [{"token_ids": [1]}]


async def test_nothing_after_the_terminal_is_sent_and_the_handler_runs_to_its_end() -> None:
    """Locks: chunks a handler yields after its terminal never reach the client; the handler is not cancelled."""
    finished = asyncio.Event()

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}
        yield done(1)
        yield {"token_ids": [2]}  # a broken engine: after the terminal
        finished.set()

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        chunks = await collect(session_client(channels, srv.address).generate(req("r")))
        await asyncio.wait_for(finished.wait(), WAIT_S)
    assert tokens_of(chunks) == [1]
    assert_one_terminal_last(chunks)


async def test_an_error_after_the_terminal_puts_nothing_more_on_the_wire() -> None:
    """Locks: once a stream's terminal is out, nothing more of it is sent, not even an error its handler raises later
    (read on the raw call: the next stream's items follow the terminal directly)."""
    release = asyncio.Event()

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        if request["request_id"] == "b":
            yield done(0)
            return
        yield done(0)
        await release.wait()
        raise errors.NotFound("raised after the terminal")

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, grpc.aio.insecure_channel(srv.address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).GenerateSession()
        await call.write(session_pb2.SessionUp(open=[session_pb2.StreamOpen(stream_id=1, request=request_to_proto(req("a")))]))
        seen: list[tuple[int, str]] = []

        async def read_until_terminal_of(sid: int) -> None:
            while (sid, "terminal") not in seen:
                down = await asyncio.wait_for(call.read(), WAIT_S)
                seen.extend((i.stream_id, "error" if i.HasField("error") else "terminal") for i in down.items)

        await read_until_terminal_of(1)
        release.set()
        await wait_until(lambda: servicer.sessions.open_streams == 0, what="stream 1's handler to end")
        await call.write(session_pb2.SessionUp(open=[session_pb2.StreamOpen(stream_id=2, request=request_to_proto(req("b")))]))
        await read_until_terminal_of(2)
        call.cancel()
    assert seen == [(1, "terminal"), (2, "terminal")]
