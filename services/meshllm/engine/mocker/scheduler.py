"""The mocker's vLLM-style scheduler: continuous batching, chunked prefill, preemption by recompute.

Each step has a budget of `max_num_batched_tokens` new tokens. Running
sequences go first, in admission order: a decoding sequence takes one token,
a sequence still prefilling takes as much of its remaining prompt as the
budget allows (chunked prefill). When a running sequence needs a block and
none is free, the most recently admitted running sequence is preempted: its
blocks are freed (their full blocks stay in the prefix cache) and it goes
back to the *front* of the waiting queue, to be recomputed when readmitted.
Then, unless someone was preempted this step, waiting sequences are admitted
first come, first served while the budget, `max_num_seqs` and the KV
watermark allow; admission stops at the first one that does not fit, so no
one overtakes an earlier request.

A decode-leg sequence (its prompt's KV comes from a prefill worker) is
admitted like any other but charges no prefill: its blocks are allocated at
admission and it sits in `running` until its simulated transfer lands.

A sequence whose cached prefix reaches into a lower KV tier (host, disk) is
admitted with those blocks restored into the device cache and prefills the
rest of its prompt in the same step; the step carries the restore's model
time (`restore_ms(hit)`, `StepPlan.restore_ms`), as an engine that loads a
prefix before the forward pass that needs it (SGLang HiCache's load-back,
LMCache) does. Restored tokens count as cached. `stats` adds up, per first admission, the
prompt tokens and where their cached prefix came from, and every prefill
token computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from meshllm.engine.mocker.block_manager import BlockManager, PrefixHit
from meshllm.engine.mocker.sequence import Sequence, SequenceStatus

__all__ = ["CacheStats", "Scheduler", "StepPlan"]

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING


@dataclass(slots=True)
class StepPlan:
    """What one step computes: `counts[i]` new tokens of `seqs[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    prefill_tokens: int = 0  # new prompt (or recompute) tokens: what the prefill curve charges
    decode_seqs: int = 0
    restore_ms: float = 0.0  # model time of the lower-tier restores admitted this step


@dataclass(slots=True)
class CacheStats:
    """Prompt tokens seen and where their cached prefixes came from, counted at each sequence's first
    admission; `prefill_tokens` counts every prompt token computed (recomputes after preemption too)."""

    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    prefill_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """Cached prompt tokens, every tier."""
        return self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens


@dataclass(eq=False)
class Scheduler:
    """Waiting and running queues over one `BlockManager`."""

    blocks: BlockManager
    _: KW_ONLY
    max_num_seqs: int
    max_num_batched_tokens: int
    transfer_time: Callable[[int], float] = lambda tokens: 0.0  # seconds a decode leg's KV of n tokens takes to arrive
    restore_ms: Callable[[PrefixHit], float] = lambda hit: 0.0  # model ms to restore a hit's lower-tier blocks
    stats: CacheStats = field(init=False, default_factory=CacheStats)
    waiting: deque[Sequence] = field(init=False, default_factory=deque)
    running: list[Sequence] = field(init=False, default_factory=list)
    num_preemptions: int = field(init=False, default=0)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = _WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_ready_at(self) -> float | None:
        """The earliest pending KV transfer's landing time, if any."""
        pending = [s.ready_at for s in self.running if s.ready_at >= 0.0]
        return min(pending) if pending else None

    def abort(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is, free its blocks and finish it as cancelled."""
        if seq.status is _WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # never queued
        elif seq.status is _RUNNING:
            self.running.remove(seq)
            self.blocks.deallocate(seq)
        elif seq.block_table:  # finished but holding KV for a decode leg
            self.blocks.deallocate(seq)
        seq.finish("cancelled")

    # ------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan:
        """Choose this step's sequences and token counts, allocating their blocks."""
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        running, blocks = self.running, self.blocks
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.ready_at >= 0.0:
                if seq.ready_at > now:
                    i += 1
                    continue
                self._land_transfer(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not blocks.can_append(seq, n):
                preempted = True
                if not self._preempt_for(seq, n):
                    break  # seq itself was the last one and had to go
            blocks.append(seq, n)
            self._plan(plan, seq, n)
            budget -= n
            i += 1
        if not preempted:
            self._admit(plan, budget, now)
        return plan

    def postprocess(self, plan: StepPlan) -> list[Sequence]:
        """Record the computed tokens, sample the next ones; return sequences that finished holding KV."""
        blocks = self.blocks
        caching = blocks.prefix_caching
        bs = blocks.block_size
        finished = False
        held: list[Sequence] = []
        for seq, n in zip(plan.seqs, plan.counts, strict=True):
            if seq.status is not _RUNNING:
                continue  # aborted while the step ran
            seq.num_computed += n
            if caching and seq.num_computed >= (seq.num_registered + 1) * bs:
                blocks.register(seq)
            if seq.num_computed < len(seq.tokens):
                continue  # a chunk of a longer prefill
            seq.prefilled = True
            seq.generate_token()
            if seq.finish_reason is not None:
                finished = True
                seq.status = SequenceStatus.FINISHED
                if seq.context_only and seq.finish_reason == "length":
                    held.append(seq)  # the decode leg's KV: released by the engine
                else:
                    blocks.deallocate(seq)
            seq.notify()
        if finished:
            self.running = [s for s in self.running if s.status is _RUNNING]
        return held

    # ------------------------------------------------------------ helpers
    def _plan(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        plan.seqs.append(seq)
        plan.counts.append(n)
        if seq.prefilled:
            plan.decode_seqs += 1
        else:
            plan.prefill_tokens += n
            self.stats.prefill_tokens += n

    def _preempt_for(self, seq: Sequence, n: int) -> bool:
        """Preempt from the back of `running` until `seq` fits; False when `seq` itself was preempted."""
        running = self.running
        while True:
            victim = running.pop()
            self.blocks.deallocate(victim)
            victim.status = _WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
            if self.blocks.can_append(seq, n):
                return True

    def _land_transfer(self, seq: Sequence) -> None:
        seq.num_computed = seq.num_prompt
        seq.ready_at = -1.0
        seq.prefilled = True
        self.blocks.register(seq)

    def _admit(self, plan: StepPlan, budget: int, now: float) -> None:
        waiting, running, blocks = self.waiting, self.running, self.blocks
        bs = blocks.block_size
        while waiting and len(running) < self.max_num_seqs:
            seq = waiting[0]
            remote = seq.remote_kv
            # At least one token is always computed, so a fully cached prompt still samples.
            hit = blocks.cached_prefix(seq, seq.num_prompt if remote else seq.num_tokens - 1, lower=not remote)
            cached = hit.blocks * bs
            if remote:
                n = seq.num_prompt - cached  # arrives by transfer: no budget
            elif budget > 0:
                n = min(seq.num_tokens - cached, budget)
            else:
                break
            if not blocks.can_allocate(hit, n):
                break
            waiting.popleft()
            blocks.allocate(seq, hit, n)
            seq.status = _RUNNING
            if seq.num_cached_tokens < 0:  # first admission (a readmission after preemption is no new prompt)
                seq.num_cached_tokens = cached
                if not remote:
                    st = self.stats
                    st.prompt_tokens += seq.num_prompt
                    st.device_hit_tokens += hit.device * bs
                    st.host_hit_tokens += hit.host * bs
                    st.disk_hit_tokens += hit.disk * bs
            running.append(seq)
            if hit.restored:
                plan.restore_ms += self.restore_ms(hit)
            if remote:
                seq.remote_kv = False
                seq.ready_at = now + self.transfer_time(n)
                if seq.ready_at > now or budget <= 0:
                    continue
                self._land_transfer(seq)
                n = min(seq.num_tokens - seq.num_computed, budget)
                if not blocks.can_append(seq, n):
                    continue
                blocks.append(seq, n)
            self._plan(plan, seq, n)
            budget -= n
