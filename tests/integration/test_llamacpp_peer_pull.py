"""A llama.cpp prefill leg pulls a prompt prefix from a peer's host tier over gRPC, on the real SmolLM2-135M GGUF.

Worker A (a real gRPC worker, one slot, a host tier) answers a prompt and then
another one, which evicts the first into its host memory. Engine B, given
A's address as `disagg.kv_source` on a "context_only" leg, pulls the saved
state through A's `Worker.PullKv` (its `pull_kv` resolves the prefix handle
against the tier), loads it into a slot, computes only the rest and reports
the pulled tokens as cached; its decode leg then continues. Restoring is exact
(tests/integration/test_llamacpp_tiers.py), so the greedy output of prefill +
decode equals B's own from-scratch output. A handle A does not hold answers
NOT_FOUND and B computes the prompt instead.
"""

from __future__ import annotations

import pytest
from test_llamacpp_support import ONE_SLOT, greedy, one_slot_engine, question, require_model, run

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import DisaggregationMode
from meshllm.engine.llamacpp.engine import LlamaCppEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.errors import NotFound
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes, prefix_handle
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker, peer_kv_pull

require_model()
pytestmark = pytest.mark.slow

BS = 16
ENGINE = ONE_SLOT


async def engine(*argv: str) -> LlamaCppEngine:
    eng: LlamaCppEngine = await one_slot_engine(*argv)
    return eng


def source(address: str, prompt: list[int]) -> dict[str, object]:
    hashes = block_hashes(prompt, BS)
    return {"worker_id": "a", "address": address, "kv_handle": prefix_handle(BS, hashes), "blocks": len(hashes), "block_size": BS}


async def test_a_prefill_leg_pulls_a_peers_host_tier_prefix_and_decodes_exactly_as_from_scratch() -> None:
    peer = await engine("--kv-host-bytes", "64M")
    plane = PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NONE)
    worker = await Worker.start(
        peer, WorkerConfig(engine="llamacpp", role=DisaggregationMode.AGGREGATED, plane=plane, static=True)
    )
    puller = await engine()
    channels = ChannelCache()
    puller.kv_pull = peer_kv_pull(channels)  # as a worker gives its engine
    try:
        a = question("Name three rivers of Europe and the seas they flow into, with one fact about each of them.")
        client = WorkerClient(channels, worker.address)
        for rid, prompt in (("a", a), ("b", question("What do bees make, and how do they make it?"))):
            [c async for c in client.generate(greedy(rid, prompt, 4))]  # b evicts a into A's host tier
        reference, _ = await run(puller, greedy("ref", a, 8))  # B computes a from scratch
        await puller.clear_kv_blocks()

        leg = greedy("p", a, 8, disagg={"request_type": "context_only", "kv_source": source(worker.address, a)})
        first, term = await run(puller, leg)
        pulled = (len(a) - 1) // BS * BS
        assert term["finish_reason"] == "length" and term["usage"]["cached_tokens"] == pulled
        assert puller.pulled_tokens == pulled and puller.pull_failures == 0
        params = term["disagg"]
        decode = greedy("d", a, 8, disagg={**params, "request_type": "generation_only", "prefill_address": "unused"})
        rest, _ = await run(puller, decode)  # the handle is this engine's own: taken locally
        assert first + rest == reference

        # A no longer holds (never held) this prompt: NOT_FOUND there, computed here, the request succeeds.
        await puller.clear_kv_blocks()  # nothing of c (not even the shared system prompt) is cached here
        c = question("Which metals conduct electricity best, and why is copper used for wires?")
        with pytest.raises(NotFound):
            [x async for x in client.pull_kv(prefix_handle(BS, block_hashes(c, BS)))]
        _, term = await run(
            puller, greedy("c", c, 8, disagg={"request_type": "context_only", "kv_source": source(worker.address, c)})
        )
        assert term["finish_reason"] == "length" and term["usage"]["cached_tokens"] == 0 and puller.pull_failures == 1
    finally:
        await channels.aclose()
        await worker.aclose()
        await puller.cleanup()
