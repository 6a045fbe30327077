"""Merging of stream chunks: what lets a slow reader take many tokens in one chunk.

A non-terminal chunk (no finish reason, no error, no DisaggInfo) may be
appended to the non-terminal chunk before it without changing what the
stream means: token ids and logprobs are concatenated and the newer usage
wins. Terminal chunks are never merged, so nothing is merged past one.

Merging is a property of the process (`--no-coalesce`, `MESHLLM_NO_COALESCE=1`
on every command): with it off, nothing in the request plane merges, so every
engine step of every stream travels as its own item and becomes its own SSE
event. Comparisons at one event per token use it.
"""

from __future__ import annotations

from meshllm.protocol.types import TokenChunk

__all__ = ["coalescing", "merge_into", "mergeable", "set_coalescing"]

_coalescing = True


def set_coalescing(on: bool) -> None:
    """Whether this process merges a stream's chunks (set once at startup from `--no-coalesce`)."""
    global _coalescing
    _coalescing = on


def coalescing() -> bool:
    return _coalescing


def mergeable(chunk: TokenChunk) -> bool:
    """Whether `chunk` may be merged with a neighbour: it carries tokens only, and this process merges."""
    return _coalescing and "finish_reason" not in chunk and "error" not in chunk and "disagg" not in chunk


def merge_into(target: TokenChunk, chunk: TokenChunk) -> None:
    """Append `chunk`'s tokens (and logprobs) to `target`; the newer usage wins."""
    target["token_ids"] = [*target.get("token_ids", ()), *chunk.get("token_ids", ())]
    if "logprobs" in chunk or "logprobs" in target:
        target["logprobs"] = [*target.get("logprobs", ()), *chunk.get("logprobs", ())]
    if "usage" in chunk:
        target["usage"] = chunk["usage"]
