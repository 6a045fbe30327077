"""Disaggregated llama.cpp: a prefill worker and a decode worker in separate processes, routed by the router.

The decode worker pulls each prompt's KV from the prefill worker over gRPC
(`Worker.PullKv`) and must produce exactly the tokens it produces on its own
(aggregated greedy), with the same prompt chunking on both sides.
"""

from __future__ import annotations

import pytest
from test_llamacpp_support import collect, greedy, question, require_model, start_worker, tokens_of

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.request.channels import ChannelCache
from meshllm.router.client import RouterClient
from meshllm.router.config import RouterConfig, StaticEndpoint
from meshllm.router.main import RouterServer
from meshllm.worker.client import WorkerClient

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = ("--n-ctx", "1024", "--n-seq-max", "2", "--n-batch", "64")  # 64: long prompts go in several chunks
PROMPTS = [
    question("What is the capital of France?"),
    question("Name three fruits that are red."),
    question("Why is the sea salty? " + "Explain it simply. " * 8),
]


async def test_disaggregated_greedy_output_is_token_identical_to_aggregated() -> None:
    """Locks: prefill → KV over gRPC → decode, through the router, equals aggregated greedy for 3 prompts."""
    prefill, p_addr = await start_worker("prefill", *ENGINE)
    decode, d_addr = await start_worker("decode", *ENGINE)
    channels = ChannelCache()
    router = None
    try:
        info = await WorkerClient(channels, d_addr).get_info()
        model = info.model_card.name
        router = await RouterServer.start(
            RouterConfig(
                plane=PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NONE),
                static_endpoint=StaticEndpoint.parse("meshllm.worker.generate"),
                static_workers=(p_addr, d_addr),
                model_name=model,
            )
        )
        core = router.core
        assert core is not None
        await core.pool.wait_until(lambda: len(core.pool.all()) == 2, 60)
        client = RouterClient(channels, router.address)
        disaggregated = []
        for i, prompt in enumerate(PROMPTS):
            chunks = await collect(client.generate(greedy(f"disagg-{i}", prompt, 16, model=model)))
            assert chunks[-1]["finish_reason"] in ("eos", "length"), chunks[-1]
            disaggregated.append(tokens_of(chunks))
        prefill_legs = core.metrics.registry.get_sample_value(
            "meshllm_router_decisions_total", {"router_id": core.id, "policy": core.mode.value, "role": "prefill"}
        )
        assert prefill_legs == len(PROMPTS)  # every request went prefill worker → decode worker
        decode_worker = WorkerClient(channels, d_addr)
        await decode_worker.clear_kv_blocks()  # compute every prompt afresh, as the prefill worker did
        aggregated = [tokens_of(await collect(decode_worker.generate(greedy(f"agg-{i}", p, 16)))) for i, p in enumerate(PROMPTS)]
        assert disaggregated == aggregated
        assert all(len(t) > 1 for t in aggregated)
    finally:
        if router is not None:
            await router.aclose()
        await channels.aclose()
        await prefill.stop()
        await decode.stop()
