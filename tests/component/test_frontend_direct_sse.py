"""Streamed chat content events written where their tokens arrive (frontend/http/sse_direct.py), in-process.

One frontend + one echo worker (memory planes, real sessions on loopback, so
the worker's chunks reach the frontend's relay in the session reader). Locks:
the direct path is taken for a plain streamed chat and its byte stream is the
one the request's task writes without it (same events, same framing, same
order, UTF-8 split across tokens intact, stop strings held back); requests
with per-token extras (logprobs, n > 1, continuous usage) never take it; a
stream that ends early (stop string, max_tokens, client gone) ends cleanly.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from frontend_support import Mesh, chat, content_of, request, start_mesh

from meshllm.frontend.http import app as app_module
from meshllm.frontend.http.sse_direct import DirectSse
from meshllm.frontend.text.postprocess import Delta
from meshllm.protocol import chunks
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = "Grüße, 世界! 😀 naïve café, and a longer tail of plain ASCII words to stream"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, max_inflight=64)
    yield m
    await m.aclose()


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts DirectSse.take wrote itself (deltas it returned True for, with text)."""
    written: list[str] = []
    original = DirectSse.take

    def take(self: DirectSse, d: Delta) -> bool:
        ok = original(self, d)
        if ok and d.text:
            written.append(d.text)
        return ok

    monkeypatch.setattr(DirectSse, "take", take)
    return written


_ID = re.compile(rb'"id":"[^"]*"|"created":\d+')


def normalised(body: bytes) -> bytes:
    """The SSE body with the per-request id and creation time blanked (they differ between two requests)."""
    return _ID.sub(b"", body)


async def test_a_plain_stream_takes_the_direct_path_and_writes_the_same_bytes(
    mesh: Mesh, taken: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One chunk per engine step (`--no-coalesce`), so both runs stream the same events whatever the timing."""
    monkeypatch.setattr(chunks, "_coalescing", False)  # what set_coalescing(False) sets; restored after the test
    direct = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{TEXT}", stream=True))
    assert direct.status == 200
    assert content_of(direct.events()) == TEXT
    assert len(direct.events()) > len(TEXT) // 2  # one event per step (a multi-byte character waits for its bytes)
    assert len(taken) > len(TEXT) // 2  # most content events were written from the session reader
    monkeypatch.setattr(app_module, "direct_eligible", lambda req, c: False)
    taken.clear()
    chained = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{TEXT}", stream=True))
    assert taken == []
    assert normalised(direct.body) == normalised(chained.body)


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": True, "top_logprobs": 1},
        {"n": 2},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ],
)
async def test_per_token_extras_keep_the_request_task_path(mesh: Mesh, taken: list[str], extra: dict[str, Any]) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:some words here", stream=True, **extra))
    assert r.status == 200
    assert content_of(r.events()) == "some words here"
    assert taken == []


async def test_a_stop_string_ends_a_direct_stream_before_it(mesh: Mesh, taken: list[str]) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:alpha beta STOP gamma", stream=True, stop=["STOP"]))
    events = r.events()
    assert content_of(events) == "alpha beta "
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    assert events[-1] == "[DONE]"
    assert "".join(taken) in "alpha beta "


async def test_max_tokens_and_usage_end_a_direct_stream(mesh: Mesh, taken: list[str]) -> None:
    body = chat("ECHO:abcdefghijklmnop", stream=True, max_tokens=9, stream_options={"include_usage": True})
    r = await request(mesh.url, "/v1/chat/completions", body)
    events = r.events()
    assert content_of(events) == "abcdefghi"
    assert events[-2]["usage"]["completion_tokens"] == 9 and events[-2]["choices"] == []
    assert taken  # usage only at the end: the content events still go direct


async def test_a_client_that_leaves_mid_stream_stops_the_engine(mesh: Mesh, taken: list[str]) -> None:
    engine = mesh.engines[0]
    before = set(engine.stops)
    host, port = mesh.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = b'{"model":"echo","stream":true,"messages":[{"role":"user","content":"FOREVER"}]}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    seen = b""

    async def five_events() -> None:
        nonlocal seen
        while seen.count(b'"content":"a"') < 5:
            seen += await reader.read(4096)

    await asyncio.wait_for(five_events(), 10)
    writer.close()
    await wait_until(lambda: bool(set(engine.stops) - before), what="the engine saw the request stop")
    assert len(taken) >= 3
