"""Frontend API keys and safer HTTP defaults against real servers (issue 13).

One in-process frontend with API keys and one echo worker (memory planes, real
HTTP and gRPC on loopback): 401 / UNAUTHENTICATED for a missing or wrong key in
OpenAI's shape on both APIs, the official `openai` SDK with `api_key=`, open
health routes, per-key metrics; 415 for non-JSON bodies, a readable 413, and
slow clients (half a header, a trickled body) closed within the read timeouts
while normal requests are served.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import grpc
import httpx2
import openai
import orjson
import pytest
import pytest_asyncio
from frontend_support import Mesh, start_mesh

from meshllm.frontend.http.app import OpenAIApp
from meshllm.frontend.http.auth import ApiKeys, fingerprint
from meshllm.frontend.http.guard import MAX_HEADER_BYTES
from meshllm.frontend.http.server import HttpServer
from meshllm.testing.waiting import wait_until
from meshllm.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210xyz"
OPS = "sk-ops-scraper-0123456789ab"  # the key /metrics is scraped with (so alice's and bob's counts stay theirs)
KEYS = ApiKeys.parse([f"alice:{ALICE}", BOB, f"ops:{OPS}"], source="test")
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "ECHO:hi"}], "max_tokens": 8}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, api_keys=KEYS)
    yield m
    await m.aclose()


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def exchange(url: str, data: bytes, *, timeout_s: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection, read until the server closes (or `Connection: close` answers end)."""
    reader, writer = await asyncio.open_connection(*_addr(url))
    try:
        writer.write(data)
        async with asyncio.timeout(timeout_s):
            raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, *, key: str | None = None, content_type: str | None = "application/json") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    return head.encode() + b"\r\n" + body


