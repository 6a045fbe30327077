"""Fuzz: 1,000+ generated HTTP requests against a real frontend over real HTTP.

A mocker worker and a frontend run in-process on memory planes, with real
HTTP and gRPC on loopback (tests/faults/fuzz_support.py). hypothesis builds
request bodies that are mostly valid chat/completions requests with some
fields replaced by boundary values (2^31, 2^64, -1, huge floats, ...) or
arbitrary JSON, plus raw garbage bodies and odd paths and methods.

Locks: no response has a status >= 500 (every bad input is a 4xx with an
OpenAI-shaped error body); a 200 from a generation endpoint is a whole
answer (a JSON body with choices, or an event stream of JSON chunks that ends
with `[DONE]` and carries no in-band error event: a request refused after its
first event would pass a status check alone); no traceback is logged twice for
the same error, and afterwards the frontend is healthy and serves a normal
request.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshllm.testing.minimesh import MODEL, MiniMesh

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_support import Loop, TracebackLog, fuzz_settings

pytestmark = pytest.mark.timeout(120)

EXAMPLES = 1000

INTS = st.sampled_from([-(2**64), -(2**63) - 1, -(2**31) - 1, -2, -1, 0, 1, 2, 20, 21, 128, 129, 2047, 2048,
                        2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30])  # fmt: skip
FLOATS = st.sampled_from([-0.0, 0.0, 1e-45, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -2.0000001, 1e38, 3.5e38, 1e308, -1e308])
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
VALUE = st.one_of(INTS, FLOATS, JSON)
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p",
    "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "tools", "chat_template_kwargs",
    "add_generation_prompt", "response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
    "request_id", "skip_special_tokens", "tool_choice", "parallel_tool_calls", "structured_outputs",
    "continue_final_message", "user", "x_unknown",
]  # fmt: skip
TEMPLATE_KWARGS = st.dictionaries(
    st.sampled_from(["add_generation_prompt", "tools", "messages", "bos_token", "documents", "enable_thinking", "x"]),
    VALUE,
    max_size=3,
)
TEXT = st.text(max_size=40)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": TEXT | VALUE}
)
OVERRIDES = (
    st.dictionaries(
        st.sampled_from(FIELDS),
        VALUE,
        max_size=4,
    )
    | st.fixed_dictionaries({"chat_template_kwargs": TEMPLATE_KWARGS})
    | st.fixed_dictionaries({"model": st.text(min_size=1000, max_size=30_000)})
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(method, path, body): mostly a chat or completion request with a few fields replaced."""
    kind = draw(st.sampled_from(["chat", "chat", "completion", "completion", "raw", "path"]))
    if kind == "raw":
        return "POST", draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"])), draw(st.binary(max_size=200))
    if kind == "path":
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
        path = draw(
            st.sampled_from(
                ["/v1/chat/completions", "/v1/models", "/health", "/v1/x", "/", "/%00", "//v1/completions"]
                + ["/v1/models/mocker", "/v1/models/a/b", "/v1/tokenize", "/detokenize"]
            )
        )
        return method, path, b"{}"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8}
    if kind == "chat":
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=3))
        path = "/v1/chat/completions"
    else:
        body["prompt"] = draw(TEXT | st.lists(st.integers(min_value=0, max_value=40000), min_size=1, max_size=20))
        path = "/v1/completions"
    body.update(draw(OVERRIDES))
    if draw(st.booleans()):
        body["stream"] = True
    return "POST", path, json.dumps(body, allow_nan=True).encode()


async def http(url: str, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a fresh connection: (status, raw response)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    status_line = raw.split(b"\r\n", 1)[0].split()
    return int(status_line[1]), raw


def dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body, decoded (a malformed framing fails the test)."""
    out, rest = bytearray(), body
    while True:
        size_line, sep, rest = rest.partition(b"\r\n")
        assert sep, f"unterminated chunk framing: {body[-200:]!r}"
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n", f"bad chunk framing: {body[-200:]!r}"
        rest = rest[size + 2 :]


def check_answer(raw: bytes) -> None:
    """A 200 from /v1/chat/completions or /v1/completions holds a whole answer and no error."""
    head, _, body = raw.partition(b"\r\n\r\n")
    headers = head.lower()
    if b"transfer-encoding: chunked" in headers:
        body = dechunk(body)
    if b"content-type: text/event-stream" not in headers:
        answer = json.loads(body)
        assert "error" not in answer and answer["choices"], answer
        return
    events = [line[len(b"data: ") :] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", f"stream without [DONE]: {body[-300:]!r}"
    for data in events[:-1]:
        chunk = json.loads(data)
        assert "error" not in chunk, f"200 stream carried an error event: {data[:400]!r}"
        assert chunk["object"] in ("chat.completion.chunk", "text_completion"), chunk


STATUSES: dict[int, int] = {}
STREAMS_READ: dict[str, int] = {"stream": 0, "json": 0}


@fuzz_settings(EXAMPLES)
@given(req=requests())
def test_no_request_gets_a_5xx(loop: Loop, fuzz_mesh: MiniMesh, tracebacks: TracebackLog, req: tuple[str, str, bytes]) -> None:
    method, path, body = req
    status, raw = loop.run(http(fuzz_mesh.frontend.url, method, path, body))
    STATUSES[status] = STATUSES.get(status, 0) + 1
    assert status < 500, f"{method} {path} {body[:300]!r} -> {raw[:600]!r}"
    generation = path in ("/v1/chat/completions", "/v1/completions") and method == "POST"
    if 400 <= status < 500 and generation:
        error = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["message"] and error["type"] and len(error["message"]) <= 600
    if status == 200 and generation:
        check_answer(raw)
        STREAMS_READ["stream" if b"text/event-stream" in raw.partition(b"\r\n\r\n")[0].lower() else "json"] += 1


def test_the_frontend_is_healthy_afterwards_and_logged_each_traceback_at_most_once(
    loop: Loop, fuzz_mesh: MiniMesh, tracebacks: TracebackLog
) -> None:
    assert sum(STATUSES.values()) >= EXAMPLES, STATUSES  # the fuzz above ran in this module
    assert STATUSES.get(200, 0) > 50 and sum(n for s, n in STATUSES.items() if 400 <= s < 500) > 200, STATUSES
    assert STREAMS_READ["stream"] > 10 and STREAMS_READ["json"] > 10, STREAMS_READ  # both kinds of answer were read
    status, _ = loop.run(http(fuzz_mesh.frontend.url, "GET", "/health", b""))
    assert status == 200
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    status, raw = loop.run(http(fuzz_mesh.frontend.url, "POST", "/v1/chat/completions", json.dumps(ok).encode()))
    assert status == 200, raw
    assert tracebacks.repeated() == []
