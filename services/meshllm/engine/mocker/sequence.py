"""One request inside the mocker: its tokens, KV progress, sampler and stop rules."""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Sequence as Seq

import xxhash

from meshllm.protocol.kv import chain_hash, stored_blocks, tokens_hash
from meshllm.protocol.types import ChunkRelay, FinishReason

__all__ = ["CONTEXT_WINDOW", "Sequence", "SequenceStatus"]

CONTEXT_WINDOW = 8  # tokens the sampler looks back at
_TWO_64 = float(1 << 64)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request as the scheduler and block manager see it.

    `tokens` is prompt + output; `num_computed` of them have KV in the
    sequence's blocks (`block_table`). Each output token is drawn from a hash
    of the seed and the `CONTEXT_WINDOW` tokens before it — a deterministic
    "greedy model" — so a decode leg that starts after the prefill leg's
    first tokens (`delivered_from`), and a migrated request resent as prompt
    + tokens so far, continue exactly where an aggregated run would be. `block_hashes` holds the chained hash of every
    full block of `tokens` (only when prefix caching is on); it grows by one
    hash each time a block fills, never per token.
    """

    __slots__ = (
        "_block_size",
        "_seed",
        "_vocab",
        "banned",
        "block_hashes",
        "block_table",
        "context_only",
        "delivered_from",
        "eos_ids",
        "finish_reason",
        "hashing",
        "hold_id",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed",
        "num_prompt",
        "num_registered",
        "prefilled",
        "ready_at",
        "relay",
        "relay_error",
        "remote_kv",
        "request_id",
        "sent",
        "status",
        "stop_ids",
        "tokens",
        "waiter",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Seq[int],
        *,
        seed: int,
        vocab_size: int,
        block_size: int,
        max_tokens: int,
        min_tokens: int = 0,
        stop_token_ids: Seq[int] = (),
        eos_token_ids: Seq[int] = (),
        first_token_ids: Seq[int] = (),
        context_only: bool = False,
        hashing: bool = True,
    ) -> None:
        self.request_id = request_id
        self.tokens: list[int] = [*prompt, *first_token_ids]
        self.num_prompt = len(prompt)
        self.delivered_from = len(first_token_ids)  # output tokens another worker already streamed
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_ids = frozenset(stop_token_ids)
        self.eos_ids = frozenset(eos_token_ids)
        self.banned = self.stop_ids | self.eos_ids
        self.context_only = context_only
        self.remote_kv = bool(first_token_ids)  # the prompt's KV arrives by transfer, not prefill
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed = 0
        self.num_registered = 0  # leading full blocks already offered to the prefix cache
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1: not admitted yet)
        self.prefilled = False  # this admission's prefill (or transfer) is done: steps are decode
        self.ready_at = -1.0  # loop time when an in-flight KV transfer lands (-1: none)
        self.block_table: list[int] = []
        self.hashing = hashing
        self._block_size = block_size
        self.block_hashes: list[tuple[int, int]] = stored_blocks(self.tokens, block_size) if hashing else []
        self._vocab = vocab_size
        self._seed = seed & 0xFFFFFFFFFFFFFFFF
        self.waiter: asyncio.Future[None] | None = None
        self.sent = self.delivered_from  # output tokens handed to the consumer (or streamed before this leg)
        self.relay: ChunkRelay | None = None  # the consumer's Context.relay while it runs
        self.relay_error: Exception | None = None  # what the relay raised (the stream fails with it)
        self.hold_id = 0  # the engine's hold on a finished prefill leg's KV (0: none)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def generate_token(self) -> None:
        """Sample the next output token and apply the stop rules (sets `finish_reason` when done)."""
        ctx = self.tokens[-CONTEXT_WINDOW:]
        draw = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(ctx)}I", *ctx), self._seed) / _TWO_64
        tok = int(draw * self._vocab)
        n_out = len(self.tokens) - self.num_prompt + 1
        if tok in self.banned:
            if n_out < self.min_tokens:
                tok = self._unbanned(tok)
            elif tok in self.stop_ids:
                self.finish_reason = "stop"  # a stop token is not emitted
                return
            else:
                self._append(tok)
                self.finish_reason = "eos"
                return
        self._append(tok)
        if n_out >= self.max_tokens:
            self.finish_reason = "length"

    def finish(self, reason: FinishReason) -> None:
        """Mark the sequence finished (keeps an earlier reason) and wake its consumer."""
        self.status = SequenceStatus.FINISHED
        if self.finish_reason is None:
            self.finish_reason = reason
        self.notify()

    def notify(self) -> None:
        """New output or a new state: a running sequence's new tokens go to its relay, if it has one; anything
        else (no relay, finished, nothing new) wakes the consumer."""
        relay = self.relay
        if relay is not None and self.finish_reason is None and self.status is not SequenceStatus.FINISHED:
            fresh = self.take_output()
            if fresh:
                try:
                    relay({"token_ids": fresh})
                    return
                except Exception as exc:  # the consumer's bug fails its stream, not the engine's step loop
                    self.relay, self.relay_error = None, exc
        self.wake()

    def take_output(self, limit: int | None = None) -> list[int]:
        """The output tokens not handed to the consumer yet (none: empty; at most `limit`), now counted as handed."""
        start = self.num_prompt + self.sent
        fresh = self.tokens[start:] if limit is None else self.tokens[start : start + limit]
        self.sent += len(fresh)
        return fresh

    @property
    def unsent(self) -> int:
        """Output tokens not handed to the consumer yet."""
        return len(self.tokens) - self.num_prompt - self.sent

    def wake(self) -> None:
        """Wake the consumer waiting for new output, if any."""
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def reset_progress(self) -> None:
        """Forget computed KV (the blocks were freed): the next admission recomputes."""
        self.num_computed = 0
        self.num_registered = 0
        self.prefilled = False
        self.ready_at = -1.0
        self.remote_kv = False

    def _unbanned(self, tok: int) -> int:
        # Below min_tokens stop/EOS tokens are masked, as vLLM's min-tokens
        # logits processor does; a deterministic shift keeps one draw per token.
        for _ in range(len(self.banned) + 1):
            tok = (tok + 1) % self._vocab
            if tok not in self.banned:
                break
        return tok

    def _append(self, tok: int) -> None:
        tokens = self.tokens
        tokens.append(tok)
        bs = self._block_size
        if self.hashing and len(tokens) % bs == 0:
            parent = self.block_hashes[-1][0] if self.block_hashes else None
            th = tokens_hash(tokens[-bs:])
            self.block_hashes.append((chain_hash(parent, th), th))
