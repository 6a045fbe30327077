"""Support for the frontend component tests: a scripted echo engine, an in-process mesh, a tiny HTTP client.

The echo engine answers with the UTF-8 bytes of the text after the last
"ECHO:" in the prompt (up to the chat template's `<|im_end|>`), one byte
token per chunk — so multi-byte characters are always split across tokens —
then EOS (`output.prompt_logprobs` gets -1.5 per prompt token on the first chunk,
except for a prompt containing "NOPLP"). A prompt containing "FOREVER" streams "a" every 10 ms until the
request is stopped, recording when the engine saw the stop (or was closed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import orjson

from meshllm.bench.http import Connection, Endpoint
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig, ServerConfig
from meshllm.engine.base import Context, EngineConfig, LLMEngine, TokenChunk, TokenRequest, terminal
from meshllm.engine.worker_config import WorkerConfig
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.main import Frontend
from meshllm.frontend.text.builtin_tokenizer import BYTE_OFFSET, EOS_ID
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.protocol.types import LogprobItem
from meshllm.worker.runtime import Worker

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
CONTEXT_LENGTH = 512


def _text_of(ids: Sequence[int]) -> str:
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256).decode("utf-8", "replace")


class EchoEngine(LLMEngine):
    """Echoes the prompt's "ECHO:" text byte by byte (see the module docstring)."""

    supports_prompt_logprobs = True  # except for a "NOPLP" prompt, which plays an engine that leaves them out

    def __init__(self, model: str = "echo") -> None:
        self.model = model
        self.stops: dict[str, float] = {}  # request id -> when the engine saw its stop
        self.started: dict[str, float] = {}
        self.requests: list[TokenRequest] = []

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        return cls(), WorkerConfig(engine="echo", plane=PLANE, grace_period_s=0.0)

    async def start(self, worker_id: str) -> EngineConfig:
        return EngineConfig(
            model=self.model, tokenizer_source="builtin:mocker", context_length=CONTEXT_LENGTH, eos_token_ids=(EOS_ID,)
        )

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        prompt = _text_of(request["token_ids"])
        stop = request.get("stop", {})
        max_tokens = stop.get("max_tokens", 10_000)
        want_lp = "logprobs" in request.get("output", {})
        # prompt logprobs: -1.5 for every prompt token after the first, on the first chunk ("NOPLP": an engine without them)
        plp = request.get("output", {}).get("prompt_logprobs")
        if plp is not None and "NOPLP" not in prompt:
            first_extra = [
                LogprobItem(token_id=t, logprob=-1.5, top=[(t, -1.5), (EOS_ID, -4.0)][:plp]) for t in request["token_ids"][1:]
            ]
        else:
            first_extra = []
        self.started[context.id] = time.monotonic()
        n = 0
        usage = {"prompt_tokens": len(request["token_ids"]), "completion_tokens": 0, "cached_tokens": 3}
        if "FOREVER" in prompt:
            try:
                while not context.is_stopped():
                    await asyncio.sleep(0.01)
                    n += 1
                    yield {"token_ids": [ord("a") + BYTE_OFFSET]}
                yield terminal("cancelled", {**usage, "completion_tokens": n})  # type: ignore[typeddict-item]
            finally:  # stopped, or closed / cancelled by the worker when its caller went away
                self.stops[context.id] = time.monotonic()
            return
        text = prompt.rsplit("ECHO:", 1)[-1].split("<|im_end|>", 1)[0]
        for b in text.encode():
            await asyncio.sleep(0)
            if context.is_stopped():
                self.stops[context.id] = time.monotonic()
                yield terminal("cancelled", {**usage, "completion_tokens": n})  # type: ignore[typeddict-item]
                return
            if n >= max_tokens:
                yield terminal("length", {**usage, "completion_tokens": n})  # type: ignore[typeddict-item]
                return
            n += 1
            tid = b + BYTE_OFFSET
            chunk: TokenChunk = {"token_ids": [tid]}
            if want_lp:
                chunk["logprobs"] = [LogprobItem(token_id=tid, logprob=-0.25, top=[(tid, -0.25), (EOS_ID, -3.0)])]
            if first_extra:
                chunk["prompt_logprobs"], first_extra = first_extra, []
            yield chunk
        if n >= max_tokens:
            yield terminal("length", {**usage, "completion_tokens": n})  # type: ignore[typeddict-item]
        else:
            yield terminal("eos", {**usage, "completion_tokens": n + 1}, token_ids=[EOS_ID])  # type: ignore[typeddict-item]

    async def cleanup(self) -> None:
        pass


