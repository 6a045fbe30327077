"""Scheduler over a fake llama.cpp backend: batching, stop conditions, slots, prefix reuse, KV hand-over.

The fake "model" predicts the next token from the KV of the sequence it
samples for (a hash of the slot's tokens), so outputs depend only on a
sequence's own context — exactly what per-sequence KV streams guarantee.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from meshllm.engine.base import KvTier
from meshllm.engine.llamacpp.sampling import SamplingSpec
from meshllm.engine.llamacpp.scheduler import BatchEntry, Scheduler, validate_length
from meshllm.engine.llamacpp.sequence import Output, Sequence, SequenceStatus
from meshllm.engine.llamacpp.slots import BlocksStored, SlotTable
from meshllm.errors import ContextLengthExceeded, FailedPrecondition, InvalidArgument
from meshllm.protocol.kv import tokens_hash
from meshllm.protocol.types import LogprobItem

VOCAB = 1000


class FakeSampler:
    def __init__(self, suppress: Seq[int]) -> None:
        self.suppress = set(suppress)
        self.accepted: list[int] = []


class FakeBackend:
    """Per-slot KV as token lists; next token = hash of the slot's KV, skipping suppressed ids."""

    def __init__(self, n_slots: int) -> None:
        self.kv: list[list[int]] = [[] for _ in range(n_slots)]
        self.batches: list[list[BatchEntry]] = []
        self.fail_next = 0
        self.samplers_alive = 0
        self.unsuppressed = 0
        self._last: list[BatchEntry] = []

    def decode(self, entries: Seq[BatchEntry]) -> int:
        if self.fail_next:
            rc, self.fail_next = self.fail_next, 0
            return rc
        for token, pos, slot, _ in entries:
            assert pos == len(self.kv[slot]), f"slot {slot}: position {pos} after {len(self.kv[slot])} tokens"
            self.kv[slot].append(token)
        self.batches.append(list(entries))
        self._last = list(entries)
        return 0

    def new_sampler(self, spec: SamplingSpec, suppress: Seq[int]) -> FakeSampler:
        self.samplers_alive += 1
        return FakeSampler(suppress)

    def unsuppress(self, sampler: FakeSampler) -> None:
        sampler.suppress.clear()
        self.unsuppressed += 1

    def accept(self, sampler: FakeSampler, tokens: Seq[int]) -> None:
        sampler.accepted.extend(tokens)

    def sample(self, sampler: FakeSampler, index: int) -> int:
        assert self._last[index][3], "sampled at a position without logits"
        kv = self.kv[self._last[index][2]]
        token = tokens_hash(kv) % VOCAB
        while token in sampler.suppress:
            token = (token + 1) % VOCAB
        return token

    def logprob(self, index: int, token: int, top_n: int) -> LogprobItem:
        return {"token_id": token, "logprob": -0.5, "top": [(token, -0.5)] * top_n}

    def free_sampler(self, sampler: FakeSampler) -> None:
        self.samplers_alive -= 1

    def seq_rm(self, slot: int, p0: int, p1: int) -> bool:
        assert p1 == -1
        del self.kv[slot][max(p0, 0) :]
        return True

    def seq_cp(self, src: int, dst: int) -> None:
        self.kv[dst] = list(self.kv[src])

    def pos_max(self, slot: int) -> int:
        return len(self.kv[slot]) - 1

    def state_get(self, slot: int) -> bytes:
        return struct.pack(f"<{len(self.kv[slot])}I", *self.kv[slot])

    def state_set(self, slot: int, data: bytes) -> int:
        self.kv[slot] = list(struct.unpack(f"<{len(data) // 4}I", data))
        return len(data)


def make(n_slots: int = 2, n_batch: int = 16, n_ctx: int = 256, block_size: int = 4) -> tuple[Scheduler, FakeBackend]:
    be = FakeBackend(n_slots)
    return Scheduler(be, SlotTable(n_slots, block_size), n_batch=n_batch, n_ctx=n_ctx, min_copy_gain=block_size), be


