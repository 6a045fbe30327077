"""The official `openai` Python SDK against `meshllm run` (in-process: 2 mocker workers, embedded KV router).

Streaming and non-streaming chat and completions, n=2, stop strings, usage
(with include_usage in streams), logprobs fields when asked, models.list(),
and the SDK's typed errors for 4xx answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from meshllm.frontend.config import FrontendConfig
from meshllm.run import Mesh, RunConfig

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    config = RunConfig(
        workers=2, engine_args=("--speedup-ratio", "100", "--context-length", "4096"), frontend=FrontendConfig(http_port=0)
    )
    mesh = await Mesh.start(config)
    assert mesh.frontend is not None
    async with openai.AsyncOpenAI(base_url=f"{mesh.frontend.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    await mesh.aclose()


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == ["mocker"] and models[0].owned_by == "meshllm"


async def test_chat_non_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model="mocker", messages=[{"role": "user", "content": "Hello!"}], max_tokens=12)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens is not None


async def test_chat_streaming_with_include_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="mocker",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


async def test_completions_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model="mocker", prompt="Once upon a time", max_tokens=8, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text and r.usage is not None and r.usage.completion_tokens == 8
    stream = await client.completions.create(model="mocker", prompt="Once upon a time", max_tokens=8, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_n_two_gives_two_indexed_choices(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model="mocker", messages=[{"role": "user", "content": "hi"}], max_tokens=10, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage is not None and r.usage.completion_tokens == 20
    stream = await client.completions.create(model="mocker", prompt="hi", max_tokens=5, n=2, stream=True)
    assert {c.choices[0].index async for c in stream} == {0, 1}


async def test_stop_strings_cut_the_output(client: openai.AsyncOpenAI) -> None:
    """Locks: with a stop string taken from the unconstrained output, the output ends right before it."""
    kw = {
        "model": "mocker",
        "prompt": "same prompt, same seed",
        "max_tokens": 30,
        "seed": 7,
        "extra_body": {"ignore_eos": True},
    }
    full = (await client.completions.create(**kw)).choices[0].text  # type: ignore[call-overload]
    words = full.split()
    assert len(words) > 3
    stop = " " + words[2]
    expected = full[: full.index(stop)]
    cut = (await client.completions.create(**kw, stop=[stop])).choices[0]  # type: ignore[call-overload]
    assert cut.text == expected and cut.finish_reason == "stop"
    stream = await client.completions.create(**kw, stop=[stop], stream=True)  # type: ignore[call-overload]
    assert "".join([c.choices[0].text async for c in stream]) == expected


async def test_logprobs_fields_are_present_when_asked(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model="mocker", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    r2 = await client.completions.create(model="mocker", prompt="hi", max_tokens=4, logprobs=2)
    assert r2.choices[0].logprobs is not None and r2.choices[0].logprobs.tokens is not None
    r3 = await client.chat.completions.create(model="mocker", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r3.choices[0].logprobs is None


async def test_sdk_errors_for_bad_requests(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="mocker", messages=[{"role": "user", "content": "x"}], temperature=5)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="mocker", prompt="x" * 5000, max_tokens=4)
