"""The frontend's HTTP API in-process: SSE framing, UTF-8 split across tokens, stop strings, n, usage, logprobs, errors.

One frontend + one echo worker per module (memory planes, real gRPC and HTTP
on loopback).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from frontend_support import Mesh, chat, content_of, request, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = "Grüße, 世界! 😀 naïve café"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, max_inflight=64)
    yield m
    await m.aclose()


async def test_stream_is_framed_like_openai_and_utf8_split_across_tokens_arrives_intact(mesh: Mesh) -> None:
    """Locks: `data: {...}\\n\\n` events, role first, finish last, [DONE]; every delta is whole UTF-8 text."""
    r = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{TEXT}", stream=True))
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.body.endswith(b"data: [DONE]\n\n") and r.body.startswith(b"data: {")
    events = r.events()
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0] for e in events[:-1]]
    assert deltas[0]["delta"]["role"] == "assistant" and all("role" not in d["delta"] for d in deltas[1:])
    assert all("\ufffd" not in (d["delta"].get("content") or "") for d in deltas)
    assert content_of(events) == TEXT
    assert deltas[-1]["finish_reason"] == "stop" and all(d["finish_reason"] is None for d in deltas[:-1])
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"} and len({e["id"] for e in events[:-1]}) == 1


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello STOP world", ["STOP"], "hello "),
        ("abxyqxyz tail", ["xyz"], "abxyq"),  # "xy" is held back, then released when "q" rules the match out
        ("naïve café STOP", ["é S", "zz"], "naïve caf"),  # a stop string that starts inside a split character
        ("no stop here", ["zz"], "no stop here"),
    ],
)
async def test_stop_strings_never_leak(mesh: Mesh, text: str, stops: list[str], expected: str) -> None:
    """Locks: the output ends before the stop string, none of it is ever streamed, finish_reason is stop."""
    r = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{text}", stream=True, stop=stops))
    events = r.events()
    streamed = content_of(events)
    assert streamed == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    r2 = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": f"ECHO:{text}", "stop": stops})
    assert r2.json()["choices"][0]["text"] == expected


async def test_non_streaming_chat_has_usage_with_cached_tokens(mesh: Mesh) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:hi there"))
    body = r.json()
    assert r.status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi there"}
    usage = body["usage"]
    assert usage["completion_tokens"] == len(b"hi there") + 1  # + the EOS token
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_every_response_gets_its_own_id(mesh: Mesh) -> None:
    """Ids come from a per-process random prefix and a counter: distinct per request, OpenAI-shaped per kind."""
    ids = [(await request(mesh.url, "/v1/chat/completions", chat("ECHO:x"))).json()["id"] for _ in range(20)]
    assert len(set(ids)) == 20 and all(i.startswith("chatcmpl-") for i in ids)
    done = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:x", "max_tokens": 2})
    assert done.json()["id"].startswith("cmpl-") and done.json()["id"] not in ids


async def test_n_fans_out_to_indexed_choices_and_include_usage_ends_the_stream(mesh: Mesh) -> None:
    """Locks: n=2 → two upstream requests, choices 0 and 1; the usage event has no choices and sums completions."""
    r = await request(
        mesh.url,
        "/v1/completions",
        {"model": "echo", "prompt": "ECHO:abc", "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = r.events()
    assert content_of(events, 0) == "abc" and content_of(events, 1) == "abc"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 8
    assert all(e["usage"] is None for e in events[:-2])
    assert {e["choices"][0]["index"] for e in events[:-2]} == {0, 1}


async def test_max_tokens_ends_with_length_and_logprobs_are_shaped(mesh: Mesh) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:abcdef", max_tokens=3, logprobs=True, top_logprobs=2))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "abc" and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b", "c"] and content[0]["logprob"] == -0.25
    assert len(content[0]["top_logprobs"]) == 2
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:xy", "logprobs": 1, "echo": True})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "ECHO:xyxy" and lp["tokens"] == ["<s>", *"ECHO:xyxy"]  # the prompt's BOS is a token too
    # echo + logprobs: the prompt's tokens first (the first without a logprob, as OpenAI and vLLM), then the generated
    assert lp["token_logprobs"] == [None] + [-1.5] * 7 + [-0.25, -0.25] and lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"E": -1.5} and lp["top_logprobs"][-1] == {"y": -0.25, "</s>": -3.0}


async def test_completion_prompts_as_token_ids_and_lists(mesh: Mesh) -> None:
    ids = [b + 3 for b in b"ECHO:ok"]
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": ids})
    assert r.json()["choices"][0]["text"] == "ok"
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": ["ECHO:a", "ECHO:bb"]})
    assert [c["text"] for c in r.json()["choices"]] == ["a", "bb"]


async def test_models_health_live_and_metrics(mesh: Mesh) -> None:
    models = (await request(mesh.url, "/v1/models", None, method="GET")).json()
    assert [m["id"] for m in models["data"]] == ["echo"] and models["data"][0]["max_model_len"] == 512
    assert (await request(mesh.url, "/health", None, method="GET")).status == 200
    assert (await request(mesh.url, "/live", None, method="GET")).status == 200
    metrics = (await request(mesh.url, "/metrics", None, method="GET")).body.decode()
    for name in (
        "meshllm_frontend_requests_total",
        "meshllm_frontend_time_to_first_token_seconds",
        "meshllm_frontend_output_tokens_total",
    ):
        assert name in metrics


BIG = b'{"model": "echo", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'
BAD: list[tuple[str, Any, int, str | None]] = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", BIG, 413, None),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", chat("x", max_tokens=-5), 400, "max_tokens"),
    ("/v1/chat/completions", chat("x", temperature=5), 400, "temperature"),
    ("/v1/chat/completions", {"model": "echo", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": 7, "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/chat/completions", chat("x", n="two"), 400, "n"),
    ("/v1/chat/completions", chat("x", stop=[1, 2]), 400, "stop"),
    ("/v1/chat/completions", chat("x", top_p=-1), 400, "top_p"),
    ("/v1/chat/completions", chat("x", stream="yes"), 400, "stream"),
    ("/v1/chat/completions", chat("x", response_format={"type": "yaml"}), 400, "response_format"),
    ("/v1/chat/completions", chat("x" * 600), 400, "messages"),  # prompt over the 512-token context
    ("/v1/chat/completions", chat("x", max_tokens=500), 400, "max_tokens"),  # prompt + max_tokens over the context
    ("/v1/completions", {"model": "echo", "prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "echo", "prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"model": "echo", "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"model": "echo", "prompt": "x" * 600, "stream": True}, 400, "prompt"),
    ("/v1/nope", {}, 404, None),
    ("/v1/models", {}, 405, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{i}-{s}-{p}" for i, (_, _, s, p) in enumerate(BAD)])
async def test_bad_input_gets_its_4xx_with_an_openai_error_body_and_the_server_keeps_serving(
    mesh: Mesh, path: str, body: Any, status: int, param: str | None
) -> None:
    """Locks: status, OpenAI error shape (message/type/param/code), and a good request right after still works."""
    r = await request(mesh.url, path, body)
    assert r.status == status, r.body[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    ok = await request(mesh.url, "/v1/chat/completions", chat("ECHO:still here"))
    assert ok.json()["choices"][0]["message"]["content"] == "still here"