def get(path: str, *, key: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{auth}\r\n".encode()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text `text` (0 when absent)."""
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    return 0.0


async def scrape(url: str) -> str:
    status, _, body = await exchange(url, get("/metrics", key=OPS))
    assert status == 200
    return body.decode()


# ---------------------------------------------------------------- API keys, HTTP


@pytest.mark.parametrize(
    ("key", "message"), [(None, "didn't provide an API key"), ("sk-wrong-0123456789abcdef", "Incorrect API key")]
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/v1/nope"])
async def test_a_missing_or_wrong_key_gets_openais_401(mesh: Mesh, key: str | None, message: str, path: str) -> None:
    data = post(path, orjson.dumps(CHAT), key=key) if path != "/v1/models" else get(path, key=key)
    status, headers, body = await exchange(mesh.url, data)
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    err = orjson.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["param"] is None
    assert message in err["message"] and "sk-" not in err["message"]


async def test_another_auth_scheme_is_a_missing_key(mesh: Mesh) -> None:
    data = f"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Basic {ALICE}\r\n\r\n".encode()
    status, _, body = await exchange(mesh.url, data)
    assert status == 401 and "didn't provide" in orjson.loads(body)["error"]["message"]


async def test_health_and_live_stay_open_and_per_key_counts_move(mesh: Mesh) -> None:
    for path in ("/health", "/live"):
        assert (await exchange(mesh.url, get(path)))[0] == 200
    before = await scrape(mesh.url)
    # A scheme in any case and a key id from the file, or a fingerprint for a key without one.
    status, _, body = await exchange(mesh.url, post("/v1/chat/completions", orjson.dumps(CHAT), key=ALICE))
    assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"] == "hi"
    data = get("/v1/models").replace(b"\r\n\r\n", f"\r\nauthorization: bearer {BOB}\r\n\r\n".encode())
    assert (await exchange(mesh.url, data))[0] == 200
    await exchange(mesh.url, get("/v1/models", key="sk-wrong-0123456789abcdef"))
    after = await scrape(mesh.url)
    bob = fingerprint(BOB.encode())
    name = "meshllm_frontend_api_key_requests_total"
    assert metric(after, name, key_id="alice", api="http") == metric(before, name, key_id="alice", api="http") + 1
    assert metric(after, name, key_id=bob, api="http") == metric(before, name, key_id=bob, api="http") + 1
    failures = "meshllm_frontend_auth_failures_total"
    assert metric(after, failures, api="http", reason="invalid") >= metric(before, failures, api="http", reason="invalid") + 1
    assert ALICE not in after and BOB not in after


async def test_metrics_need_a_key_by_default(mesh: Mesh) -> None:
    assert mesh.frontend.core is not None
    app = OpenAIApp(mesh.frontend.core, api_keys=KEYS)
    server = await HttpServer.start(app, "127.0.0.1", 0)
    try:
        assert (await exchange(server.url, get("/metrics")))[0] == 401
        assert (await exchange(server.url, get("/metrics", key=ALICE)))[0] == 200
        assert (await exchange(server.url, get("/health")))[0] == 200
    finally:
        await server.aclose()


async def test_the_openai_sdk_works_with_api_key_and_raises_authentication_error_without(mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key=ALICE, max_retries=0, timeout=30) as client:
        assert [m.id async for m in client.models.list()] == ["echo"]
        r = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "ECHO:sdk"}])
        assert r.choices[0].message.content == "sdk"
        stream = await client.completions.create(model="echo", prompt="ECHO:ok", stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == "ok"
    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="sk-nope-0000000000000000", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


# ---------------------------------------------------------------- API keys, gRPC


async def test_grpc_needs_the_key_in_metadata(mesh: Mesh) -> None:
    address = mesh.frontend.grpc_address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for metadata in ((), (("authorization", "Bearer sk-wrong-0123456789abcdef"),), (("authorization", ALICE),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in str(info.value.details())
            call = stub.Completion(inference_pb2.CompletionRequest(model="echo", prompt="ECHO:x"), metadata=metadata, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [c async for c in call]
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        before = await scrape(mesh.url)
        good = (("authorization", f"Bearer {ALICE}"),)
        models = await stub.ListModels(inference_pb2.ListModelsRequest(), metadata=good, timeout=10)
        assert [m.id for m in models.models] == ["echo"]
        chat = inference_pb2.ChatRequest(model="echo", messages=[inference_pb2.ChatMessage(role="user", content="ECHO:grpc")])
        chunks = [c async for c in stub.ChatCompletion(chat, metadata=good, timeout=10)]
        assert "".join(c.text for c in chunks) == "grpc"
    after = await scrape(mesh.url)
    name = "meshllm_frontend_api_key_requests_total"
    assert metric(after, name, key_id="alice", api="grpc") == metric(before, name, key_id="alice", api="grpc") + 2


# ---------------------------------------------------------------- content type and body size


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
async def test_a_body_that_is_not_json_gets_415(mesh: Mesh, content_type: str | None) -> None:
    """curl -d sends application/x-www-form-urlencoded: the answer says which header to add."""
    data = post("/v1/chat/completions", orjson.dumps(CHAT), key=ALICE, content_type=content_type)
    status, _, body = await exchange(mesh.url, data)
    err = orjson.loads(body)["error"]
    assert status == 415 and "application/json" in err["message"] and err["type"] == "invalid_request_error"
    assert ("sent no Content-Type" in err["message"]) == (content_type is None)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
async def test_json_with_parameters_or_in_any_case_is_accepted(mesh: Mesh, content_type: str) -> None:
    data = post("/v1/chat/completions", orjson.dumps(CHAT), key=ALICE, content_type=content_type)
    assert (await exchange(mesh.url, data))[0] == 200


async def test_a_body_over_the_limit_gets_a_readable_413(mesh: Mesh) -> None:
    """httpx2 (the openai SDK's HTTP client) sends the whole body before reading: it sees the 413, not a reset."""
    big = b'{"model": "echo", "prompt": "' + b"x" * (6 * 1024 * 1024) + b'"}'
    headers = {"authorization": f"Bearer {ALICE}", "content-type": "application/json"}
    async with httpx2.AsyncClient(timeout=30) as client:
        r = await client.post(f"{mesh.url}/v1/completions", content=big, headers=headers)
        assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked, found too large while reading
            for _ in range(6):
                yield b"x" * (1024 * 1024)

        r = await client.post(f"{mesh.url}/v1/completions", content=chunks(), headers=headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "BodyTooLarge"


# ---------------------------------------------------------------- slow clients


SLOW_S = 2.0  # the header and body timeouts of `strict`


@pytest_asyncio.fixture(loop_scope="module")
async def strict(mesh: Mesh) -> AsyncIterator[HttpServer]:
    """The mesh's core behind an HTTP server with SLOW_S header and body timeouts (and no keys)."""
    assert mesh.frontend.core is not None
    app = OpenAIApp(mesh.frontend.core, body_timeout_s=SLOW_S)
    server = await HttpServer.start(app, "127.0.0.1", 0, header_timeout_s=SLOW_S)
    yield server
    await server.aclose()


async def _slow_client(url: str, data: bytes, opened: list[float]) -> tuple[float, bytes]:
    """Open a connection, send `data` (never the rest), return how long the server kept it open and its answer."""
    reader, writer = await asyncio.open_connection(*_addr(url))
    t0 = time.monotonic()
    try:
        writer.write(data)
        await writer.drain()
        opened.append(t0)
        async with asyncio.timeout(20):
            raw = await reader.read()
        return time.monotonic() - t0, raw
    finally:
        writer.close()


async def test_200_slow_clients_are_closed_within_the_read_timeouts_while_others_are_served(strict: HttpServer) -> None:
    half_header = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Ty"
    half_body = post("/v1/chat/completions", orjson.dumps(CHAT))[:-10]
    kinds = [half_header] * 90 + [half_body] * 90 + [b""] * 20
    opened: list[float] = []
    slow = [asyncio.create_task(_slow_client(strict.url, data, opened)) for data in kinds]
    await wait_until(lambda: len(opened) == len(kinds), timeout_s=10, what="200 slow connections open")
    status, _, _ = await exchange(strict.url, post("/v1/chat/completions", orjson.dumps(CHAT)))
    held_meanwhile = sum(not t.done() for t in slow)
    assert status == 200 and held_meanwhile > 0  # served while slow clients held their connections
    while not all(t.done() for t in slow):  # and normal requests keep being answered
        assert (await exchange(strict.url, post("/v1/chat/completions", orjson.dumps(CHAT))))[0] == 200
    results = [t.result() for t in slow]
    took = sorted(t for t, _ in results)
    assert SLOW_S - 0.5 < took[0] and took[-1] < SLOW_S + 4.0, (took[:3], took[-3:])
    for data, (_, raw) in zip(kinds, results, strict=True):
        if data:
            assert raw.startswith(b"HTTP/1.1 408"), raw[:100]
            err = orjson.loads(raw.partition(b"\r\n\r\n")[2])["error"]
            assert err["code"] == "RequestTimeout" and "did not arrive" in err["message"]
        else:
            assert raw == b""  # a connection that asked nothing is closed without an answer


async def test_a_trickled_header_is_cut_at_the_header_timeout_and_an_oversized_one_gets_431(strict: HttpServer) -> None:
    reader, writer = await asyncio.open_connection(*_addr(strict.url))
    t0 = time.monotonic()
    writer.write(b"GET /live HTTP/1.1\r\n")
    raw = b""
    try:
        async with asyncio.timeout(10):
            while not raw:  # a header line every 100 ms: arriving bytes do not extend the header timeout
                writer.write(b"X-Slow: 1\r\n")
                try:
                    raw = await asyncio.wait_for(reader.read(1 << 16), timeout=0.1)
                except TimeoutError:
                    continue
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < SLOW_S + 3.0
    status, _, body = await exchange(strict.url, b"GET /live HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 10))
    assert status == 431 and orjson.loads(body)["error"]["code"] == "HeadersTooLarge"


async def test_a_frontend_on_every_interface_without_keys_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="meshllm.frontend"):
        open_mesh = await start_mesh(workers=0, http_host="0.0.0.0")
        await open_mesh.aclose()
    lines = [r.getMessage() for r in caplog.records if "without API keys" in r.getMessage()]
    assert len(lines) == 1 and "OpenAI HTTP API on 0.0.0.0:" in lines[0] and "Inference gRPC" not in lines[0]