@dataclass
class Mesh:
    """Workers with echo engines and a frontend on memory planes, all in-process."""

    store: MemoryStore
    broker: MemoryBroker
    frontend: Frontend
    workers: list[Worker] = field(default_factory=list)
    engines: list[EchoEngine] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.frontend.url

    async def add_worker(self, model: str = "echo") -> Worker:
        engine = EchoEngine(model)
        worker = await Worker.start(
            engine,
            WorkerConfig(engine="echo", plane=PLANE, grace_period_s=0.0),
            memory_store=self.store,
            memory_broker=self.broker,
        )
        self.workers.append(worker)
        self.engines.append(engine)
        return worker

    async def aclose(self) -> None:
        await self.frontend.aclose()
        await asyncio.gather(*(w.aclose() for w in self.workers))


async def start_mesh(*, workers: int = 1, **frontend: Any) -> Mesh:
    store, broker = MemoryStore(), MemoryBroker()
    config = FrontendConfig(plane=PLANE, http_port=0, grpc=ServerConfig(port=0), router_mode="round-robin", **frontend)
    fe = await Frontend.start(config, memory_store=store, memory_broker=broker)
    mesh = Mesh(store, broker, fe)
    for _ in range(workers):
        await mesh.add_worker()
    assert fe.registry is not None
    if workers:
        await fe.registry.wait_for("echo", timeout_s=30)
    return mesh


# ---------------------------------------------------------------- HTTP


def chat(content: str, **extra: Any) -> dict[str, Any]:
    """A /v1/chat/completions body for the echo model: one user message, plus `extra` fields."""
    return {"model": "echo", "messages": [{"role": "user", "content": content}], **extra}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    def events(self) -> list[Any]:
        """The SSE payloads, decoded ([DONE] kept as the string)."""
        out: list[Any] = []
        for block in self.body.split(b"\n\n"):
            if block.startswith(b"data: "):
                data = block[6:]
                out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
        return out


async def request(url: str, path: str, body: bytes | Any, *, method: str = "POST") -> Reply:
    """One request on a fresh connection (body: raw bytes, or JSON-encoded)."""
    conn = Connection(Endpoint.parse(url))
    try:
        if method == "GET":
            reader, writer = await asyncio.open_connection(conn.endpoint.host, conn.endpoint.port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            raw = await reader.read()
            writer.close()
            head, _, rest = raw.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if headers.get("transfer-encoding") == "chunked":
                body_out, buf = b"", rest
                while buf:
                    size_s, _, buf = buf.partition(b"\r\n")
                    size = int(size_s, 16)
                    if not size:
                        break
                    body_out, buf = body_out + buf[:size], buf[size + 2 :]
                rest = body_out
            return Reply(int(lines[0].split()[1]), headers, rest)
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        resp = await conn.post(path.removeprefix("/v1"), data)
        return Reply(resp.status, resp.headers, await resp.read())
    finally:
        await conn.close()


def content_of(events: list[Any], index: int = 0) -> str:
    """Concatenated chat deltas (or completion texts) of one choice."""
    out = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", ()):
                if c["index"] == index:
                    out.append(c["delta"].get("content") or "" if "delta" in c else c["text"])
    return "".join(out)


async def wait_until(predicate: Any, *, timeout_s: float = 10.0, interval_s: float = 0.01) -> None:
    """Poll `predicate()` until true; fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
