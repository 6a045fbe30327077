"""The llamacpp engine's lower KV tiers on the real SmolLM2-135M GGUF: host restore, budgets, disk across a restart.

One slot (`--n-seq-max 1`) makes every new prompt evict the previous one, so
what the tiers do is visible with a few short prompts.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_llamacpp_support import (
    MODEL,
    ONE_SLOT,
    collect,
    greedy,
    one_slot_engine,
    question,
    require_model,
    run,
    start_worker,
    tokens_of,
)

from meshllm.engine.base import KvTier
from meshllm.engine.llamacpp.engine import LlamaCppEngine
from meshllm.frontend.text.tokenizer import load_tokenizer
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import stored_blocks
from meshllm.testing.conformance import RecordingSink
from meshllm.testing.processes import MeshllmProcess
from meshllm.worker.client import WorkerClient

require_model()
pytestmark = pytest.mark.slow

BS = 16
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: layers x KV heads x head dim x (K, V) x f16
ENGINE = ONE_SLOT


async def engine(*argv: str) -> LlamaCppEngine:
    eng: LlamaCppEngine = await one_slot_engine(*argv)
    return eng


@pytest.fixture
async def host() -> AsyncIterator[LlamaCppEngine]:
    e = await engine("--kv-host-bytes", "64M")
    try:
        yield e
    finally:
        await e.cleanup()


def sink_of(eng: LlamaCppEngine) -> RecordingSink:
    assert isinstance(eng.sink, RecordingSink)
    return eng.sink


def whole_blocks(tokens: list[int]) -> int:
    """Tokens a tier can restore for a prompt: its full blocks, the last token excluded."""
    return (len(tokens) - 1) // BS * BS


def blocks_of(tokens: list[int]) -> set[int]:
    return {bh for bh, _ in stored_blocks(tokens, BS)}


def about(thing: str) -> list[int]:
    """A ~54-token prompt whose own part (after the shared system prompt's one block) spans more than two blocks."""
    return question(
        f"{thing}: where is it found, what does it look like, how do people use it, what does it cost, "
        "and what is one odd fact about it?"
    )


def turn(previous: list[int], answer: list[int], q: str) -> list[int]:
    """The next turn of a conversation: the previous prompt, its answer, and a new question (as the template writes it)."""
    tok = load_tokenizer(str(MODEL))
    return previous + answer + tok.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")


async def test_an_evicted_prompt_comes_back_from_host_memory_with_the_output_computed_from_scratch(
    host: LlamaCppEngine,
) -> None:
    """Locks: a prompt overwritten in the only slot is saved to HOST (tier events), restored when asked again
    (cached tokens reported, a HOST hit counted), and its greedy output equals the first, computed-from-scratch one."""
    a = about("Paris")
    first, term = await run(host, greedy("a1", a, 8))
    assert term["usage"]["cached_tokens"] == 0
    await run(host, greedy("b1", about("bees"), 8))  # a leaves the slot
    sink = sink_of(host)
    saved = {bh for tier, blocks, _, _ in sink.tier_stored if tier is KvTier.HOST for bh, _ in blocks}
    assert blocks_of(a) <= saved
    again, term = await run(host, greedy("a2", a, 8))
    assert term["usage"]["cached_tokens"] == whole_blocks(a)
    assert again == first
    stats = host.tier_stats()
    assert stats is not None and stats.hits == {KvTier.HOST: 1} and stats.restored_tokens == {KvTier.HOST: whole_blocks(a)}
    (usage,) = sink.loads[-1].tiers
    assert usage.tier is KvTier.HOST and 0 < usage.bytes_used <= usage.bytes_capacity and usage.restore_bytes_per_s > 0


async def test_a_restored_conversation_continues_exactly_as_if_its_prefix_had_stayed_in_the_slot(
    host: LlamaCppEngine,
) -> None:
    """Locks: the next turn of an evicted conversation, restored from HOST, gives the same cached tokens and greedy
    output as when its slot kept the prefix (restoring is exact; the answer tokens' KV came from decode steps in both)."""
    a = about("Paris")
    answer, _ = await run(host, greedy("a1", a, 8))
    a2 = turn(a, answer, "And of Spain?")
    kept, kept_term = await run(host, greedy("a2-kept", a2, 8))
    await host.clear_kv_blocks()
    answer_again, _ = await run(host, greedy("a1-again", a, 8))
    assert answer_again == answer
    await run(host, greedy("b1", about("bees"), 8))  # a leaves the slot
    restored, term = await run(host, greedy("a2-restored", a2, 8))
    assert term["usage"]["cached_tokens"] == len(a + answer[:-1]) // BS * BS  # the slot held a + all but the last answer token
    assert kept_term["usage"]["cached_tokens"] >= term["usage"]["cached_tokens"]  # the slot also kept the partial block
    assert restored == kept


async def test_the_host_budget_is_never_exceeded_and_the_least_recently_used_prefix_goes_first() -> None:
    """Locks: with room for two saved prompts, a third evicts the oldest (HOST removed events), bytes stay ≤ budget,
    and a surviving prompt is still restored."""
    prompts = [about(thing) for thing in ("apples", "the Nile", "Jupiter", "copper")]
    saved_tokens = max((len(p) + 3) // BS * BS for p in prompts)  # a prompt and 3 of its 4 answer tokens, whole blocks
    budget = int(2.5 * saved_tokens * KV_BYTES_PER_TOKEN)  # room for two saved prompts, not three
    eng = await engine("--kv-host-bytes", str(budget))
    try:
        answers = [(await run(eng, greedy(f"p{i}", p, 4)))[0] for i, p in enumerate(prompts)]
        saved = [blocks_of(p + a[:-1]) for p, a in zip(prompts, answers, strict=True)]  # what each slot held
        sink = sink_of(eng)
        assert all(u.bytes_used <= u.bytes_capacity == budget for m in sink.loads for u in m.tiers)
        assert max(u.bytes_used for m in sink.loads for u in m.tiers) > budget // 2  # the tier did fill
        removed = {bh for tier, hashes, _ in sink.tier_removed if tier is KvTier.HOST for bh in hashes}
        assert removed == saved[0] - saved[1] - saved[2]  # prompt 0 went first, prompts 1 and 2 stayed
        _, term = await run(eng, greedy("p1-again", prompts[1], 4))
        assert term["usage"]["cached_tokens"] == whole_blocks(prompts[1])
    finally:
        await eng.cleanup()


async def test_a_worker_killed_and_restarted_on_its_disk_directory_serves_the_prefix_from_disk(tmp_path: Path) -> None:
    """Locks: disk files survive SIGKILL; the restarted worker's snapshot lists them in the DISK tier, skips a corrupt
    file with a log line, and its first request reports the prefix cached with the same greedy output."""
    disk = ("--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "64M")
    a = about("Mount Everest")
    channels = ChannelCache()
    proc, address = await start_worker("agg", *ENGINE, *disk)
    try:
        client = WorkerClient(channels, address)
        first = tokens_of(await collect(client.generate(greedy("a1", a, 8))))
        await collect(client.generate(greedy("b1", about("the Pacific"), 4)))  # a is written to disk
        proc.kill9()
        await proc.wait()
    finally:
        await proc.stop()
    (tmp_path / "0000000000000bad.mlkv").write_bytes(b"MLKVTIER\xff\xff\xff\x00garbage")
    proc, address = await start_worker("agg", *ENGINE, *disk)
    try:
        client = WorkerClient(channels, address)
        snapshot = await client.get_kv_snapshot()
        (rank,) = snapshot.ranks
        on_disk = {h for t in rank.lower_tiers if t.tier == KvTier.DISK for h in t.block_hashes}
        assert blocks_of(a) <= on_disk
        chunks = await collect(client.generate(greedy("a-again", a, 8)))
        assert chunks[-1]["usage"]["cached_tokens"] == whole_blocks(a)
        assert tokens_of(chunks) == first
        assert "skipping" in proc.stderr_tail(20000) and "0000000000000bad.mlkv" in proc.stderr_tail(20000)
    finally:
        await proc.stop()
        await channels.aclose()


async def test_meshllm_run_gives_each_of_its_workers_its_own_disk_directory(tmp_path: Path) -> None:
    """Locks: `meshllm run --workers 2` with one --kv-disk-dir starts both workers (before, the second stopped at
    the first one's lock), each holding the lock of its own `<dir>/worker-<i>`."""
    proc = MeshllmProcess(
        "run", "--engine", "llamacpp", "--workers", "2", "--http-port", "0", "--router-port", "0",
        "--", *ENGINE, "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "64M",
    )  # fmt: skip
    try:
        lines: list[str] = []
        while not (lines and lines[-1].startswith("try:")):
            lines.append(await proc.line(180))
        assert sum(line.startswith("worker ") for line in lines) == 2
        for i in range(2):
            fd = os.open(tmp_path / f"worker-{i}" / ".lock", os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        assert not (tmp_path / ".lock").exists()
    finally:
        await proc.stop()
