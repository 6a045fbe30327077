"""The llamacpp engine on the real SmolLM2-135M GGUF: batching, prefix reuse, cancellation, KV transfer, model files.

No fakes: every test loads the model through llama.cpp. Prompts and outputs
are short because the machine running them has two shared cores.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
from test_llamacpp_support import MODEL, SYSTEM, chat_tokens, greedy, question, require_model, run

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import Context, DisaggregationMode
from meshllm.engine.llamacpp.engine import LlamaCppEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.errors import FailedPrecondition, InvalidArgument, NotFound
from meshllm.frontend.text.tokenizer import load_tokenizer
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import stored_blocks
from meshllm.testing.conformance import RecordingSink
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker, peer_kv_pull

require_model()
pytestmark = pytest.mark.slow


async def engine(*argv: str) -> LlamaCppEngine:
    eng, _ = await LlamaCppEngine.from_args(["--n-ctx", "1024", *argv])
    eng.sink = RecordingSink()
    await eng.start("test")
    return eng


@pytest.fixture
async def eng() -> AsyncIterator[LlamaCppEngine]:
    e = await engine("--n-seq-max", "8")
    try:
        yield e
    finally:
        await e.cleanup()


QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name a primary color.",
    "What do bees make?",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "What color is the sky?",
    "What animal says moo?",
]


async def test_eight_concurrent_requests_complete_with_the_tokens_they_get_alone(eng: LlamaCppEngine) -> None:
    """Locks: 8 sequences batched together all finish, each with exactly its solo greedy tokens."""
    prompts = [question(q) for q in QUESTIONS]
    alone = [await run(eng, greedy(f"solo-{i}", p, 8)) for i, p in enumerate(prompts)]
    await eng.clear_kv_blocks()  # the batched run computes every prompt afresh
    together = await asyncio.gather(*(run(eng, greedy(f"batch-{i}", p, 8)) for i, p in enumerate(prompts)))
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert all(term["finish_reason"] in ("eos", "length") for _, term in together)


async def test_a_shared_system_prompt_is_reused_and_its_blocks_are_not_stored_again(eng: LlamaCppEngine) -> None:
    """Locks: prefix caching: the second request reports cached tokens; no BlocksStored repeats a shared block."""
    system = SYSTEM + " " + " ".join(f"Rule {i}: be brief, be kind, be correct." for i in range(8))
    first = chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": "What is 2 + 2?"}])
    second = chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": "What is 3 + 3?"}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    sink = eng.sink
    assert isinstance(sink, RecordingSink)
    _, t1 = await run(eng, greedy("sys-1", first, 4))
    shared_blocks = {bh for bh, _ in stored_blocks(first[:shared], 16)}
    stored_first = {bh for blocks, _, _ in sink.stored for bh, _ in blocks}
    assert shared_blocks and shared_blocks <= stored_first
    mark = len(sink.stored)
    _, t2 = await run(eng, greedy("sys-2", second, 4))
    assert t2["usage"]["cached_tokens"] >= shared > 100
    assert t1["usage"]["cached_tokens"] < 16
    assert not {bh for blocks, _, _ in sink.stored[mark:] for bh, _ in blocks} & shared_blocks


async def test_a_health_check_canary_between_two_chats_leaves_their_shared_prefix_cached(eng: LlamaCppEngine) -> None:
    """Locks: the worker's idle canary (token ids 1-4; 1 is SmolLM2's <|im_start|>, which every chat starts with) takes
    another slot instead of truncating the cached chat to its one shared token (every later chat recomputed its
    prompt when a canary ran in between: bench/engine_server.py's repeated-prefix outliers)."""
    system = SYSTEM + " " + " ".join(f"Rule {i}: be brief, be kind, be correct." for i in range(8))
    first = chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": "What is 2 + 2?"}])
    second = chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": "What is 3 + 3?"}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    await run(eng, greedy("chat-1", first, 2))
    await run(eng, greedy("canary", [1, 2, 3, 4], 1))
    _, end = await run(eng, greedy("chat-2", second, 2))
    assert end["usage"]["cached_tokens"] >= shared > 100


async def test_cancellation_frees_the_slot() -> None:
    """Locks: a stopped request ends "cancelled"; its only slot then serves the next request."""
    e = await engine("--n-seq-max", "1")
    try:
        req = greedy("long", question("Tell me a long story."), 500, stop={"max_tokens": 500, "ignore_eos": True})
        ctx = Context("long")
        it = e.generate(req, ctx)
        first = await anext(aiter(it))
        assert "finish_reason" not in first
        ctx.stop()
        rest = [c async for c in it]
        assert rest[-1]["finish_reason"] == "cancelled"
        sink = e.sink
        assert isinstance(sink, RecordingSink) and sink.loads[-1].running == 0
        tokens, term = await asyncio.wait_for(run(e, greedy("next", question("What is 2 + 2?"), 4)), 60)
        assert tokens and term["finish_reason"] in ("eos", "length")
    finally:
        await e.cleanup()


async def test_prefill_kv_moves_over_grpc_once_and_a_mismatched_layout_is_refused() -> None:
    """Locks: PullKv serves a prefill's KV once; the decode leg continues exactly like aggregated greedy;
    a worker with another KV layout (no flash attention) is refused with FailedPrecondition;
    unpulled KV is released after --kv-hold-timeout."""
    prefill = await engine("--n-seq-max", "2", "--kv-hold-timeout", "3")
    plane = PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NONE)
    config = WorkerConfig(engine="llamacpp", role=DisaggregationMode.PREFILL, plane=plane, static=True)
    worker = await Worker.start(prefill, config)
    decode = await engine("--n-seq-max", "2")
    other = await engine("--n-seq-max", "2", "--no-flash-attn")
    channels = ChannelCache()
    decode.kv_pull = other.kv_pull = peer_kv_pull(channels)  # as a worker gives its engine
    try:
        prompt = question("What is the capital of France?")
        client = WorkerClient(channels, worker.address)
        chunks = [c async for c in client.generate(greedy("p1", prompt, 12, disagg={"request_type": "context_only"}))]
        params = chunks[-1]["disagg"]
        assert chunks[-1]["finish_reason"] == "length" and params["kv_bytes"] > 100_000
        leg = {**params, "request_type": "generation_only", "prefill_address": worker.address}
        with pytest.raises(FailedPrecondition, match="KV layout mismatch"):
            await run(other, greedy("d0", prompt, 12, disagg=leg))
        tokens, term = await run(decode, greedy("d1", prompt, 12, disagg=leg))
        assert term["usage"]["completion_tokens"] == len(params["first_token_ids"]) + len(tokens)
        await decode.clear_kv_blocks()
        aggregated, _ = await run(decode, greedy("agg", prompt, 12))
        assert params["first_token_ids"] + tokens == aggregated
        with pytest.raises(NotFound):
            await run(decode, greedy("d2", prompt, 12, disagg=leg))  # served once
        expired = asyncio.Event()
        prefill.holds.on_expire = lambda handle: expired.set()
        [c async for c in client.generate(greedy("p2", prompt, 12, disagg={"request_type": "context_only"}))]
        assert len(prefill.holds) == 1
        await asyncio.wait_for(expired.wait(), 30)
        assert len(prefill.holds) == 0
    finally:
        await channels.aclose()
        await worker.aclose()
        await decode.cleanup()
        await other.cleanup()


