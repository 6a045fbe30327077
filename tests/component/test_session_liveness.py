"""Stall detection of Generate sessions (plane/request/session.py, `SessionLiveness`) over a real grpc.aio server.

A scripted session servicer (session_support.py) stands for a worker whose
engine hangs, whose process goes silent, or whose prefill is merely slow.
Locks: a stream that stops after its first token fails with `Disconnected`
(migratable) within its progress bound while the session lives on; a
session that goes silent fails every open stream within its stall bound
and the next stream opens a new call; a long prefill is not a stall (the
server's heartbeats keep the session alive); a RouterCore migrates a stream
whose worker's engine hangs, token-exactly; and the router's worker pool
takes a worker that stops answering health checks out of routing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from session_support import METHOD, SessionWorker, assert_one_terminal_last, carrier, collect, counted, req, serve, tokens_of
from test_router_support import Mesh, mesh, mocker, request, wait_for
from test_router_support import collect as collect_core
from test_router_support import tokens_of as core_tokens

from meshllm import errors
from meshllm.config import ConfigError
from meshllm.engine.base import Context
from meshllm.engine.sample import SampleEngine
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.liveness import SessionLiveness
from meshllm.plane.request.session import SessionClient
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.testing.waiting import wait_until
from meshllm.v1 import worker_pb2_grpc

BOUND_S = 1.0  # the stall bounds these tests configure (the least allowed)
SLACK_S = 3.0  # how late past a bound a failure may come on a loaded machine (the watchdog ticks at bound / 8)

pytestmark = pytest.mark.usefixtures("carrier")
__all__ = ["carrier"]  # the fixture, imported to parametrize this module


def client(channels: ChannelCache, address: str, liveness: SessionLiveness) -> SessionClient:
    stub = worker_pb2_grpc.WorkerStub(channels.get(address))
    return SessionClient(stub.GenerateSession, f"worker {address}", METHOD, liveness=liveness)


class Script:
    """A handler per request annotation: "ok" streams 5 tokens; "hang-after" 2 tokens then nothing; "hang" nothing."""

    def __init__(self, prefill_s: float = 0.0) -> None:
        self.prefill_s = prefill_s
        self.cancelled: list[str] = []

    async def __call__(self, request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        mode = request.get("annotations", {}).get("mode", "ok")
        try:
            if mode == "slow-prefill":
                await asyncio.sleep(self.prefill_s)  # the engine computing a long prompt: no chunk meanwhile
            if mode == "hang-after":
                yield {"token_ids": [7]}
                yield {"token_ids": [8]}
            if mode.startswith("hang"):
                await asyncio.Event().wait()  # a hung engine: never another chunk
            async for chunk in counted(5):
                yield chunk
        except asyncio.CancelledError:
            self.cancelled.append(request["request_id"])
            raise


async def test_a_stream_without_progress_after_its_first_token_fails_over_and_the_session_lives_on() -> None:
    """Locks: 2 tokens then nothing → Disconnected after ~stream bound, the tokens before it delivered; the server
    cancels that stream; another stream on the same call completes."""
    script = Script()
    servicer = SessionWorker(script)
    live = SessionLiveness(stall_timeout_s=BOUND_S, stream_stall_timeout_s=BOUND_S)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        sc = client(channels, srv.address, live)
        got: list[int] = []
        last = time.monotonic()
        with pytest.raises(errors.Disconnected, match="made no progress"):
            async with asyncio.timeout(BOUND_S + SLACK_S + 5):
                async for chunk in sc.generate(req("stuck", mode="hang-after")):
                    got.extend(chunk.get("token_ids", ()))
                    last = time.monotonic()
        waited = time.monotonic() - last
        assert got == [7, 8]
        assert BOUND_S <= waited < BOUND_S + SLACK_S, waited
        assert isinstance(errors.Disconnected("x"), errors.Unavailable)  # what the router migrates
        await wait_until(lambda: script.cancelled == ["stuck"], timeout_s=5, what="the server to cancel the stalled stream")
        chunks = await collect(sc.generate(req("fine")))
        assert tokens_of(chunks) == list(range(5))
        assert_one_terminal_last(chunks)
        assert servicer.calls == 1


async def test_a_silent_peer_fails_every_open_stream_and_the_next_stream_opens_a_new_call() -> None:
    """Locks: a server that sends nothing at all (no heartbeats: a frozen process) fails both open streams — one
    mid-stream, one before its first token — with Disconnected within the stall bound; the next stream gets a new call."""
    script = Script()
    servicer = SessionWorker(script)
    servicer.sessions.heartbeat_s = 0  # as silent as a stopped process
    live = SessionLiveness(stall_timeout_s=BOUND_S, stream_stall_timeout_s=0)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        sc = client(channels, srv.address, live)

        async def run(mode: str) -> tuple[list[int], BaseException | None, float]:
            got: list[int] = []
            try:
                async with asyncio.timeout(BOUND_S + SLACK_S + 5):
                    async for chunk in sc.generate(req(mode, mode=mode)):
                        got.extend(chunk.get("token_ids", ()))
            except errors.MeshError as exc:
                return got, exc, time.monotonic()
            return got, None, time.monotonic()

        t0 = time.monotonic()
        (got_a, err_a, end_a), (got_b, err_b, end_b) = await asyncio.gather(run("hang-after"), run("hang"))
        assert got_a == [7, 8] and got_b == []
        for err, end in ((err_a, end_a), (err_b, end_b)):
            assert isinstance(err, errors.Disconnected), err
            assert "sent nothing" in err.message
            assert BOUND_S <= end - t0 < BOUND_S + SLACK_S, end - t0
        chunks = await collect(sc.generate(req("after")))
        assert tokens_of(chunks) == list(range(5))
        assert servicer.calls == 2


async def test_a_long_prefill_is_not_a_stall() -> None:
    """Locks: a stream whose first token takes 2.5 × the stall bound completes: the server's heartbeats keep its session
    alive while nothing else is sent, and the progress bound only starts at the first token."""
    script = Script(prefill_s=2.5 * BOUND_S)
    servicer = SessionWorker(script)
    live = SessionLiveness(stall_timeout_s=BOUND_S, stream_stall_timeout_s=BOUND_S)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        sc = client(channels, srv.address, live)
        t0 = time.monotonic()
        chunks = await asyncio.wait_for(collect(sc.generate(req("long", mode="slow-prefill"))), 2.5 * BOUND_S + 10)
        assert time.monotonic() - t0 >= 2.5 * BOUND_S
        assert tokens_of(chunks) == list(range(5))
        assert_one_terminal_last(chunks)
        assert script.cancelled == []


def test_stall_bounds_out_of_range_are_refused_with_one_line() -> None:
    """Locks: bounds under 1 s (a heartbeat is 0.5 s), NaN, or a negative stream bound are ConfigErrors naming the flag."""
    for kwargs, flag in (
        ({"stall_timeout_s": 0.5}, "--stall-timeout"),
        ({"stall_timeout_s": float("nan")}, "--stall-timeout"),
        ({"stream_stall_timeout_s": -1.0}, "--stream-stall-timeout"),
        ({"stream_stall_timeout_s": 0.2}, "--stream-stall-timeout"),
    ):
        with pytest.raises(ConfigError, match=flag):
            SessionLiveness(**kwargs)  # type: ignore[arg-type]
    assert SessionLiveness(stream_stall_timeout_s=0).stream_stall_timeout_s == 0


async def test_a_worker_that_fails_its_health_check_leaves_routing_and_comes_back() -> None:
    """Locks: a worker answering NOT_SERVING is out of `workers()` within interval + timeout, while its discovery
    record stays; SERVING again brings it back; with every worker unhealthy routing ignores the checks."""
    async with mesh() as m:
        a = await m.worker(mocker(), model="m", instance_id="a")
        b = await m.worker(mocker(), model="m", instance_id="b")
        core = await m.router(health_interval_s=0.2, health_timeout_s=1.0)
        ids = lambda: [w.id for w in core.pool.workers("m")]  # noqa: E731
        assert ids() == ["a", "b"]
        assert a.server is not None and b.server is not None
        await a.server.set_serving(False)
        await wait_for(lambda: ids() == ["b"], timeout_s=5, what="worker a out of routing")
        assert core.pool.get("a") is not None  # still in discovery
        await b.server.set_serving(False)
        await wait_for(lambda: not core.pool.healthy("b"), timeout_s=5, what="worker b unhealthy")
        assert ids() == ["a", "b"]  # all unhealthy: the checks are ignored rather than refusing every request
        await a.server.set_serving(True)
        await b.server.set_serving(True)
        await wait_for(lambda: core.pool.healthy("a") and core.pool.healthy("b"), timeout_s=5, what="both back")
        assert ids() == ["a", "b"]


class HangingEngine(SampleEngine):
    """The sample engine, but a request hangs (the process stays alive) after `hang_after` tokens."""

    def __init__(self, hang_after: int = 3) -> None:
        super().__init__()
        self.hang_after = hang_after
        self.requests: list[TokenRequest] = []
        self.stopped: list[str] = []

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        n = 0
        async for chunk in super().generate(request, context):
            if n >= self.hang_after:
                try:
                    await context.stopped()  # a hung engine step, until the request is stopped or cancelled
                finally:
                    self.stopped.append(request["request_id"])
                return
            n += len(chunk.get("token_ids", ()))
            yield chunk


async def test_the_router_migrates_a_stream_whose_worker_stops_making_progress() -> None:
    """Locks: a worker whose engine hangs mid-stream (its process and session alive) loses the stream to the
    progress bound; the router migrates it token-exactly to the other worker, and the hung request is stopped."""
    m = Mesh(channels=ChannelCache(liveness=SessionLiveness(stall_timeout_s=BOUND_S, stream_stall_timeout_s=BOUND_S)))
    try:
        hung = HangingEngine(hang_after=3)
        await m.worker(hung, instance_id="a")
        good = HangingEngine(hang_after=1000)
        await m.worker(good, instance_id="b")
        core = await m.router()
        # equal costs: the tie-break (worker id) sends the first attempt to the hanging "a"
        req = request("stall", [10, 20, 30], max_tokens=8, model="sample", routing={"allowed_worker_ids": ["a", "b"]})
        chunks = await asyncio.wait_for(collect_core(core.generate(req)), BOUND_S + SLACK_S + 5)
        assert core_tokens(chunks) == [31, 32, 33, 34, 35, 36, 37, 38]
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "cached_tokens": 0}
        assert good.requests[-1]["token_ids"] == [10, 20, 30, 31, 32, 33]
        assert core.metrics.migrations._value.get() == 1
        await wait_until(lambda: hung.stopped == ["stall"], timeout_s=5, what="the hung request to be stopped on a")
    finally:
        await m.aclose()