def seq(prompt: list[int], max_tokens: int = 5, **kw: Any) -> Sequence:
    return Sequence(request_id="r", tokens=list(prompt), num_prompt=len(prompt), max_tokens=max_tokens, **kw)


def run(sched: Scheduler, *seqs: Sequence, limit: int = 200) -> dict[int, list[Output]]:
    for s in seqs:
        sched.add(s)
    outs: dict[int, list[Output]] = {s.id: [] for s in seqs}
    for _ in range(limit):
        if all(s.status is SequenceStatus.FINISHED for s in seqs):
            return outs
        for o in sched.step():
            outs.setdefault(o.seq.id, []).append(o)
    raise AssertionError("sequences did not finish")


def emitted(outs: list[Output]) -> list[int]:
    return [t for o in outs for t in o.tokens]


def finish(outs: list[Output]) -> Any:
    assert outs[-1].finish is not None
    return outs[-1].finish


def test_batches_hold_decodes_first_and_chunk_prompts_within_n_batch() -> None:
    """Locks: every step fits n_batch; a decoding sequence keeps stepping while a long prompt is chunked."""
    sched, be = make(n_batch=8)
    short = seq([1, 2], max_tokens=6, ignore_eos=True)
    long_ = seq(list(range(10, 40)), max_tokens=2, ignore_eos=True)
    sched.add(short)
    sched.step()  # short's prompt
    outs = run(sched, long_)
    assert all(len(b) <= 8 for b in be.batches)
    mixed = [b for b in be.batches if {e[2] for e in b} == {short.slot, long_.slot}]
    assert mixed and all(b[0][2] == short.slot for b in mixed)  # the decode token leads the batch
    assert finish(outs[long_.id]).reason == "length"


def test_results_do_not_depend_on_batch_neighbours() -> None:
    """Locks: a sequence run alone and run next to others yields the same tokens."""
    prompts = [[5, 6, 7], list(range(50, 70)), [9]]
    alone = []
    for p in prompts:
        sched, _ = make(n_slots=3, n_batch=8)
        s = seq(p, max_tokens=6, ignore_eos=True)
        alone.append(emitted(run(sched, s)[s.id]))
    sched, _ = make(n_slots=3, n_batch=8)
    together = [seq(p, max_tokens=6, ignore_eos=True) for p in prompts]
    outs = run(sched, *together)
    assert [emitted(outs[s.id]) for s in together] == alone


def test_stop_eos_and_length() -> None:
    """Locks: a stop token ends with "stop" unemitted; eos is emitted with "eos"; max_tokens gives "length"."""
    sched, _ = make()
    ref = seq([3, 4, 5], max_tokens=4, ignore_eos=True)
    tokens = emitted(run(sched, ref)[ref.id])
    sched, _ = make()
    s = seq([3, 4, 5], max_tokens=4, stop_token_ids=frozenset({tokens[2]}))
    outs = run(sched, s)[s.id]
    assert emitted(outs) == tokens[:2] and finish(outs).reason == "stop" and finish(outs).stop_reason == str(tokens[2])
    sched, _ = make()
    s = seq([3, 4, 5], max_tokens=4, eos_token_ids=frozenset({tokens[1]}))
    outs = run(sched, s)[s.id]
    assert emitted(outs) == tokens[:2] and finish(outs).reason == "eos"
    assert finish(outs).usage == {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}


def test_min_tokens_suppresses_eos_then_lifts_the_suppression() -> None:
    """Locks: no eos/stop before min_tokens (sampler-level suppression), removed once min_tokens is reached."""
    sched, be = make()
    ref = seq([3, 4, 5], max_tokens=4, ignore_eos=True)
    tokens = emitted(run(sched, ref)[ref.id])
    sched, be = make()
    s = seq([3, 4, 5], max_tokens=4, min_tokens=2, eos_token_ids=frozenset({tokens[0]}))
    outs = run(sched, s)[s.id]
    assert tokens[0] not in emitted(outs)[:2] and be.unsuppressed == 1


