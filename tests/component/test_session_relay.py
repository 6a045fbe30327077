"""Relaying over Generate sessions: a stream's chunks handed to a relay instead of its iterator (real grpc.aio).

A relay (the router process) forwards a worker session's chunks into its
caller's session. `SessionClient.generate(relay=...)` calls the relay from the
session's reader with each non-terminal chunk, and the iterator yields only
the terminal; `SessionServer(relays=True)` gives its handler's calls a relay
(`CallInfo.relay`) whose chunks are sent as if yielded. Locks: the relay sees every token in order
before the iterator's terminal; a relay that raises fails its own stream
(Unknown, nothing of it passed on after) and no other, and the server stops
that stream; nothing reaches a relay after its stream is dropped;
a relay server's relay chunks and yielded chunks reach the client as one
stream in order. The router's relay (migration, disaggregation) is locked in
test_router_core.py and test_router_disagg.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from session_support import (
    METHOD,
    WAIT_S,
    SessionWorker,
    assert_one_terminal_last,
    close,
    collect,
    counted,
    done,
    req,
    serve,
    session_client,
    tokens_of,
)

from meshllm import errors
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.session import SessionServer
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.testing.waiting import wait_until


async def counted_handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
    k = int(request.get("annotations", {}).get("k", "0"))
    async for chunk in counted(5 + k, base=100 * k):
        yield chunk


async def test_a_sink_gets_every_non_terminal_chunk_in_order_and_the_iterator_only_the_terminal() -> None:
    async with await serve(SessionWorker(counted_handler)) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        sunk: dict[int, list[TokenChunk]] = {k: [] for k in range(8)}
        yielded = await asyncio.gather(
            *(collect(client.generate(req(f"r{k}", k=str(k)), relay=sunk[k].append)) for k in range(8))
        )
        for k in range(8):
            assert tokens_of(sunk[k]) == [100 * k + i for i in range(5 + k)]
            assert not any("finish_reason" in c for c in sunk[k])
            assert len(yielded[k]) == 1 and yielded[k][0]["usage"]["completion_tokens"] == 5 + k
        # the same client streams without a relay as before
        plain = await collect(client.generate(req("plain", k="1")))
        assert tokens_of(plain) == [100 + i for i in range(6)]
        assert_one_terminal_last(plain)


async def burst(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
    """Every chunk and the terminal without a pause: they leave in one message (the chunks merged into one)."""
    k = int(request.get("annotations", {}).get("k", "0"))
    for i in range(4):
        yield {"token_ids": [100 * k + i]}
    yield done(4)


async def test_a_sink_that_raises_fails_its_own_stream_with_unknown_and_the_others_go_on() -> None:
    """Locks: the failing chunk's stream ends with Unknown, even when its terminal came in the same message
    (dropped, not passed on as if nothing had happened); other streams are untouched."""
    async with await serve(SessionWorker(burst)) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        for attempt in range(3):
            seen: list[TokenChunk] = []

            def bad(chunk: TokenChunk, seen: list[TokenChunk] = seen) -> None:
                seen.append(chunk)
                raise KeyError("relay bug")

            good: list[TokenChunk] = []
            results = await asyncio.gather(
                collect(client.generate(req(f"bad{attempt}", k="3"), relay=bad)),
                collect(client.generate(req(f"good{attempt}", k="5"), relay=good.append)),
                return_exceptions=True,
            )
            assert isinstance(results[0], errors.Unknown) and "KeyError: 'relay bug'" in results[0].message
            assert len(seen) == 1 and tokens_of(seen) == [300, 301, 302, 303]  # its terminal came in the same message
            assert tokens_of(good) == [500, 501, 502, 503] and not isinstance(results[1], BaseException)
        assert tokens_of(await collect(client.generate(req("after")))) == [0, 1, 2, 3]


async def test_a_failed_sink_cancels_its_stream_on_the_server() -> None:
    never = asyncio.Event()
    cancelled = asyncio.Event()

    async def endless(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        try:
            yield {"token_ids": [1]}
            await never.wait()
            yield done(1)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def bad(chunk: TokenChunk) -> None:
        raise RuntimeError("relay bug")

    servicer = SessionWorker(endless)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        with pytest.raises(errors.Unknown, match="RuntimeError: relay bug"):
            await collect(client.generate(req("bad"), relay=bad))
        await asyncio.wait_for(cancelled.wait(), WAIT_S)
        await wait_until(lambda: servicer.sessions.open_streams == 0, timeout_s=WAIT_S, what="the stream to end")


async def test_nothing_reaches_a_sink_after_its_stream_is_dropped() -> None:
    release = asyncio.Event()

    async def slow(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}
        await release.wait()
        for i in range(2, 6):
            yield {"token_ids": [i]}
            await asyncio.sleep(0)
        yield done(5)

    servicer = SessionWorker(slow)
    async with await serve(servicer) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        got: list[TokenChunk] = []
        stream = client.generate(req("dropped"), relay=got.append)
        waiting = asyncio.ensure_future(collect(stream))
        await wait_until(lambda: len(got) == 1, timeout_s=WAIT_S, what="the first chunk at the relay")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await close(stream)
        await wait_until(lambda: servicer.sessions.open_streams == 0, timeout_s=WAIT_S, what="the server to cancel it")
        release.set()
        # the session still works, and the dropped stream's relay heard nothing more
        assert tokens_of(await collect(client.generate(req("next")))) == [1, 2, 3, 4, 5]
        assert tokens_of(got) == [1]


class RelayWorker(SessionWorker):
    """A session servicer whose handler relays: odd streams push their tokens to the relay, even ones yield them."""

    def __init__(self) -> None:
        super().__init__(counted_handler)
        self.sessions = SessionServer(self.relay, METHOD, min_interval_s=0.0, relays=True)

    def relay(self, request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        k = int(request.get("annotations", {})["k"])
        relay = call.relay
        assert relay is not None

        async def run() -> AsyncIterator[TokenChunk]:
            yield {"token_ids": [10_000 + k]}  # yielded before anything goes to the relay
            for i in range(6):
                await asyncio.sleep(0)
                if k % 2:
                    relay({"token_ids": [100 * k + i]})
                else:
                    yield {"token_ids": [100 * k + i]}
            yield {"token_ids": [20_000 + k]}  # after the sunk ones
            yield done(8)

        return run()


async def test_a_relay_servers_sink_and_yielded_chunks_reach_the_client_as_one_ordered_stream() -> None:
    async with await serve(RelayWorker()) as srv, ChannelCache() as channels:
        client = session_client(channels, srv.address)
        results = await asyncio.gather(*(collect(client.generate(req(f"r{k}", k=str(k)))) for k in range(1, 7)))
        for k, chunks in zip(range(1, 7), results, strict=True):
            assert tokens_of(chunks) == [10_000 + k, *(100 * k + i for i in range(6)), 20_000 + k]
            assert_one_terminal_last(chunks)
