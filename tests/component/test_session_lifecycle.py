"""Generate sessions when things end: the server stops or closes, deadlines; traceparent; a real worker.

Locks: a stopped server fails open streams with a class the router migrates
and a restarted one serves a new session; a closing server finishes its
streams and refuses new ones; deadlines end streams on both sides; the
traceparent reaches the handler; the real WorkerServicer streams the same
over sessions as over unary Generate calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from session_support import (
    WAIT_S,
    SessionWorker,
    assert_one_terminal_last,
    carrier,
    collect,
    counted,
    done,
    req,
    serve,
    session_client,
    tokens_of,
)

from meshllm import errors
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.sample import SampleEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.session import SessionClient
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.convert import request_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.router.stream.migration import MIGRATABLE
from meshllm.testing.waiting import wait_until
from meshllm.v1 import session_pb2, worker_pb2_grpc
from meshllm.worker.client import SESSION as WORKER_SESSION
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

# ---------------------------------------------------------------- the server going away

pytestmark = pytest.mark.usefixtures("carrier")
__all__ = ["carrier"]  # the fixture, imported to parametrize this module


@pytest.mark.parametrize("how", ["stop(0)", "aclose(grace 0)"])
async def test_a_server_stopping_mid_stream_fails_streams_migratably_and_a_restarted_one_serves_a_new_session(how: str) -> None:
    """Locks: server.stop(0) (or aclose with no grace) under open streams fails each with a class the router migrates
    (Unavailable or StreamIncomplete); a server restarted on the same port serves the next stream on a new call."""
    reached = asyncio.Semaphore(0)

    async def stuck(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}
        reached.release()
        await asyncio.Event().wait()  # never ends: the server stops under it
        yield done(1)

    first = SessionWorker(stuck)
    srv = await serve(first)
    port = srv.port
    async with ChannelCache() as channels:
        client = session_client(channels, srv.address)
        streams = [client.generate(req(f"r{k}")) for k in range(4)]
        for s in streams:
            assert await asyncio.wait_for(anext(s), WAIT_S) == {"token_ids": [1]}
        for _ in streams:
            await asyncio.wait_for(reached.acquire(), WAIT_S)
        if how == "stop(0)":
            await srv.server.stop(0)
            if srv.sessions is not None:
                await srv.sessions.aclose()  # the TCP carrier's stop(0): every connection cut at once
        else:
            srv.grace_s = 0.0  # the closing hook runs, then the grace period ends at once under open streams
            await srv.aclose()
        failures = await asyncio.gather(*(asyncio.wait_for(collect(s), WAIT_S) for s in streams), return_exceptions=True)
        for f in failures:
            assert isinstance(f, MIGRATABLE), f"{type(f).__name__}: {f}"
        assert first.calls == 1

        async def fine(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
            async for chunk in counted(3):
                yield chunk

        second = SessionWorker(fine)
        async with await serve(second, port=port) as srv2:
            assert srv2.port == port
            chunks = await asyncio.wait_for(collect(client.generate(req("after"))), WAIT_S)
            assert tokens_of(chunks) == [0, 1, 2]
            assert second.calls == 1


async def test_a_closing_server_finishes_in_flight_streams_and_refuses_new_ones() -> None:
    """Locks: GrpcServer.aclose runs SessionServer.close first: open streams run to their terminals,
    a new stream on the session is refused with Unavailable, and the session ends long before the grace period."""
    go = asyncio.Event()
    reached = asyncio.Semaphore(0)

    async def gated(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}
        reached.release()
        await go.wait()
        yield {"token_ids": [2]}
        yield done(2)

    servicer = SessionWorker(gated)
    srv = await serve(servicer)
    srv.grace_s = 60.0
    async with ChannelCache() as channels:
        client = session_client(channels, srv.address)
        streams = [client.generate(req(f"r{k}")) for k in range(3)]
        for s in streams:
            assert await asyncio.wait_for(anext(s), WAIT_S) == {"token_ids": [1]}
        for _ in streams:
            await asyncio.wait_for(reached.acquire(), WAIT_S)
        closing = asyncio.ensure_future(srv.aclose())
        try:
            await wait_until(lambda: servicer.sessions.closing, what="the closing hook")
            with pytest.raises(errors.Unavailable, match="shutting down"):
                await asyncio.wait_for(collect(client.generate(req("late"))), WAIT_S)
            go.set()
            for s in streams:
                rest = await asyncio.wait_for(collect(s), WAIT_S)
                assert tokens_of(rest) == [2] and rest[-1]["finish_reason"] == "length"
            await asyncio.wait_for(closing, WAIT_S)  # well inside the 60 s grace: the session ended by itself
        finally:
            go.set()
            await closing
    assert servicer.calls == 1


# ---------------------------------------------------------------- deadline and tracing


async def test_a_deadline_fails_the_stream_with_response_timeout_and_cancels_the_handler() -> None:
    """Locks: deadline= on a handler that never answers → ResponseTimeout near the deadline; the handler is cancelled."""
    cancelled = asyncio.Event()

    async def silent(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        assert call.deadline is not None
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        yield done(0)

    servicer = SessionWorker(silent)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        t0 = time.monotonic()
        with pytest.raises(errors.ResponseTimeout):
            await collect(client.generate(req("r"), deadline=time.monotonic() + 0.2))
        took = time.monotonic() - t0
        assert 0.15 <= took < WAIT_S, took
        await asyncio.wait_for(cancelled.wait(), WAIT_S)


async def test_the_server_enforces_the_stream_timeout_itself() -> None:
    """Locks: StreamOpen.timeout_s alone (a client that never cancels) ends the stream with a ResponseTimeout item."""
    cancelled = asyncio.Event()

    async def silent(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        yield done(0)

    servicer = SessionWorker(silent)
    async with await serve(servicer) as srv, grpc.aio.insecure_channel(srv.address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).GenerateSession()
        op = session_pb2.StreamOpen(stream_id=5, request=request_to_proto(req("r")), timeout_s=0.2)
        await call.write(session_pb2.SessionUp(open=[op]))
        down = await asyncio.wait_for(call.read(), WAIT_S)
        assert [(i.stream_id, i.error.code) for i in down.items] == [(5, "ResponseTimeout")]
        assert cancelled.is_set()
        call.cancel()


async def test_traceparent_reaches_the_handler_when_tracing_is_off() -> None:
    """Locks: generate(traceparent=...) travels in StreamOpen to the handler's CallInfo; no deadline means none."""
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    seen: list[CallInfo] = []

    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        seen.append(call)
        yield done(0)

    servicer = SessionWorker(handler)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        await collect(client.generate(req("with"), traceparent=tp))
        await collect(client.generate(req("without")))
        await collect(client.generate(req("deadline"), deadline=time.monotonic() + 30))
    assert seen[0].traceparent == tp and seen[0].deadline is None
    assert seen[1].traceparent is None
    assert seen[2].deadline is not None and 0 < seen[2].deadline - time.monotonic() < 31


