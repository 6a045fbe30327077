"""`meshllm run --engine llamacpp` (SmolLM2-135M) through the unmodified `openai` SDK: the Responses API and
completions `echo` + `logprobs` (what lm-evaluation-harness's log-likelihood tasks send).

Prompt-token logprobs are checked against llama-cpp-python's own eval
logits on the same GGUF with the same attention kernel, within 1e-4
(tests/integration/test_llamacpp_prompt_logprobs.py explains the tolerance
and why create_completion(echo=True)'s `token_logprobs` are not the
reference).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from mesh_run import MeshRun
from openai import AsyncOpenAI
from test_llamacpp_support import MODEL, SYSTEM, require_model

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TEXT = "Question: What do bees make?\nAnswer: honey"
TOLERANCE = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[AsyncOpenAI]:
    with MeshRun.start("--engine", "llamacpp", "--workers", "1", "--", "--n-ctx", "512", "--n-seq-max", "2") as mesh:
        async with AsyncOpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c


async def model_of(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def test_responses_create_answers_paris_whole_and_streamed(client: AsyncOpenAI) -> None:
    model = await model_of(client)
    question = "What is the capital of France?"
    r = await client.responses.create(model=model, instructions=SYSTEM, input=question, temperature=0, max_output_tokens=24)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.usage is not None and r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 24
    stream = await client.responses.create(
        model=model, instructions=SYSTEM, input=question, temperature=0, max_output_tokens=24, stream=True
    )
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == events[-1].response.output_text == r.output_text  # type: ignore[union-attr]  # greedy: the same text


async def test_completions_echo_logprobs_equal_llama_cpp_pythons(client: AsyncOpenAI) -> None:
    import llama_cpp

    model = await model_of(client)
    r = await client.completions.create(model=model, prompt=TEXT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(TEXT) and choice.logprobs is not None
    lp: Any = choice.logprobs
    ref = llama_cpp.Llama(model_path=str(MODEL), logits_all=True, n_ctx=512, flash_attn=True, n_threads=1, verbose=False)
    ids = ref.tokenize(TEXT.encode(), add_bos=True)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[: len(ids)]) == TEXT
    ref.eval(ids)
    expected = llama_cpp.Llama.logits_to_logprobs(ref.scores[: len(ids)])
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - float(expected[pos - 1][ids[pos]])) < TOLERANCE, pos
        best = max(lp.top_logprobs[pos].values())  # the token itself and the likeliest alternative
        assert abs(best - float(expected[pos - 1].max())) < TOLERANCE
    # the last entry is the generated token, scored after the whole prompt
    assert abs(lp.token_logprobs[-1] - float(expected[-1].max())) < TOLERANCE
    # vLLM's prompt_logprobs agree with the echo
    r2 = await client.completions.create(model=model, prompt=TEXT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    plp = r2.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert plp[0] is None and [next(iter(p.values()))["logprob"] for p in plp[1:]] == lp.token_logprobs[1 : len(ids)]


async def test_embeddings_equal_llama_cpp_pythons_mean_pooled_vectors(client: AsyncOpenAI) -> None:
    """Locks: the SDK's embeddings (base64 by default, and float) equal llama-cpp-python's `embed(normalize=True)`
    with mean pooling on the same GGUF (same kernels: within 1e-5 per component)."""
    import llama_cpp
    import numpy as np

    model = await model_of(client)
    texts = ["The capital of France is Paris.", "Bees make honey."]
    r = await client.embeddings.create(model=model, input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == r.usage.total_tokens > 0
    floats = await client.embeddings.create(model=model, input=texts[1], encoding_format="float")
    ref = llama_cpp.Llama(
        model_path=str(MODEL), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=512,
        flash_attn=True, n_threads=1, verbose=False,
    )  # fmt: skip
    expected = [np.asarray(ref.embed(t, normalize=True)) for t in texts]
    for got, want in zip(
        [r.data[0].embedding, r.data[1].embedding, floats.data[0].embedding], [*expected, expected[1]], strict=True
    ):
        assert len(got) == len(want) and float(np.abs(np.asarray(got) - want).max()) < 1e-5
    assert abs(float(np.linalg.norm(floats.data[0].embedding)) - 1.0) < 1e-5
