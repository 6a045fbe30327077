"""`Scheduler`: continuous batching over llama.cpp sequence slots — admit, plan one batch, postprocess.

    step() = admit() → plan() → backend.decode(batch) → postprocess()

`admit` places waiting sequences FCFS into free slots, reusing the longest
cached prefix (`SlotTable.place`: in place with `seq_rm`, or `seq_cp` from
another slot first) or loading a decode leg's transferred KV
(`state_set`, then `pos_max == n_past - 1` is checked). `plan` builds one
batch of at most `n_batch` tokens: every decoding sequence's one token first,
then prompt chunks FCFS. `postprocess` samples after each sequence's last
evaluated token and applies the stop conditions. Finished and cancelled
sequences release their slot in the same step; with prefix caching the KV
stays as evictable cache, without it `seq_rm` clears it at once.

Lower tiers (`tiers.TierStore`, when configured): before a free slot's KV is
overwritten or truncated past whole blocks no other slot holds, its prefix
(trimmed to whole blocks) is saved with `state_get`; at admission, a prompt
whose deepest block match in a tier beats the slots' by more than
`min_copy_gain` tokens is restored instead — `state_set` into the LRU free
slot, then `seq_rm` down to the matched blocks — and reports those tokens as
cached. A blob that fails to load is dropped and the prompt is computed.

The scheduler calls llama.cpp only through `Backend`, so it runs unchanged
against a fake in unit tests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, Protocol

from meshllm.engine.base import LoadMetrics
from meshllm.engine.llamacpp.sampling import SamplingSpec
from meshllm.engine.llamacpp.sequence import Finish, Output, Sequence, SequenceStatus
from meshllm.engine.llamacpp.slots import KvEvent, Placement, Slot, SlotTable
from meshllm.engine.llamacpp.tiers import Hit, TierStore
from meshllm.errors import ContextLengthExceeded, FailedPrecondition, InvalidArgument, MeshError, Unknown
from meshllm.protocol.types import FinishReason, LogprobItem

__all__ = ["Backend", "BatchEntry", "Scheduler", "validate_length"]

log = logging.getLogger("meshllm.engine.llamacpp")

BatchEntry = tuple[int, int, int, bool]  # token, position, slot (llama seq id), wants logits


class Backend(Protocol):
    """The llama.cpp calls the scheduler needs (all made on the engine thread)."""

    def decode(self, entries: Seq[BatchEntry]) -> int: ...
    def new_sampler(self, spec: SamplingSpec, suppress: Seq[int]) -> Any: ...
    def unsuppress(self, sampler: Any) -> None: ...
    def accept(self, sampler: Any, tokens: Seq[int]) -> None: ...
    def sample(self, sampler: Any, index: int) -> int: ...
    def logprob(self, index: int, token: int, top_n: int) -> LogprobItem: ...
    def free_sampler(self, sampler: Any) -> None: ...
    def seq_rm(self, slot: int, p0: int, p1: int) -> bool: ...
    def seq_cp(self, src: int, dst: int) -> None: ...
    def pos_max(self, slot: int) -> int: ...
    def state_get(self, slot: int) -> bytes: ...
    def state_set(self, slot: int, data: bytes) -> int: ...
    def embed(self, tokens: Seq[int]) -> list[float]: ...


@dataclass(eq=False, slots=True)
class Scheduler:
    """Waiting and running sequences over a `SlotTable` (see the module docstring)."""

    backend: Backend
    slots: SlotTable
    _: KW_ONLY
    n_batch: int
    n_ctx: int
    min_copy_gain: int = 16
    tiers: TierStore | None = None
    waiting: deque[Sequence] = field(init=False, default_factory=deque)
    running: list[Sequence] = field(init=False, default_factory=list)
    steps: int = field(init=False, default=0)

    def has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and bool(self.slots.free()))

    # ------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> Output | None:
        """Stop `seq` wherever it is; its slot is free when this returns."""
        if seq.status is SequenceStatus.FINISHED:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        return self._finish(seq, [], "cancelled")

    def fail_all(self, error: MeshError) -> list[Output]:
        out = [self._finish(s, [], "error", error=error) for s in [*self.running, *self.waiting]]
        self.waiting.clear()
        return out

    def clear_cache(self) -> int:
        """Drop the KV of every free slot and every lower tier; how many cached blocks left each tier, summed."""
        before = self.slots.num_cached_blocks
        for slot in self.slots.free():
            if slot.tokens:
                self.backend.seq_rm(slot.index, -1, -1)
                self.slots.truncate(slot, 0)
        lower = self.tiers.clear() if self.tiers is not None else 0
        return before - self.slots.num_cached_blocks + lower

    def drain_events(self) -> list[KvEvent]:
        """Pending KV events of the slots (device tier) and of the lower tiers."""
        events = self.slots.drain_events()
        if self.tiers is not None:
            events += self.tiers.drain_events()
        return events

    def load(self) -> LoadMetrics:
        bs = self.slots.block_size
        active = sum(-(-s.n_past // bs) for s in self.running)
        queued = sum(s.pending for s in self.waiting if not s.remote_kv)
        queued += sum(s.pending for s in self.running if s.pending > 1)
        total = len(self.slots.slots) * (self.n_ctx // bs)
        tiers = self.tiers.usage() if self.tiers is not None else ()
        return LoadMetrics(active, total, len(self.waiting), len(self.running), queued_prefill_tokens=queued, tiers=tiers)

    # ------------------------------------------------------------ step
    def step(self) -> list[Output]:
        """Admit, run one batch, sample: what every touched sequence produced."""
        self.steps += 1
        outputs = self._admit()
        plan = self._plan()
        if not plan:
            return outputs
        entries = [e for _, batch, _ in plan for e in batch]
        rc = self.backend.decode(entries)
        if rc != 0:
            error = Unknown(f"llama_decode failed with status {rc} on a batch of {len(entries)} tokens")
            for seq, _, _ in plan:
                self.backend.seq_rm(seq.slot, seq.n_past, -1)  # whatever of this batch landed is not trusted
                outputs.append(self._finish(seq, [], "error", error=error))
            return outputs
        offset = 0
        for seq, batch, logits_at in plan:
            start = seq.n_past
            if seq.prompt_logprobs is not None:
                self._prompt_logprobs(seq, start, len(batch), offset)
            offset += len(batch)
            seq.n_past += len(batch)
            self.slots.extend(self.slots.slots[seq.slot], seq.tokens[start : seq.n_past])
            if logits_at is not None:
                token = self.backend.sample(seq.sampler, logits_at)
                lp = self.backend.logprob(logits_at, token, seq.logprobs) if seq.logprobs is not None else None
                out = self._next_token(seq, token, lp)
                if seq.prompt_lps:
                    out = replace(out, prompt_logprobs=seq.prompt_lps)
                    seq.prompt_lps = []
                outputs.append(out)
        return outputs

    def _prompt_logprobs(self, seq: Sequence, start: int, n: int, offset: int) -> None:
        """Logprobs of the prompt tokens this batch's logits predict: position p's logits score token p + 1."""
        assert seq.prompt_logprobs is not None
        for p in range(start, min(start + n, seq.num_prompt - 1)):
            seq.prompt_lps.append(self.backend.logprob(offset + p - start, seq.tokens[p + 1], seq.prompt_logprobs))

    def _admit(self) -> list[Output]:
        outputs: list[Output] = []
        while self.waiting:
            seq = self.waiting[0]
            prompt = seq.tokens[: seq.num_prompt]
            reusable = seq.kv_state is None and seq.prompt_logprobs is None  # cached positions have no logits
            placement = self.slots.place(seq.tokens if reusable else [], min_copy_gain=self.min_copy_gain)
            if placement is None:
                break
            self.waiting.popleft()
            pulled, seq.pulled_prefix = seq.pulled_prefix, None
            if pulled is not None and not (reusable and pulled[1] > placement.reuse + self.min_copy_gain):
                pulled = None  # the slots hold as much already (or the prompt needs logits everywhere)
            hit = self._tier_hit(seq.tokens, placement) if reusable and pulled is None else None
            if hit is not None and pulled is not None and hit.n_tokens >= pulled[1]:
                pulled = None
            try:
                if pulled is not None:
                    self._load_prefix(seq, pulled[0], pulled[1], "pulled")
                elif hit is not None:
                    self._restore(seq, hit)
                else:
                    self._place(seq, placement.target, placement.reuse, placement.source, prompt)
                seq.sampler = self.backend.new_sampler(seq.sampling, seq.suppressed_ids)
            except MeshError as exc:
                outputs.append(self._finish(seq, [], "error", error=exc))
                continue
            seq.suppressing = bool(seq.suppressed_ids)
            if seq.num_output:  # a decode leg's first tokens shape penalties and grammars
                self.backend.accept(seq.sampler, seq.tokens[seq.num_prompt :])
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return outputs

    def _place(self, seq: Sequence, slot: Slot, reuse: int, source: Slot | None, prompt: list[int]) -> None:
        self._spill(slot, 0 if source is not None or seq.kv_state is not None else reuse)
        self.slots.claim(slot)
        seq.slot = slot.index
        be = self.backend
        if source is not None:
            be.seq_cp(source.index, slot.index)  # whole stream (per-sequence streams copy only whole buffers)
            self.slots.copy(source, slot, reuse)
        else:
            self.slots.truncate(slot, reuse)
        be.seq_rm(slot.index, reuse, -1)
        seq.n_past = seq.num_cached = reuse
        if seq.kv_state is None:
            return
        data, seq.kv_state = seq.kv_state, None
        loaded = be.state_set(slot.index, data)
        if loaded <= 0 or be.pos_max(slot.index) != seq.num_prompt - 1:
            be.seq_rm(slot.index, -1, -1)
            raise FailedPrecondition(
                f"the transferred KV does not load ({loaded} of {len(data)} bytes read, last position "
                f"{be.pos_max(slot.index)}, expected {seq.num_prompt - 1})"
            )
        seq.n_past = seq.num_prompt
        self.slots.extend(slot, prompt)

    # ------------------------------------------------------------ lower tiers
    def _spill(self, slot: Slot, keep: int) -> None:
        """Save `slot`'s whole blocks to the lower tiers before its KV is cut to `keep` tokens, unless held elsewhere."""
        tiers, bs = self.tiers, self.slots.block_size
        if tiers is None or len(slot.blocks) <= keep // bs:
            return
        deepest = slot.blocks[-1][0]
        if self.slots.holders(deepest) > 1:  # another slot holds the same prefix; it spills when it goes
            return
        if tiers.covers(deepest):
            tiers.touch(deepest)
            return
        t0 = time.perf_counter()
        n = len(slot.blocks) * bs
        if len(slot.tokens) > n:  # the partial block goes anyway: the saved state holds whole blocks only
            self.backend.seq_rm(slot.index, n, -1)
            self.slots.truncate(slot, n)
        state = self.backend.state_get(slot.index)
        tiers.save(list(slot.tokens), list(slot.blocks), state, time.perf_counter() - t0)

    def _tier_hit(self, tokens: list[int], placement: Placement) -> Hit | None:
        """A lower-tier match worth restoring: longer than the slots' by more than `min_copy_gain` tokens."""
        if self.tiers is None or len(tokens) < 2:
            return None
        hit = self.tiers.lookup(tokens[: len(tokens) - 1])  # the last token is always computed
        if hit is None or hit.n_tokens - placement.reuse <= self.min_copy_gain:
            return None
        return hit

    def _restore(self, seq: Sequence, hit: Hit) -> None:
        """Load `hit`'s blob into the LRU free slot and keep its matched blocks; compute from scratch if it fails."""
        assert self.tiers is not None
        t0 = time.perf_counter()
        state = self.tiers.fetch(hit)
        self.tiers.touch(hit.blob.key)  # before the victim's spill, which may need room in the same tier
        fetched = time.perf_counter() - t0
        t1 = time.perf_counter()
        if state is None or not self._load_prefix(seq, state, hit.n_tokens, f"{hit.tier.name.lower()} tier"):
            if state is not None:
                self.tiers.discard(hit)
            return
        self.tiers.restored(hit, state, fetched + time.perf_counter() - t1)

    def _load_prefix(self, seq: Sequence, state: bytes | None, n: int, what: str) -> bool:
        """Load a prefix state into the LRU free slot and keep its first `n` tokens (False: computed from scratch)."""
        slot = self.slots.victim()
        assert slot is not None  # placement found a free slot
        self._spill(slot, 0)
        self.slots.claim(slot)
        seq.slot = slot.index
        self.slots.truncate(slot, 0)
        be = self.backend
        seq.n_past = seq.num_cached = 0
        be.seq_rm(slot.index, -1, -1)
        if state is None:
            return False
        loaded = be.state_set(slot.index, state)
        if loaded <= 0 or be.pos_max(slot.index) < n - 1:
            log.warning(
                "a %s prefix of %d tokens did not load (%d of %d bytes read); computing it instead", what, n, loaded, len(state)
            )
            be.seq_rm(slot.index, -1, -1)
            return False
        be.seq_rm(slot.index, n, -1)
        self.slots.extend(slot, seq.tokens[:n])
        seq.n_past = seq.num_cached = n
        return True

    def _plan(self) -> list[tuple[Sequence, list[BatchEntry], int | None]]:
        """One batch: decodes first, then prompt chunks FCFS, within `n_batch` tokens."""
        budget = self.n_batch
        plan: list[tuple[Sequence, list[BatchEntry], int | None]] = []
        index = 0
        for seq in sorted(self.running, key=lambda s: s.pending > 1):  # stable: FCFS within each kind
            if budget == 0:
                break
            n = min(seq.pending, budget)
            last = n == seq.pending
            end = seq.n_past + n - 1
            every = seq.prompt_logprobs is not None  # prompt logprobs: logits at every prompt position
            batch = [
                (seq.tokens[p], p, seq.slot, (last and p == end) or (every and p < seq.num_prompt - 1))
                for p in range(seq.n_past, seq.n_past + n)
            ]
            plan.append((seq, batch, index + n - 1 if last else None))
            index += n
            budget -= n
        return plan

    def _next_token(self, seq: Sequence, token: int, logprob: LogprobItem | None = None) -> Output:
        """Apply the stop conditions to a sampled token."""
        allowed = seq.num_output >= seq.min_tokens
        if allowed and token in seq.stop_token_ids:
            return self._finish(seq, [], "stop", stop_reason=str(token))
        seq.tokens.append(token)
        lps = [logprob] if logprob is not None else []
        if allowed and not seq.ignore_eos and token in seq.eos_token_ids:
            return self._finish(seq, [token], "eos", logprobs=lps)
        if seq.context_only or seq.num_output >= seq.max_tokens:
            return self._finish(seq, [token], "length", logprobs=lps)
        if seq.suppressing and seq.num_output >= seq.min_tokens:
            self.backend.unsuppress(seq.sampler)
            seq.suppressing = False
        return Output(seq, [token], logprobs=lps)

    def _finish(
        self,
        seq: Sequence,
        tokens: list[int],
        reason: FinishReason,
        *,
        stop_reason: str = "",
        error: MeshError | None = None,
        logprobs: list[LogprobItem] | None = None,
    ) -> Output:
        kv_state = None
        if seq.status is SequenceStatus.RUNNING:
            if seq.context_only and reason == "length":
                kv_state = self.backend.state_get(seq.slot)  # the prompt's KV: n_past == num_prompt here
            self._release(seq)
        elif seq.slot >= 0:  # failed while being placed
            self.slots.release(self.slots.slots[seq.slot])
        seq.status = SequenceStatus.FINISHED
        finish = Finish(reason, seq.usage(), stop_reason, error, kv_state)
        return Output(seq, tokens, finish, logprobs or [])

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.sampler is not None:
            self.backend.free_sampler(seq.sampler)
            seq.sampler = None
        slot = self.slots.slots[seq.slot]
        if not self.slots.caching:
            self.backend.seq_rm(slot.index, -1, -1)
            self.slots.truncate(slot, 0)
        self.slots.release(slot)


def validate_length(prompt_tokens: int, max_tokens: int | None, n_ctx: int) -> int:
    """The completion budget of a prompt in a context of `n_ctx` tokens (ContextLengthExceeded if none)."""
    room = n_ctx - prompt_tokens
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = prompt_tokens + (max_tokens or 1)
        raise ContextLengthExceeded(
            f"prompt ({prompt_tokens} tokens) + max_tokens needs {asked} tokens; the context of a sequence is {n_ctx}",
            param="max_tokens",
        )
    return max_tokens if max_tokens is not None else room
