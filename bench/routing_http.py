"""The shared-preamble documents through the OpenAI HTTP API of `meshllm run`, as a new user would send them.

Used by `bench/routing.py --http`. Per router mode: start
`python -m meshllm run --workers 4 --router-mode MODE -- --block-size 16
--num-gpu-blocks N --speedup-ratio 1` (mocker engine, built-in byte
tokenizer and ChatML template), then send chat requests one after another:
each one user message — a short instruction every request shares, one of 8
documents in random order, a question of its own. With the built-in
tokenizer one token is one byte, so `<|im_start|>user\\n` (17 tokens) alone
fills the first block and the instruction fills most of the second: every
prompt starts with the same ~2 blocks. Hit rate = Σ
`usage.prompt_tokens_details.cached_tokens` / Σ `usage.prompt_tokens`;
TTFT = first content delta (streamed, `stream_options.include_usage`).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Protocol

from harness.servers import ready_match, ready_url

from meshllm.bench.http import Connection, Endpoint
from meshllm.testing.processes import MeshllmProcess

__all__ = ["HttpDocs", "Sink", "http_docs", "run_http_mode"]

INSTRUCTION = "Summarise this:\n"  # 16 bytes: with the template's 17, the shared head is 2 blocks
OPEN, CLOSE = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"  # the built-in ChatML around one message
WORDS = ("ka", "lo", "mi", "ren", "to", "sa", "vel", "du", "ni", "ar", "be", "cor", "da", "el", "fi", "gan")


@dataclass(frozen=True, slots=True)
class HttpDocs:
    """The requests (chat message contents, in order) and what bounds their hit rate."""

    contents: list[str]
    doc_blocks: int
    prompt_blocks: float  # mean blocks of a rendered prompt
    ceiling: float  # hit rate with unbounded caches, counted in whole blocks as the engines cache
    describe: str


class Sink(Protocol):
    """Where a run's figures go (bench/routing.py's `Result`)."""

    prompt_tokens: int
    cached_tokens: int
    ttft_ms: list[float]
    e2e_ms: list[float]
    seconds: float


def http_docs(n: int, *, docs: int = 8, doc_blocks: int = 50, block_size: int = 16, seed: int = 0) -> HttpDocs:
    """`n` chat contents over `docs` documents sharing INSTRUCTION, random document order.

    A document (template head, instruction, text) is exactly `doc_blocks`
    blocks; each request adds a short question of its own (and the template's
    tail), so the part a request can reuse ends on a block boundary.
    """
    rng = random.Random(seed)

    def text(chars: int) -> str:
        out = ""
        while len(out) < chars:
            out += " " + "".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 4)))
        return out[:chars]

    doc_chars = doc_blocks * block_size - len((OPEN + INSTRUCTION).encode())
    bodies = [INSTRUCTION + text(doc_chars) for _ in range(docs)]
    contents: list[str] = []
    seen: set[int] = set()
    reusable = total = 0
    head_blocks = len((OPEN + INSTRUCTION).encode()) // block_size
    for i in range(n):
        d = rng.randrange(docs)
        content = f"{bodies[d]}\nQ{i}?"
        contents.append(content)
        tokens = len((OPEN + content + CLOSE).encode())
        total += tokens
        if d in seen:
            reusable += doc_blocks * block_size
        elif seen:
            reusable += head_blocks * block_size
        seen.add(d)
    blocks = total / n / block_size
    return HttpDocs(
        contents=contents,
        doc_blocks=doc_blocks,
        prompt_blocks=blocks,
        ceiling=reusable / total,
        describe=(
            f"{n} chat requests over {docs} documents of {doc_blocks} blocks (built-in byte tokenizer and ChatML "
            f"template: one token per byte) that all start with the same {head_blocks} blocks (the template's "
            f"`<|im_start|>user\\n` and a {len(INSTRUCTION)}-byte instruction), random document order, "
            f"each + a question of its own (~{blocks:.1f} blocks a prompt with the template's tail), 8 output tokens, "
            "sent one after another through `meshllm run`'s OpenAI HTTP API"
        ),
    )


async def run_http_mode(
    mode: str,
    docs: HttpDocs,
    result: Sink,
    *,
    workers: int,
    block_size: int,
    num_gpu_blocks: int,
    speedup_ratio: float,
    context_length: int = 1024,
) -> None:
    """Start a fresh `meshllm run` routed by `mode`, send every request of `docs` in order into `result`, stop it."""
    proc = MeshllmProcess(
        "run", "--workers", str(workers), "--router-mode", mode, "--http-port", "0", "--",
        "--block-size", str(block_size), "--num-gpu-blocks", str(num_gpu_blocks),
        "--speedup-ratio", f"{speedup_ratio:g}", "--context-length", str(context_length),
    )  # fmt: skip
    try:
        url = await ready_url(proc)
        model = (await ready_match(proc, r'"model": "([^"]+)"'))[1]  # from its `try: curl ...` line
        conn = Connection(Endpoint.parse(f"{url}/v1"))
        start = time.monotonic()
        try:
            for content in docs.contents:
                await _chat(conn, model, content, result)
        finally:
            await conn.close()
        result.seconds = time.monotonic() - start
    finally:
        await proc.stop()


async def _chat(conn: Connection, model: str, content: str, result: Sink) -> None:
    body = {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    t0 = time.monotonic()
    first = None
    resp = await conn.post("/chat/completions", json.dumps(body).encode())
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
    async for data in resp.events():
        if data == b"[DONE]":
            continue
        event = json.loads(data)
        if first is None and any(ch.get("delta", {}).get("content") for ch in event.get("choices", [])):
            first = time.monotonic()
        usage = event.get("usage")
        if usage:
            result.prompt_tokens += usage["prompt_tokens"]
            result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    end = time.monotonic()
    result.ttft_ms.append(((first or end) - t0) * 1000)
    result.e2e_ms.append((end - t0) * 1000)
