"""The event-loop side of a llama.cpp request: validated into a `Sequence`, its tokens as they arrive, its commands.

`new_sequence` checks a request against the model (vocabulary, context) and
builds the engine thread's `Sequence`; `Stream` is where the engine thread's
deliveries wait for the consumer (merged while it is busy); `add_command` and
`cancel_command` are what the event loop submits to the engine thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from meshllm.engine.llamacpp.config import LlamaCppConfig
from meshllm.engine.llamacpp.sampling import SamplingSpec
from meshllm.engine.llamacpp.scheduler import Scheduler, validate_length
from meshllm.engine.llamacpp.sequence import Finish, Output, Sequence
from meshllm.errors import InvalidArgument
from meshllm.protocol.types import LogprobItem, TokenChunk, TokenRequest

__all__ = ["Stream", "add_command", "cancel_command", "logprobs_asked", "new_sequence"]


class Stream:
    """The event-loop end of one sequence: tokens and the finish delivered by the engine thread."""

    __slots__ = ("finish", "logprobs", "prompt_logprobs", "tokens", "waiter")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[LogprobItem] = []
        self.prompt_logprobs: list[LogprobItem] = []
        self.finish: Finish | None = None
        self.waiter: asyncio.Future[None] | None = None

    def push(
        self, tokens: list[int], logprobs: list[LogprobItem], finish: Finish | None, prompt_logprobs: list[LogprobItem]
    ) -> None:
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.prompt_logprobs.extend(prompt_logprobs)
        if finish is not None:
            self.finish = finish
        self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def take(self) -> TokenChunk:
        """The tokens (and logprobs, and the prompt's once) delivered since the last take, as a chunk."""
        chunk: TokenChunk = {"token_ids": self.tokens}
        self.tokens = []
        if self.logprobs:  # the (rarely asked) logprob lists are replaced only when they were filled
            chunk["logprobs"] = self.logprobs
            self.logprobs = []
        if self.prompt_logprobs:
            chunk["prompt_logprobs"] = self.prompt_logprobs
            self.prompt_logprobs = []
        return chunk


def new_sequence(request: TokenRequest, cfg: LlamaCppConfig, info: Any) -> Sequence:
    """Validate a request into a Sequence (InvalidArgument before any chunk); `info` is the model's (n_vocab, eog ids)."""
    prompt = list(request.get("token_ids") or ())
    if not prompt:
        raise InvalidArgument("token_ids must not be empty", param="token_ids")
    stop = request.get("stop") or {}
    disagg = request.get("disagg") or {}
    role = disagg.get("request_type")
    first = list(disagg.get("first_token_ids") or ()) if role == "generation_only" else []
    if role == "generation_only" and not first:
        raise InvalidArgument("a generation_only request needs disagg.first_token_ids", param="disagg")
    if any(not 0 <= t < info.n_vocab for t in (*prompt, *first)):
        raise InvalidArgument(f"token ids must be in [0, {info.n_vocab})", param="token_ids")
    max_tokens = validate_length(len(prompt), stop.get("max_tokens"), cfg.n_ctx)
    min_tokens = stop.get("min_tokens") or 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidArgument(f"min_tokens must be in [0, max_tokens], got {min_tokens}", param="min_tokens")
    return Sequence(
        request_id=request["request_id"],
        tokens=prompt + first,
        num_prompt=len(prompt),
        max_tokens=1 if role == "context_only" else max_tokens,
        sampling=SamplingSpec.from_options(request.get("sampling") or {}),
        min_tokens=min_tokens,
        stop_token_ids=frozenset(stop.get("stop_token_ids") or ()),
        eos_token_ids=frozenset(request.get("eos_token_ids") or ()) | info.eog_token_ids,
        ignore_eos=bool(stop.get("ignore_eos")),
        logprobs=logprobs_asked(request, "logprobs"),
        # a decode leg continues a prompt it never evaluated: its prefill leg returned the prompt logprobs
        prompt_logprobs=None if role == "generation_only" else logprobs_asked(request, "prompt_logprobs"),
        context_only=role == "context_only",
        remote_kv=role == "generation_only",
        prefill_cached_tokens=int(disagg.get("cached_tokens") or 0),
    )


def logprobs_asked(request: TokenRequest, key: Literal["logprobs", "prompt_logprobs"]) -> int | None:
    """Top alternatives asked per token (0 = only the token's own), None when `output.<key>` is not asked."""
    output = request.get("output") or {}
    if key not in output:
        return None
    n = int(output[key])
    if not 0 <= n <= 20:
        raise InvalidArgument(f"{key} must be in [0, 20], got {n}", param=key)
    return n


def add_command(seq: Sequence) -> Any:
    def add(sched: Scheduler) -> None:
        sched.add(seq)

    return add


def cancel_command(seq: Sequence) -> Any:
    def cancel(sched: Scheduler) -> list[Output]:
        out = sched.cancel(seq)
        return [out] if out is not None else []

    return cancel