def test_cancel_frees_the_slot_in_the_same_call_and_the_sampler() -> None:
    """Locks: a cancelled running sequence releases its slot and sampler at once; the slot admits the next."""
    sched, be = make(n_slots=1)
    a = seq([1, 2, 3], max_tokens=50, ignore_eos=True)
    b = seq([7, 8], max_tokens=2, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    sched.step()
    out = sched.cancel(a)
    assert out is not None and out.finish is not None and out.finish.reason == "cancelled"
    assert not sched.slots.slots[0].busy and sched.running == [] and be.samplers_alive == 0
    outs = run(sched, b)
    assert finish(outs[b.id]).reason == "length"
    assert sched.cancel(a) is None  # twice is harmless


def test_a_repeated_prompt_reuses_all_but_its_last_token_and_stores_no_shared_blocks() -> None:
    """Locks: prefix reuse reports cached tokens and the KV events skip blocks already cached."""
    sched, _ = make(n_slots=2)
    p = list(range(100, 118))
    a = seq(p, max_tokens=1)
    run(sched, a)
    first = [ev for ev in sched.slots.drain_events() if isinstance(ev, BlocksStored)]
    b = seq([*p, 1, 2], max_tokens=1)
    outs = run(sched, b)
    assert finish(outs[b.id]).usage["cached_tokens"] == len(p)
    again = {bh for ev in sched.slots.drain_events() if isinstance(ev, BlocksStored) for bh, _ in ev.blocks}
    assert not again & {bh for ev in first for bh, _ in ev.blocks}


def test_a_prefill_leg_hands_its_kv_to_a_decode_leg_that_continues_like_aggregated() -> None:
    """Locks: context_only exports the prompt's state; generation_only loads it, checks pos_max, continues identically."""
    p = list(range(30, 45))
    sched, _ = make()
    agg = seq(p, max_tokens=6, ignore_eos=True)
    reference = emitted(run(sched, agg)[agg.id])
    prefill_sched, _ = make()
    pre = seq(p, max_tokens=1, context_only=True, ignore_eos=True)
    fin = finish(run(prefill_sched, pre)[pre.id])
    assert fin.reason == "length" and fin.kv_state is not None and len(fin.kv_state) == 4 * len(p)
    decode_sched, _ = make()
    first = reference[:1]
    dec = seq(p + first, max_tokens=6, ignore_eos=True, kv_state=fin.kv_state, remote_kv=True, prefill_cached_tokens=3)
    dec.num_prompt = len(p)
    outs = run(decode_sched, dec)[dec.id]
    assert first + emitted(outs) == reference
    assert finish(outs).usage == {"prompt_tokens": len(p), "completion_tokens": 6, "cached_tokens": 3}


def test_a_transferred_state_of_the_wrong_length_is_refused() -> None:
    """Locks: llama_memory_seq_pos_max must equal n_past - 1 after loading, else FailedPrecondition."""
    sched, _ = make()
    s = seq([1, 2, 3, 9], max_tokens=3, kv_state=struct.pack("<2I", 1, 2), remote_kv=True)
    s.num_prompt = 3
    fin = finish(run(sched, s)[s.id])
    assert fin.reason == "error" and isinstance(fin.error, FailedPrecondition)
    assert not any(slot.busy for slot in sched.slots.slots)


def test_a_failed_decode_fails_the_batch_and_frees_its_slots() -> None:
    """Locks: llama_decode != 0 ends the batch's sequences with an error instead of hanging them."""
    sched, be = make()
    s = seq([1, 2, 3], max_tokens=3)
    sched.add(s)
    be.fail_next = -1
    (out,) = sched.step()
    assert out.finish is not None and out.finish.reason == "error" and "llama_decode" in str(out.finish.error)
    assert sched.running == [] and be.kv[s.slot] == []


def test_validate_length() -> None:
    """Locks: max_tokens defaults to the room left; too long a request is ContextLengthExceeded."""
    assert validate_length(10, None, 100) == 90
    assert validate_length(10, 5, 100) == 5
    with pytest.raises(ContextLengthExceeded):
        validate_length(10, 91, 100)
    with pytest.raises(ContextLengthExceeded):
        validate_length(100, None, 100)
    with pytest.raises(InvalidArgument):
        validate_length(10, 0, 100)


def test_logprobs_ride_with_their_tokens_and_skip_the_unemitted_stop_token() -> None:
    """Locks: asked-for logprobs come one per emitted token, in the same output."""
    sched, _ = make()
    ref = seq([3, 4, 5], max_tokens=4, ignore_eos=True)
    tokens = emitted(run(sched, ref)[ref.id])
    sched, _ = make()
    s = seq([3, 4, 5], max_tokens=4, logprobs=2, stop_token_ids=frozenset({tokens[2]}))
    outs = run(sched, s)[s.id]
    assert [lp["token_id"] for o in outs for lp in o.logprobs] == emitted(outs) == tokens[:2]
    assert all(len(lp.get("top", ())) == 2 for o in outs for lp in o.logprobs)
    sched, _ = make()
    s = seq([3, 4, 5], max_tokens=2)
    assert all(o.logprobs == [] for o in run(sched, s)[s.id])


# ---------------------------------------------------------------- lower tiers


def tiered(n_slots: int = 1, host_bytes: int = 1 << 20) -> tuple[Scheduler, FakeBackend]:
    from meshllm.engine.llamacpp.tiers import TierStore

    be = FakeBackend(n_slots)
    tiers = TierStore(block_size=4, layout="fake", host_bytes=host_bytes)
    return Scheduler(be, SlotTable(n_slots, 4), n_batch=16, n_ctx=256, min_copy_gain=4, tiers=tiers), be


def test_an_overwritten_slot_is_saved_in_whole_blocks_and_restored_trimmed_to_the_match() -> None:
    """Locks: the evicted slot's whole blocks are exported (partial tail dropped first); a later prompt sharing them
    loads the blob, trims it to the matched blocks, reports them cached, and samples what a fresh run samples."""
    sched, _ = tiered()
    a = list(range(1, 12))  # 11 tokens; with 3 generated, 13 in the slot -> 3 whole blocks (12 tokens) saved
    first = emitted(next(iter(run(sched, seq(a, 3)).values())))
    run(sched, seq([500, 501, 502, 503, 504], 2))  # overwrites the only slot: a is saved
    assert sched.tiers is not None and sched.tiers.host is not None and sched.tiers.host.used == 12 * 4
    again = seq(a, 3)
    outs = run(sched, again)
    assert again.num_cached == 8  # the prompt's own whole blocks, its last token excluded (10 -> 2 blocks)
    assert emitted(outs[again.id]) == first
    assert sched.tiers.stats.hits[KvTier.HOST] == 1


def test_a_blob_that_does_not_load_is_dropped_and_the_prompt_is_computed() -> None:
    """Locks: state_set failing (0 bytes read) clears the slot, drops the blob, and the sequence runs from scratch."""
    sched, be = tiered()
    a = list(range(1, 12))
    first = emitted(next(iter(run(sched, seq(a, 3)).values())))
    run(sched, seq([500, 501, 502, 503, 504], 2))
    be.state_set = lambda slot, data: 0  # type: ignore[method-assign]
    again = seq(a, 3)
    outs = run(sched, again)
    assert again.num_cached == 0 and emitted(outs[again.id]) == first
    assert sched.tiers is not None and sched.tiers.stats.failed_restores == 1 and sched.tiers.lookup(a) is None
