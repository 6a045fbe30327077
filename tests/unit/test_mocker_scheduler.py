"""meshllm.engine.mocker.scheduler: continuous batching, chunked prefill, FCFS admission, preemption."""

from __future__ import annotations

from meshllm.engine.base import NullSink
from meshllm.engine.mocker.block_manager import BlockManager
from meshllm.engine.mocker.scheduler import Scheduler
from meshllm.engine.mocker.sequence import Sequence


def make(num_blocks: int = 4096, block_size: int = 16, **kw: int) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, NullSink(), watermark_blocks=kw.pop("watermark_blocks", 0))
    return Scheduler(bm, max_num_seqs=kw.get("max_num_seqs", 256), max_num_batched_tokens=kw.get("budget", 8192))


def seq(i: int, prompt_len: int, max_tokens: int, block_size: int = 16) -> Sequence:
    prompt = [(i * 7919 + k) % 30000 for k in range(prompt_len)]
    return Sequence(f"r{i}", prompt, seed=i, vocab_size=32000, block_size=block_size, max_tokens=max_tokens)


def drain(s: Scheduler, limit: int = 100_000) -> int:
    """Step until idle; return the number of steps."""
    for n in range(limit):
        if not s.has_work():
            return n
        s.postprocess(s.schedule(float(n)))
    raise AssertionError("scheduler did not go idle")


def test_300_requests_with_max_num_seqs_256_leave_44_waiting_and_all_finish() -> None:
    """Locks: max_num_seqs caps the running batch; the rest wait and are admitted as others finish."""
    s = make()
    seqs = [seq(i, 16, 20) for i in range(300)]
    for q in seqs:
        s.add(q)
    plan = s.schedule(0.0)
    assert (len(s.running), len(s.waiting)) == (256, 44)
    assert plan.prefill_tokens == 256 * 16 and plan.decode_seqs == 0
    s.postprocess(plan)
    assert all(q.num_output == 1 for q in seqs[:256]) and all(q.num_output == 0 for q in seqs[256:])
    drain(s)
    assert all(q.is_finished and q.finish_reason == "length" and q.num_output == 20 for q in seqs)
    assert s.blocks.num_used == 0


def test_chunked_prefill_splits_a_long_prompt_and_running_decodes_go_first() -> None:
    """Locks: a step computes at most max_num_batched_tokens; a prefill chunk samples nothing until the last."""
    s = make(budget=100)
    short, long = seq(0, 10, 50), seq(1, 250, 5)
    s.add(short)
    s.postprocess(s.schedule(0.0))
    s.add(long)
    counts = []
    for t in range(1, 4):
        plan = s.schedule(float(t))
        counts.append(dict(zip([q.request_id for q in plan.seqs], plan.counts, strict=True)))
        s.postprocess(plan)
    assert counts == [{"r0": 1, "r1": 99}, {"r0": 1, "r1": 99}, {"r0": 1, "r1": 52}]
    assert long.num_output == 1 and short.num_output == 4


def test_admission_is_first_come_first_served_even_when_a_later_request_would_fit() -> None:
    """Locks: a waiting request that does not fit blocks the ones behind it (no overtaking)."""
    s = make(num_blocks=10, block_size=4)
    big, small = seq(0, 36, 1, block_size=4), seq(1, 4, 1, block_size=4)
    hog = seq(2, 8, 100, block_size=4)
    s.add(hog)
    s.postprocess(s.schedule(0.0))
    s.add(big)
    s.add(small)
    s.schedule(1.0)
    assert [q.request_id for q in s.waiting] == ["r0", "r1"]


def test_out_of_blocks_preempts_the_newest_to_the_front_of_waiting_and_loses_nothing() -> None:
    """Locks: preemption by recompute frees the latest admitted, requeues it first, and everyone finishes."""
    s = make(num_blocks=24, block_size=4)
    seqs = [seq(i, 8, 40, block_size=4) for i in range(10)]
    for q in seqs:
        s.add(q)
    preempted_to_front = False
    for t in range(10_000):
        if not s.has_work():
            break
        before = s.num_preemptions
        s.postprocess(s.schedule(float(t)))
        if s.num_preemptions > before:
            victim = s.waiting[0]
            preempted_to_front = victim.num_computed == 0 and victim.num_output > 0
    assert s.num_preemptions > 0 and preempted_to_front
    assert all(q.finish_reason == "length" and q.num_output == 40 for q in seqs)
    assert s.blocks.num_used == 0

    reference = make()
    fresh = [seq(i, 8, 40, block_size=4) for i in range(10)]
    for q in fresh:
        reference.add(q)
    drain(reference)
    assert [q.tokens for q in seqs] == [q.tokens for q in fresh]  # recompute changes no output


def test_a_decode_leg_waits_for_its_transfer_and_is_charged_no_prefill() -> None:
    """Locks: generation-only sequences allocate at admission, land at `ready_at`, then decode."""
    bm = BlockManager(64, 4, NullSink())
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, transfer_time=lambda tokens: tokens * 0.5)
    prompt = list(range(10))
    q = Sequence("d", prompt, seed=3, vocab_size=100, block_size=4, max_tokens=3, first_token_ids=[7])
    s.add(q)
    plan = s.schedule(0.0)
    assert plan.seqs == [] and q.ready_at == 5.0 and len(q.block_table) == 3
    assert s.next_ready_at() == 5.0
    assert s.schedule(4.9).seqs == []
    plan = s.schedule(5.0)
    assert plan.counts == [1] and plan.prefill_tokens == 0 and plan.decode_seqs == 1
    s.postprocess(plan)
    assert q.tokens[:11] == [*prompt, 7] and q.num_output == 2
