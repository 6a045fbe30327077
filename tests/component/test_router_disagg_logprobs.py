"""Disaggregated prefill → decode through RouterCore: what only the prefill leg computes reaches the client.

The prefill leg's terminal chunk carries the first token's logprobs and the
prompt's logprobs (the decode leg never evaluates the prompt); the router's
first chunk must forward both, or a disaggregated `echo` + `logprobs` request
would lose them. In-process mocker workers whose prefill leg adds scripted
logprobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from test_router_support import collect, mesh, mocker, request, tokens_of

from meshllm.engine.base import Context, TokenChunk, TokenRequest
from meshllm.engine.mocker import MockerEngine
from meshllm.protocol.types import LogprobItem


class ScriptedPrefill(MockerEngine):
    """A mocker whose context-only terminal chunk carries logprobs and prompt logprobs."""

    def __init__(self, engine: MockerEngine) -> None:
        super().__init__(engine.config)

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:  # type: ignore[override]
        async for chunk in super().generate(request, context):
            if "finish_reason" in chunk:
                chunk["logprobs"] = [LogprobItem(token_id=t, logprob=-0.5) for t in chunk["token_ids"]]
                chunk["prompt_logprobs"] = [LogprobItem(token_id=t, logprob=-2.0) for t in request["token_ids"][1:]]
            yield chunk


async def test_the_prefill_legs_logprobs_and_prompt_logprobs_ride_on_the_first_chunk() -> None:
    prompt = [(i * 31) % 30000 + 3 for i in range(200)]
    async with mesh() as m:
        await m.worker(ScriptedPrefill(mocker()), role="prefill", instance_id="prefill-1")
        await m.worker(mocker(), role="decode", instance_id="decode-1")
        core = await m.router()
        req = request("dis", prompt, max_tokens=6, model="mocker", output={"logprobs": 0, "prompt_logprobs": 0})
        chunks = await collect(core.generate(req))
    first = chunks[0]
    assert len(first["token_ids"]) == 1 and [e["token_id"] for e in first["logprobs"]] == first["token_ids"]
    assert [e["token_id"] for e in first["prompt_logprobs"]] == prompt[1:]
    assert all("prompt_logprobs" not in c for c in chunks[1:]) and len(tokens_of(chunks)) == 6
