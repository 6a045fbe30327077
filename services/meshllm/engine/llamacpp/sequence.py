"""`Sequence` (one request inside the engine thread) and what a step hands back (`Output`, `Finish`).

A sequence's `tokens` are everything known (prompt, a decode leg's first
tokens, generated tokens); `n_past` of them are in its slot's KV. Every step
evaluates some of `tokens[n_past:]` (a prompt chunk, or the one token sampled
last step) and samples after the last of them. The event loop never reads a
sequence's mutable fields: what it needs travels in `Output` / `Finish`.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshllm.engine.llamacpp.sampling import SamplingSpec
from meshllm.errors import MeshError
from meshllm.protocol.types import FinishReason, LogprobItem, TokenUsage

__all__ = ["Finish", "Output", "Sequence", "SequenceStatus", "StreamSink"]

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class StreamSink(Protocol):
    """The event-loop side of one stream (called on the loop thread only)."""

    def push(
        self, tokens: list[int], logprobs: list[LogprobItem], finish: Finish | None, prompt_logprobs: list[LogprobItem]
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Finish:
    """How a sequence ended; `kv_state` is a prefill leg's exported KV (prompt tokens only)."""

    reason: FinishReason
    usage: TokenUsage
    stop_reason: str = ""
    error: MeshError | None = None
    kv_state: bytes | None = None


@dataclass(frozen=True, slots=True)
class Output:
    """What one step produced for one sequence: new tokens (with logprobs when asked), and its finish if it ended.

    `prompt_logprobs` rides on the output of the step that evaluated the prompt's last token (the first token's).
    """

    seq: Sequence
    tokens: list[int]
    finish: Finish | None = None
    logprobs: list[LogprobItem] = field(default_factory=list)
    prompt_logprobs: list[LogprobItem] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One request as the engine thread sees it."""

    request_id: str
    tokens: list[int]
    num_prompt: int
    max_tokens: int  # completion tokens, a decode leg's first tokens included
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()  # request eos ∪ the model's end-of-generation ids
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; None = no logprobs
    # Top alternatives per prompt token; None = no prompt logprobs. Set, the prompt is evaluated whole (no prefix
    # reuse: cached positions have no logits) with logits at every position.
    prompt_logprobs: int | None = None
    context_only: bool = False
    kv_state: bytes | None = None  # a decode leg's pulled KV, loaded (and dropped) at admission
    remote_kv: bool = False  # a decode leg: its prompt's KV came from a prefill worker
    # A prefill leg's prefix pulled from a peer's tier (`disagg.kv_source`): its state and the prompt tokens it
    # covers; loaded at admission instead of computing them (dropped there; a failed load computes them).
    pulled_prefix: tuple[bytes, int] | None = None
    prefill_cached_tokens: int = 0  # a decode leg's prefill reuse, reported in its usage
    stream: StreamSink | None = None
    # engine-thread state
    id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1
    n_past: int = 0
    num_cached: int = 0
    sampler: Any = None
    suppressing: bool = False
    prompt_lps: list[LogprobItem] = field(default_factory=list)  # prompt logprobs computed so far

    @property
    def num_output(self) -> int:
        """Completion tokens so far (a decode leg's first tokens count)."""
        return len(self.tokens) - self.num_prompt

    @property
    def pending(self) -> int:
        """Tokens known but not yet in the KV."""
        return len(self.tokens) - self.n_past

    @property
    def suppressed_ids(self) -> list[int]:
        """Tokens kept from being sampled until `min_tokens` (eos unless ignored, and stop tokens)."""
        if self.num_output >= self.min_tokens:
            return []
        ids: Iterable[int] = self.stop_token_ids if self.ignore_eos else self.stop_token_ids | self.eos_token_ids
        return sorted(ids)

    def usage(self) -> TokenUsage:
        cached = self.prefill_cached_tokens if self.remote_kv else self.num_cached
        return {"prompt_tokens": self.num_prompt, "completion_tokens": self.num_output, "cached_tokens": cached}
