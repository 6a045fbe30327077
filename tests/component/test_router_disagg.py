"""Disaggregated prefill → decode through RouterCore with in-process mocker workers.

Locks: a disaggregated stream carries exactly the tokens of an aggregated
run, the first token once; the decode leg gets the prefill's DisaggInfo
plus the prefill worker's id and address; conditional disaggregation keeps
short prompts and well-cached prompts on the decode worker; a cancel during
the prefill leg reaches the prefill engine, which frees the request's blocks
within 1 s (its load snapshot shows 0 active blocks) — the bug of Dynamo
#13691 — and a cancel during the decode leg frees the decode worker's. The
first test runs relayed too (the decode leg's chunks to a sink, as the
router process's GenerateSession takes them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_router_support import Mesh, collect, collect_via, mesh, mocker, request, tokens_of, wait_for

from meshllm.engine.base import Context, TokenChunk, TokenRequest
from meshllm.engine.mocker import MockerEngine
from meshllm.v1 import discovery_pb2
from meshllm.worker.runtime import Worker


class Recording(MockerEngine):
    """A mocker that remembers the requests it was sent."""

    def __init__(self, engine: MockerEngine) -> None:
        super().__init__(engine.config)
        self.requests: list[TokenRequest] = []

    def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        return super().generate(request, context)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 3 for i in range(n)]


async def disagg_mesh(m: Mesh, **prefill_kw: Any) -> tuple[Recording, Recording, Worker, Worker]:
    pre, dec = Recording(mocker(**prefill_kw)), Recording(mocker())
    pw = await m.worker(pre, role="prefill", instance_id="prefill-1")
    dw = await m.worker(dec, role="decode", instance_id="decode-1")
    return pre, dec, pw, dw


@pytest.mark.parametrize("via", ["iterator", "sink"])
async def test_a_disaggregated_stream_equals_the_aggregated_one_with_the_first_token_once(via: str) -> None:
    p = prompt(200)
    async with mesh() as agg_mesh:
        await agg_mesh.worker(mocker())
        core = await agg_mesh.router()
        expected = tokens_of(await collect(core.generate(request("agg", p, max_tokens=12, model="mocker"))))
    assert len(expected) == 12
    async with mesh() as m:
        pre, dec, pw, _ = await disagg_mesh(m)
        core = await m.router()
        decision = await core.route("mocker", p)
        assert decision.role == discovery_pb2.WORKER_ROLE_PREFILL and decision.worker_id == "prefill-1"
        decode = await core.route("mocker", p, role=discovery_pb2.WORKER_ROLE_DECODE)
        assert decode.role == discovery_pb2.WORKER_ROLE_DECODE and decode.worker_id == "decode-1"
        roles = [w.role for w in core.list_workers().workers]  # sorted by id: decode-1, prefill-1
        assert roles == [discovery_pb2.WORKER_ROLE_DECODE, discovery_pb2.WORKER_ROLE_PREFILL]
        chunks, yielded = await collect_via(core, request("dis", p, max_tokens=12, model="mocker"), via)
        assert tokens_of(chunks) == expected
        # relayed, the prefill's first token and the terminal come through the iterator, the decode leg's to the sink
        assert yielded == (2 if via == "sink" else len(chunks))
        assert chunks[0]["token_ids"] == expected[:1]  # the prefill's first token, alone and once
        assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["usage"]["prompt_tokens"] == 200
        assert sum("finish_reason" in c for c in chunks) == 1
        assert [r.get("disagg", {}).get("request_type") for r in pre.requests] == ["context_only"]
        sent = dec.requests[0]["disagg"]
        assert sent["request_type"] == "generation_only" and sent["first_token_ids"] == expected[:1]
        assert sent["prefill_worker_id"] == "prefill-1" and sent["prefill_address"] == pw.address
        assert sent["kv_handle"]


async def test_conditional_disaggregation_keeps_short_and_cached_prompts_local() -> None:
    async with mesh() as m:
        pre, dec, _, _ = await disagg_mesh(m)
        core = await m.router(disagg_min_prompt_tokens=100, disagg_max_local_hit=0.5)
        short = prompt(50, seed=1)
        assert len(tokens_of(await collect(core.generate(request("short", short, max_tokens=4, model="mocker"))))) == 4
        assert pre.requests == [] and "disagg" not in dec.requests[-1]
        long = prompt(320, seed=2)
        await collect(core.generate(request("long1", long, max_tokens=4, model="mocker")))
        assert len(pre.requests) == 1  # remote prefill: the decode worker cached nothing of it
        await wait_for(lambda: core.index.worker_blocks("decode-1") >= 20, what="the decode worker's blocks")
        await collect(core.generate(request("long2", long, max_tokens=4, model="mocker")))
        assert len(pre.requests) == 1 and "disagg" not in dec.requests[-1]  # cached on the decode worker: local
        assert core.metrics.local_prefills._value.get() == 2


async def test_a_cancel_during_prefill_frees_the_prefill_workers_blocks_within_one_second() -> None:
    async with mesh() as m:
        # slow prefill: 4,000 prompt tokens in 256-token chunks at 1/5 speed take seconds
        pre, dec, pw, _ = await disagg_mesh(m, speedup_ratio=0.2, max_num_batched_tokens=256)
        core = await m.router()
        stream = core.generate(request("cancel-me", prompt(4000, seed=3), max_tokens=8, model="mocker"))
        first = asyncio.ensure_future(stream.__anext__())
        sink = pw.sink
        assert sink is not None
        await wait_for(
            lambda: sink.latest_load is not None and sink.latest_load.active_blocks > 0,
            timeout_s=10.0, what="the prefill worker to report blocks in use",
        )  # fmt: skip
        t0 = time.monotonic()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()  # type: ignore[attr-defined]
        cancelled_ms = (time.time() - (time.monotonic() - t0)) * 1000

        def reported_idle() -> bool:  # the LoadSnapshot as it reached the router over the event plane
            rep = core.load.get(("prefill-1", 0)).reported
            return rep is not None and rep.active_blocks == 0 and rep.timestamp_ms >= cancelled_ms

        await wait_for(reported_idle, timeout_s=5.0, what="the prefill worker's load snapshot to show 0 active blocks")
        assert time.monotonic() - t0 < 1.0
        assert pre.blocks.num_used == 0
        assert dec.requests == []  # the decode leg never started
        await wait_for(lambda: core.list_workers().workers[0].in_flight == 0, what="the router's charge to be released")


async def test_a_cancel_during_decode_frees_the_decode_workers_blocks() -> None:
    async with mesh() as m:
        _, dec, _, _ = await disagg_mesh(m)
        core = await m.router()
        stream = core.generate(request("cancel-decode", prompt(100, seed=4), max_tokens=3000, model="mocker"))
        got = []
        async for chunk in stream:
            got.extend(chunk.get("token_ids", ()))
            if len(got) >= 5:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        assert dec.requests and dec.requests[0]["disagg"]["request_type"] == "generation_only"
        await wait_for(lambda: dec.blocks.num_used == 0, timeout_s=5.0, what="the decode worker to free its blocks")
