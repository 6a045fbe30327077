"""The in-process request plane (meshllm run): a worker of this process called directly keeps the Generate contract."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshllm import errors
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import terminal
from meshllm.engine.sample import SampleEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.local import LocalPeers, Ticker, local_generate
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

METHOD = "/meshllm.v1.Worker/Generate"


def worker_config() -> WorkerConfig:
    plane = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
    return WorkerConfig(engine="sample", plane=plane, grace_period_s=0.0, drain_timeout_s=5.0)


def request(rid: str, k: int) -> TokenRequest:
    r: TokenRequest = {"request_id": rid, "token_ids": [100 * k + 3], "stop": {"max_tokens": 5 + k}}
    if k % 3 == 1:
        r["stop"]["stop_token_ids"] = [100 * k + 7]
    elif k % 3 == 2:
        r["eos_token_ids"] = [100 * k + 5]
    return r


def summary(chunks: list[TokenChunk]) -> tuple[Any, ...]:
    assert sum("finish_reason" in c for c in chunks) == 1 and "finish_reason" in chunks[-1]
    t = chunks[-1]
    return [x for c in chunks for x in c.get("token_ids", ())], t["finish_reason"], t.get("stop_reason"), t["usage"]


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [c async for c in stream]


async def test_a_registered_worker_is_called_in_process_with_the_same_output_as_over_grpc() -> None:
    """Locks: WorkerClient.generate through LocalPeers gives what a unary Generate call gives, and opens no session."""
    peers = LocalPeers()
    async with (
        await Worker.start(SampleEngine(token_delay_ms=1.0), worker_config(), memory_store=MemoryStore(),
                           memory_broker=MemoryBroker(), local=peers) as w,
        ChannelCache(local=peers) as local_channels,
        ChannelCache() as grpc_channels,
    ):  # fmt: skip
        assert peers.get(w.address) is not None
        local = WorkerClient(local_channels, w.address)
        remote = WorkerClient(grpc_channels, w.address)
        calls = await asyncio.gather(*(collect(remote.generate_call(request(f"c{k}", k))) for k in range(9)))
        direct = await asyncio.gather(*(collect(local.generate(request(f"l{k}", k))) for k in range(9)))
        assert not local_channels._shared  # no GenerateSession was opened
        assert w.servicer is not None and w.metrics.aborts._value.get() == 0  # finished streams are not aborts
    assert [summary(c) for c in direct] == [summary(c) for c in calls]
    assert {summary(c)[1] for c in calls} == {"length", "stop", "eos"}
    assert peers.get(w.address) is None  # a stopped worker leaves the registry


async def test_closing_an_in_process_stream_cancels_the_request_in_the_engine() -> None:
    peers = LocalPeers()
    async with (
        await Worker.start(SampleEngine(token_delay_ms=20.0), worker_config(), memory_store=MemoryStore(),
                           memory_broker=MemoryBroker(), local=peers) as w,
        ChannelCache(local=peers) as channels,
    ):  # fmt: skip
        stream = WorkerClient(channels, w.address).generate({"request_id": "r", "token_ids": [3], "stop": {"max_tokens": 500}})
        first = await anext(stream)
        assert first.get("token_ids")
        assert w.servicer is not None and "r" in w.servicer.inflight
        await stream.aclose()  # type: ignore[attr-defined]
        await asyncio.wait_for(w.servicer.wait_idle(), timeout=10)
        assert w.metrics.aborts._value.get() == 1


async def test_errors_keep_their_class_and_others_become_unknown() -> None:
    async def failing(req: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        if req["request_id"] == "mesh":
            raise errors.NotFound("no such model")
        yield {"token_ids": [1]}
        raise ZeroDivisionError("boom")

    with pytest.raises(errors.NotFound, match="no such model"):
        await collect(local_generate(failing, METHOD, {"request_id": "mesh", "token_ids": [1]}, CallInfo()))
    with pytest.raises(errors.Unknown, match="ZeroDivisionError: boom"):
        await collect(local_generate(failing, METHOD, {"request_id": "other", "token_ids": [1]}, CallInfo()))


async def test_a_handler_without_a_terminal_is_incomplete_and_nothing_follows_a_terminal() -> None:
    async def no_terminal(req: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}

    ran_out = asyncio.Event()

    async def extra_after_terminal(req: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        yield terminal("length", {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}, token_ids=[1])
        yield {"token_ids": [2]}  # a broken handler: dropped
        ran_out.set()

    with pytest.raises(errors.StreamIncomplete):
        await collect(local_generate(no_terminal, METHOD, {"request_id": "a", "token_ids": [1]}, CallInfo()))
    out = await collect(local_generate(extra_after_terminal, METHOD, {"request_id": "b", "token_ids": [1]}, CallInfo()))
    assert [c.get("token_ids") for c in out] == [[1]] and out[0]["finish_reason"] == "length"
    assert ran_out.is_set()  # the handler ran to its own end before the terminal was passed on


async def test_with_a_ticker_a_fast_engine_is_read_less_often_and_every_token_arrives() -> None:
    """Locks the interval rule in process: without a ticker every step is its own chunk; with one, the
    consumer asks again only at the next shared tick, so a generator that merges (as engines do) yields fewer."""

    async def merging(req: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        steps = {"made": 0}

        async def engine() -> None:
            while steps["made"] < 50:
                await asyncio.sleep(0)  # one engine step per loop turn
                steps["made"] += 1

        task = asyncio.ensure_future(engine())
        sent = 0
        try:
            while sent < 50:
                made = steps["made"]
                if made > sent:
                    yield {"token_ids": list(range(sent, made))}
                    sent = made
                else:
                    await asyncio.sleep(0)
            yield terminal("length", {"prompt_tokens": 1, "completion_tokens": 50, "cached_tokens": 0})
        finally:
            task.cancel()

    plain = await collect(local_generate(merging, METHOD, {"request_id": "p", "token_ids": [1]}, CallInfo()))
    ticked = await collect(
        local_generate(merging, METHOD, {"request_id": "t", "token_ids": [1]}, CallInfo(), ticker=Ticker(0.05))
    )
    for out in (plain, ticked):
        assert [x for c in out for x in c.get("token_ids", ())] == list(range(50))
    assert len(ticked) < len(plain) / 2
