"""Debug validator (`MESHLLM_VALIDATE_STREAMS=1`): checks an engine stream against the contract.

A broken clause fails the stream with `StreamIncomplete` / `Unknown` whose
message names the clause, so engine authors see exactly what they broke.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from meshllm.engine.base import Context
from meshllm.errors import StreamIncomplete, Unknown
from meshllm.protocol.types import FINISH_REASONS, TokenChunk, TokenRequest

__all__ = ["validate_stream"]


async def validate_stream(
    stream: AsyncIterator[TokenChunk], request: TokenRequest, context: Context
) -> AsyncIterator[TokenChunk]:
    """Yield the engine's chunks, failing on the first broken contract clause."""
    emitted = 0
    terminal: TokenChunk | None = None
    max_tokens = request.get("stop", {}).get("max_tokens")
    async for chunk in stream:
        if terminal is not None:
            raise Unknown("contract clause 'nothing after the terminal' broken: a chunk followed the terminal chunk")
        if not isinstance(chunk, dict):
            raise Unknown(f"contract clause 'chunks are TokenChunk dicts' broken: got {type(chunk).__name__}")
        emitted += len(chunk.get("token_ids", ()))
        if max_tokens is not None and emitted > max_tokens:
            raise Unknown(f"contract clause 'max_tokens' broken: {emitted} tokens emitted, max_tokens={max_tokens}")
        reason = chunk.get("finish_reason")
        if reason is not None:
            if reason not in FINISH_REASONS:
                raise Unknown(f"contract clause 'finish_reason' broken: unknown reason {reason!r}")
            if "usage" not in chunk:
                raise Unknown("contract clause 'terminal carries usage' broken: terminal chunk without usage")
            terminal = chunk  # held back until the engine's stream is exhausted
            continue
        yield chunk
    if terminal is not None:
        yield terminal
    else:
        if context.is_stopped():
            raise StreamIncomplete("contract clause 'cancelled terminal after stop' broken: stream ended without a terminal")
        raise StreamIncomplete("contract clause 'exactly one terminal chunk' broken: stream ended without a terminal")
