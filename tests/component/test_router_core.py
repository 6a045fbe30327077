"""RouterCore with in-process workers on memory planes: routing, hints, errors, pool changes, migration.

Locks: a stream is proxied with exactly one terminal and router-level usage;
unknown model → NotFound, no live worker → Unavailable; backend_instance_id
pins and allowed_worker_ids filters; Route explains the choice per candidate;
a worker that leaves discovery leaves routing and the index at once; a
stream broken before its terminal is migrated (prompt + tokens so far,
max_tokens lowered) and the caller sees one continuous stream; guided
decoding is not migrated after its first token; the migration limit holds.
The migration tests run both ways a caller can take a stream: all through
its iterator, and relayed (worker chunks to a sink, as the router process's
GenerateSession does), where the sink must see the same continuous stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_router_support import collect, collect_via, mesh, mocker, request, tokens_of, wait_for

from meshllm import errors
from meshllm.engine.base import Context, TokenChunk, TokenRequest
from meshllm.engine.mocker import MockerEngine
from meshllm.engine.sample import SampleEngine
from meshllm.v1 import discovery_pb2

VIAS = ["iterator", "sink"]


class FlakyEngine(SampleEngine):
    """The sample engine, but a request breaks (Disconnected) after `break_after` tokens while `broken` is set."""

    def __init__(self, break_after: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.break_after = break_after
        self.broken = True
        self.requests: list[TokenRequest] = []

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        n = 0
        async for chunk in super().generate(request, context):
            if self.broken and n >= self.break_after:
                raise errors.Disconnected("simulated worker crash")
            n += len(chunk.get("token_ids", ()))
            yield chunk


async def test_generate_proxies_one_stream_with_exactly_one_terminal() -> None:
    async with mesh() as m:
        await m.worker(SampleEngine())
        core = await m.router()
        chunks = await collect(core.generate(request("r1", [5, 6], max_tokens=5, model="sample")))
        assert tokens_of(chunks) == [7, 8, 9, 10, 11]
        assert [("finish_reason" in c) for c in chunks].count(True) == 1 and chunks[-1]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "cached_tokens": 0}
        # an empty model name means the only model there is
        assert tokens_of(await collect(core.generate(request("r2", [5], max_tokens=2)))) == [6, 7]
        assert [c.name for c in core.models()] == ["sample"]


async def test_unknown_model_is_not_found_and_a_model_without_live_workers_is_unavailable() -> None:
    async with mesh() as m:
        w = await m.worker(SampleEngine())
        core = await m.router()
        with pytest.raises(errors.NotFound):
            await collect(core.generate(request("r", [1], model="nope")))
        with pytest.raises(errors.NotFound):
            await core.route("nope", [1])
        await w.aclose()
        await wait_for(lambda: not core.pool.all(), what="the worker to leave the pool")
        with pytest.raises(errors.Unavailable):
            await collect(core.generate(request("r", [1], model="sample")))


async def test_backend_instance_id_pins_and_allowed_worker_ids_filter() -> None:
    async with mesh() as m:
        a = await m.worker(SampleEngine(), instance_id="a")
        b = await m.worker(SampleEngine(), instance_id="b")
        core = await m.router()
        for _ in range(3):
            d = await core.route("sample", [1, 2], {"backend_instance_id": "b"})
            assert d.worker_id == "b" and [c.worker_id for c in d.candidates] == ["b"]
        d = await core.route("sample", [1, 2], {"allowed_worker_ids": ["a"]})
        assert d.worker_id == "a"
        with pytest.raises(errors.Unavailable):
            await core.route("sample", [1], {"backend_instance_id": "ghost"})
        with pytest.raises(errors.Unavailable):
            await core.route("sample", [1], {"allowed_worker_ids": ["ghost"]})
        chunks = await collect(core.generate(request("p", [1], max_tokens=2, routing={"backend_instance_id": "a"})))
        assert tokens_of(chunks) == [2, 3]
        assert a.servicer is not None and b.servicer is not None
        assert a.servicer.requests_served >= 1 and b.servicer.requests_served == 0


async def test_route_explains_kv_overlap_per_candidate_and_prefers_the_cached_worker() -> None:
    async with mesh() as m:
        await m.worker(mocker(), instance_id="a")
        await m.worker(mocker(), instance_id="b")
        core = await m.router()
        prompt = list(range(1000, 1000 + 16 * 20 + 5))
        await collect(core.generate(request("warm", prompt, max_tokens=2, routing={"backend_instance_id": "b"})))
        await wait_for(lambda: core.index.worker_blocks("b") >= 20, what="b's KV events")
        d = await core.route("mocker", prompt)
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.worker_id == "b" and d.policy == "kv" and d.prompt_blocks == 20
        assert by_id["b"].overlap_blocks == 20 and by_id["b"].prefill_tokens == 5
        assert by_id["a"].overlap_blocks == 0 and by_id["a"].prefill_tokens == len(prompt)
        assert by_id["b"].cost < by_id["a"].cost
        chunks = await collect(core.generate(request("hit", prompt, max_tokens=2)))
        assert chunks[-1]["usage"]["cached_tokens"] == 320
        listed = {w.worker_id: w for w in core.list_workers("mocker").workers}
        assert listed["b"].indexed_blocks >= 20 and listed["a"].indexed_blocks == 0
        assert listed["b"].total_blocks == 2048 and listed["b"].role == discovery_pb2.WORKER_ROLE_AGGREGATED


async def test_load_is_charged_while_in_flight_and_released_after() -> None:
    async with mesh() as m:
        await m.worker(SampleEngine(token_delay_ms=20), instance_id="a")
        core = await m.router()
        stream = core.generate(request("slow", list(range(100)), max_tokens=50, model="sample"))
        await stream.__anext__()
        status = core.list_workers().workers[0]
        assert status.in_flight == 1 and status.active_blocks > 0
        await stream.aclose()  # type: ignore[attr-defined]
        await wait_for(lambda: core.list_workers().workers[0].in_flight == 0, what="the charge to be released")


async def test_a_worker_leaving_discovery_leaves_routing_and_the_index_at_once() -> None:
    async with mesh() as m:
        a = await m.worker(mocker(), instance_id="a")
        await m.worker(mocker(), instance_id="b")
        core = await m.router()
        prompt = list(range(64))
        await collect(core.generate(request("x", prompt, max_tokens=2, routing={"backend_instance_id": "a"})))
        await wait_for(lambda: core.index.worker_blocks("a") > 0, what="a's blocks in the index")
        assert a.discovery is not None
        await a.discovery.unregister()
        await wait_for(lambda: core.pool.get("a") is None, what="a to leave the pool")
        assert core.index.worker_blocks("a") == 0 and "a" not in core.index
        assert {c.worker_id for c in (await core.route("mocker", prompt)).candidates} == {"b"}


@pytest.mark.parametrize("via", VIAS)
async def test_a_broken_stream_migrates_and_the_caller_sees_one_continuous_stream(via: str) -> None:
    async with mesh() as m:
        flaky = FlakyEngine(break_after=3)
        await m.worker(flaky, instance_id="a")
        good = FlakyEngine()
        good.broken = False
        await m.worker(good, instance_id="b")
        core = await m.router()
        req = request("mig", [10, 20, 30], max_tokens=8, model="sample", routing={"allowed_worker_ids": ["a", "b"]})
        req["stop"]["min_tokens"] = 5
        # pin the first attempt to the flaky worker through the tie-break (ids sort "a" first)
        chunks, yielded = await collect_via(core, req, via)
        assert yielded == (1 if via == "sink" else len(chunks))  # the terminal alone, when relayed
        assert tokens_of(chunks) == [31, 32, 33, 34, 35, 36, 37, 38]
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "cached_tokens": 0}
        resent = good.requests[-1]
        assert resent["token_ids"] == [10, 20, 30, 31, 32, 33]
        assert resent["stop"]["max_tokens"] == 5 and resent["stop"]["min_tokens"] == 2
        assert core.metrics.migrations._value.get() == 1
        # the failed worker cools down: the next request goes to b without trying a
        await collect(core.generate(request("next", [1], max_tokens=2, model="sample")))
        assert len(flaky.requests) == 1


@pytest.mark.parametrize("via", VIAS)
async def test_guided_decoding_is_not_migrated_after_its_first_token(via: str) -> None:
    async with mesh() as m:
        await m.worker(FlakyEngine(break_after=2), instance_id="a")
        good = FlakyEngine()
        good.broken = False
        await m.worker(good, instance_id="b")
        core = await m.router()
        req = request("g", [1], max_tokens=8, model="sample", sampling={"guided": {"regex": "[a-z]+"}})
        chunks, _ = await collect_via(core, req, via)
        assert tokens_of(chunks) == [2, 3]
        assert chunks[-1]["finish_reason"] == "error" and chunks[-1]["error"]["code"] == "Disconnected"
        assert chunks[-1]["usage"]["completion_tokens"] == 2
        assert good.requests == []


@pytest.mark.parametrize("via", VIAS)
async def test_the_migration_limit_holds(via: str) -> None:
    async with mesh() as m:
        engines = [FlakyEngine(break_after=1) for _ in range(3)]
        for i, e in enumerate(engines):
            await m.worker(e, instance_id=f"w{i}")
        core = await m.router(migration_limit=1)
        chunks, _ = await collect_via(core, request("lim", [1], max_tokens=8, model="sample"), via)
        assert tokens_of(chunks) == [2, 3]  # one token from each of the two attempts
        assert chunks[-1]["finish_reason"] == "error"
        assert sum(len(e.requests) for e in engines) == 2


async def test_an_error_before_any_token_is_raised_with_its_class() -> None:
    class Refusing(SampleEngine):
        async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
            raise errors.ContextLengthExceeded("prompt too long", param="prompt")
            yield {}

    async with mesh() as m:
        await m.worker(Refusing())
        core = await m.router()
        with pytest.raises(errors.ContextLengthExceeded, match="prompt too long"):
            await collect(core.generate(request("e", [1], model="sample")))


async def test_a_slow_caller_gets_coalesced_chunks_with_every_token() -> None:
    async with mesh() as m:
        await m.worker(SampleEngine())
        core = await m.router()
        got = []
        async for chunk in core.generate(request("c", [0], max_tokens=200, model="sample")):
            got.append(chunk)
            await asyncio.sleep(0.005)  # the slow caller under test
        assert tokens_of(got) == list(range(1, 201))
        assert len(got) < 150
        assert got[-1]["usage"]["completion_tokens"] == 200


class FlakyMocker(MockerEngine):
    """A mocker whose streams break (Disconnected) after `break_after` tokens while `broken` is set."""

    def __init__(self, break_after: int) -> None:
        super().__init__(mocker().config)
        self.break_after = break_after
        self.broken = True

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        n = 0
        async for chunk in super().generate(request, context):
            if self.broken and n >= self.break_after:
                raise errors.Disconnected("simulated worker crash")
            n += len(chunk.get("token_ids", ()))
            yield chunk


@pytest.mark.parametrize("via", VIAS)
async def test_a_migrated_mocker_stream_is_token_identical_to_an_undisturbed_one(via: str) -> None:
    prompt = list(range(7, 300))
    async with mesh() as m:
        await m.worker(mocker())
        core = await m.router()
        expected = tokens_of(await collect(core.generate(request("ref", prompt, max_tokens=40, model="mocker"))))
    async with mesh() as m:
        await m.worker(FlakyMocker(break_after=10), instance_id="a")
        await m.worker(mocker(), instance_id="b")
        core = await m.router()
        # equal costs: the tie-break (worker id) sends the first attempt to the flaky "a"
        req = request("mig", prompt, max_tokens=40, model="mocker", routing={"allowed_worker_ids": ["a", "b"]})
        chunks, _ = await collect_via(core, req, via)
    assert core.metrics.migrations._value.get() == 1
    assert tokens_of(chunks) == expected and len(expected) == 40
    assert chunks[-1]["usage"]["completion_tokens"] == 40 and chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
