"""A third-party engine living outside services/: it echoes its prompt, round and round.

Written only against the public contract (`meshllm.engine.base`, `meshllm.errors`),
as an engine author's own package would be; loaded as `--engine my_engine:MyEngine`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Self

from meshllm.engine.base import Context, EngineConfig, LLMEngine, TokenChunk, TokenRequest, terminal
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.errors import InvalidArgument


class MyEngine(LLMEngine):
    """Echoes the prompt cyclically: output i is prompt[i % len(prompt)]."""

    def __init__(self, model: str) -> None:
        self.model = model

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        ns = worker_arg_parser("my_engine").parse_args(list(argv))
        return cls(ns.model_name or "echo"), WorkerConfig.from_namespace(ns, engine="my_engine:MyEngine")

    async def start(self, worker_id: str) -> EngineConfig:
        return EngineConfig(model=self.model)

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        prompt = request["token_ids"]
        if not prompt:
            raise InvalidArgument("empty prompt", param="token_ids")
        stop = request.get("stop", {})
        stop_ids = set(stop.get("stop_token_ids", []))
        emitted: list[int] = []

        def usage() -> dict[str, int]:
            return {"prompt_tokens": len(prompt), "completion_tokens": len(emitted), "cached_tokens": 0}

        for i in range(stop.get("max_tokens") or 32):
            await asyncio.sleep(0)
            if context.is_stopped():
                yield terminal("cancelled", usage())  # type: ignore[arg-type]
                return
            token = prompt[i % len(prompt)]
            if token in stop_ids:
                yield terminal("stop", usage())  # type: ignore[arg-type]
                return
            emitted.append(token)
            yield {"token_ids": [token]}
        yield terminal("length", usage())  # type: ignore[arg-type]

    async def cleanup(self) -> None:
        pass
