"""Prompt logprobs through the frontend: completions `echo` + `logprobs`, vLLM's `prompt_logprobs`, `logprobs: 0`.

One frontend + one echo worker (memory planes, real gRPC and HTTP on
loopback). The echo engine gives every prompt token after the first a
logprob of -1.5 on its first chunk; a prompt with "NOPLP" plays an engine
that does not compute them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from frontend_support import Mesh, request, start_mesh

from meshllm.frontend.text.builtin_tokenizer import BYTE_OFFSET, EOS_ID

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, max_inflight=16)
    yield m
    await m.aclose()


async def test_prompt_logprobs_on_completions_follow_vllms_layout(mesh: Mesh) -> None:
    """Locks: a None first, then {token id: {logprob, rank, decoded_token}} with the prompt token and its alternatives."""
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:ab", "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status == 200, r.body
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == 1 + len("ECHO:ab") and plp[0] is None  # BOS first: nothing predicts it
    e_id = str(ord("E") + BYTE_OFFSET)
    assert plp[1] == {
        e_id: {"logprob": -1.5, "rank": 1, "decoded_token": "E"},
        str(EOS_ID): {"logprob": -4.0, "rank": 2, "decoded_token": "</s>"},
    }
    assert choice["text"] == "a" and choice["logprobs"] is None  # prompt_logprobs alone does not ask for logprobs


async def test_prompt_logprobs_on_chat_sit_at_the_top_level_and_in_the_first_streamed_chunk(mesh: Mesh) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "ECHO:hi"}], "prompt_logprobs": 0}
    r = await request(mesh.url, "/v1/chat/completions", body)
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and all(len(p) == 1 and next(iter(p.values()))["logprob"] == -1.5 for p in plp[1:])
    assert next(iter(plp[1].values()))["rank"] is None  # prompt_logprobs 0: no alternatives, so no rank known
    events = (await request(mesh.url, "/v1/chat/completions", {**body, "stream": True})).events()
    assert events[0]["prompt_logprobs"] == plp and all("prompt_logprobs" not in e for e in events[1:-1])


async def test_streamed_echo_carries_the_prompt_tokens_logprobs_in_its_first_event(mesh: Mesh) -> None:
    body = {"model": "echo", "prompt": "ECHO:xy", "logprobs": 0, "echo": True, "stream": True}
    events = [e["choices"][0] for e in (await request(mesh.url, "/v1/completions", body)).events()[:-1]]
    first = events[0]["logprobs"]
    assert events[0]["text"].startswith("ECHO:xy") and first["tokens"][:8] == ["<s>", *"ECHO:xy"]
    assert first["token_logprobs"][:8] == [None] + [-1.5] * 7 and first["text_offset"][0] == 0
    text = ""
    for e in events:  # every later event's offsets count the echoed prompt too
        if e["logprobs"] and e["logprobs"]["tokens"] and e is not events[0]:
            assert e["logprobs"]["text_offset"][0] == len(text), events
        text += e["text"]
    assert text == "ECHO:xyxy"


async def test_logprobs_zero_names_the_sampled_token(mesh: Mesh) -> None:
    """Locks: completions' top_logprobs start with the token itself, so `logprobs: 0` still names it (as vLLM)."""
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:ab", "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["a", "b"] and next(iter(lp["top_logprobs"][0].items())) == ("a", -0.25)


async def test_an_engine_without_prompt_logprobs_is_a_400_before_the_stream_starts(mesh: Mesh) -> None:
    for stream in (False, True):
        body = {"model": "echo", "prompt": "ECHO:NOPLP", "logprobs": 1, "echo": True, "stream": stream}
        r = await request(mesh.url, "/v1/completions", body)
        assert r.status == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        assert "does not compute prompt logprobs" in r.json()["error"]["message"]


@pytest.mark.parametrize("value", [21, -1, "2", True])
async def test_a_bad_prompt_logprobs_is_a_400_naming_it(mesh: Mesh, value: object) -> None:
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "x", "prompt_logprobs": value})
    assert r.status == 400 and r.json()["error"]["param"] == "prompt_logprobs"


async def test_chat_echo_with_logprobs_asks_for_no_prompt_logprobs(mesh: Mesh) -> None:
    """Locks: chat `echo` (vLLM: the assistant's last message opens the answer) is not completions' echo."""
    messages = [{"role": "user", "content": "ECHO:NOPLP ab"}, {"role": "assistant", "content": "Sure: "}]
    body = {"model": "echo", "messages": messages, "echo": True, "logprobs": True, "add_generation_prompt": False}
    r = await request(mesh.url, "/v1/chat/completions", {**body, "continue_final_message": True})
    assert r.status == 200, r.body
    assert "prompt_logprobs" not in mesh.engines[0].requests[-1]["output"]
