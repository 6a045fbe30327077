"""Merging of stream chunks: what lets a slow reader take many tokens in one chunk.

A non-terminal chunk (no finish reason, no error, no DisaggInfo) may be
appended to the non-terminal chunk before it without changing what the
stream means: token ids and logprobs are concatenated and the newer usage
wins. Terminal chunks are never merged, so nothing is merged past one.
"""

from __future__ import annotations

from meshllm.protocol.types import TokenChunk

__all__ = ["merge_into", "mergeable"]


def mergeable(chunk: TokenChunk) -> bool:
    """Whether `chunk` may be merged with a neighbour (it carries tokens only)."""
    return "finish_reason" not in chunk and "error" not in chunk and "disagg" not in chunk


def merge_into(target: TokenChunk, chunk: TokenChunk) -> None:
    """Append `chunk`'s tokens (and logprobs) to `target`; the newer usage wins."""
    target["token_ids"] = [*target.get("token_ids", ()), *chunk.get("token_ids", ())]
    if "logprobs" in chunk or "logprobs" in target:
        target["logprobs"] = [*target.get("logprobs", ()), *chunk.get("logprobs", ())]
    if "usage" in chunk:
        target["usage"] = chunk["usage"]