async def test_logprobs_describe_the_greedy_choice(eng: LlamaCppEngine) -> None:
    """Locks: output.logprobs gives one entry per token: the greedy token is the likeliest, top-N sorted, log-probs <= 0."""
    chunks = [c async for c in eng.generate(greedy("lp", question("What is 2 + 2?"), 6, output={"logprobs": 3}), Context("lp"))]
    tokens = [t for c in chunks for t in c.get("token_ids", ())]
    entries = [lp for c in chunks for lp in c.get("logprobs", ())]
    assert [e["token_id"] for e in entries] == tokens
    for e in entries:
        top = e["top"]
        assert len(top) == 3 and top[0][0] == e["token_id"] and abs(top[0][1] - e["logprob"]) < 1e-6
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(top)) and e["logprob"] <= 0.0


async def test_logit_bias_bans_and_forces_tokens_and_an_id_beyond_the_vocabulary_is_refused(eng: LlamaCppEngine) -> None:
    """Locks: logit_bias reaches llama.cpp's sampler: -100 on the greedy first token changes it, +100 on a token makes
    greedy decoding emit only that token; a token id past the model's vocabulary is an InvalidArgument, not a crash."""
    prompt = question("What is 2 + 2?")
    plain, _ = await run(eng, greedy("lb0", prompt, 4))
    banned, _ = await run(eng, greedy("lb1", prompt, 4, sampling={"temperature": 0.0, "logit_bias": {plain[0]: -100.0}}))
    assert banned[0] != plain[0]
    forced, end = await run(eng, greedy("lb2", prompt, 4, sampling={"temperature": 0.0, "logit_bias": {1000: 100.0}}))
    assert forced == [1000] * 4 and end["finish_reason"] == "length"
    n_vocab = eng._info.n_vocab  # what start() reported as EngineConfig.vocab_size
    with pytest.raises(InvalidArgument, match="not in the model's vocabulary"):
        await run(eng, greedy("lb3", prompt, 4, sampling={"temperature": 0.0, "logit_bias": {n_vocab: 1.0}}))
    after, _ = await run(eng, greedy("lb4", prompt, 4))
    assert after == plain  # the engine serves on


async def test_model_files_rebuild_the_gguf_tokenizer_and_template(eng: LlamaCppEngine) -> None:
    """Locks: GetModelFiles' files load as the same tokenizer, chat template and eos ids as the GGUF."""
    files = eng.model_files()
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    served = load_tokenizer(str(files["tokenizer.json"].parent))
    original = load_tokenizer(str(MODEL))
    text = "<|im_start|>user\nHéllo, wörld! 123<|im_end|>\n"
    assert served.encode(text) == original.encode(text)
    assert served.chat_template == original.chat_template and served.bos_token_id == original.bos_token_id
    assert set(original.eos_token_ids) <= set(served.eos_token_ids)