# ---------------------------------------------------------------- through a real worker


async def test_a_real_worker_streams_the_same_over_sessions_as_over_generate_calls() -> None:
    """Locks: 16 concurrent WorkerClient.generate streams (one session) give the same tokens, usage,
    finish and stop reasons as the same 16 requests as unary Generate calls (the sample engine is deterministic)."""

    def request(rid: str, k: int) -> TokenRequest:
        prompt = [100 * k + 3]
        r: TokenRequest = {"request_id": rid, "token_ids": prompt, "stop": {"max_tokens": 5 + k}}
        if k % 3 == 1:
            r["stop"]["stop_token_ids"] = [prompt[-1] + 4]  # finish "stop" after 3 tokens
        elif k % 3 == 2:
            r["eos_token_ids"] = [prompt[-1] + 2]  # finish "eos" with its token
        return r

    def summary(chunks: list[TokenChunk]) -> tuple[Any, ...]:
        assert_one_terminal_last(chunks)
        t = chunks[-1]
        return tokens_of(chunks), t["finish_reason"], t.get("stop_reason"), t["usage"]

    plane = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
    cfg = WorkerConfig(engine="sample", plane=plane, grace_period_s=0.0, drain_timeout_s=5.0)
    engine = SampleEngine(token_delay_ms=1.0)
    async with (
        await Worker.start(engine, cfg, memory_store=MemoryStore(), memory_broker=MemoryBroker()) as w,
        ChannelCache() as channels,
    ):
        client = WorkerClient(channels, w.address)
        calls = await asyncio.gather(*(collect(client.generate_call(request(f"c{k}", k))) for k in range(16)))
        sessions = await asyncio.gather(*(collect(client.generate(request(f"s{k}", k))) for k in range(16)))
        session_client_: SessionClient = channels.shared(w.address, WORKER_SESSION, _unused)
        messages, items = session_client_.stats
    assert [summary(c) for c in sessions] == [summary(c) for c in calls]
    assert {summary(c)[1] for c in calls} == {"length", "stop", "eos"}
    assert 0 < messages <= items


def _unused(channel: grpc.aio.Channel) -> SessionClient:
    raise AssertionError("WorkerClient.generate should have built the session client")
