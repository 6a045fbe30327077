"""meshllm.engine.mocker with lower KV tiers, driven directly: flags, restores, usage, stats, load, timing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshllm.config import ConfigError
from meshllm.config import parse_byte_size as parse_bytes
from meshllm.engine.base import Context, KvTier
from meshllm.engine.mocker import MockerConfig, MockerEngine, StepReport
from meshllm.engine.mocker.timing import prefill_ms, restore_seconds
from meshllm.protocol.kv import block_hashes
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.testing.conformance import RecordingSink

BS = 4
# 1 byte per token: a block is 4 bytes; the device holds 16 blocks, host 8, disk 8.
TIERED = MockerConfig(
    speedup_ratio=0.0, block_size=BS, num_gpu_blocks=16, watermark=0.0, context_length=48,
    kv_bytes_per_token=1, kv_host_bytes=8 * BS, kv_disk_bytes=8 * BS,
)  # fmt: skip


def req(prompt: list[int], rid: str, max_tokens: int = 4) -> TokenRequest:
    return {"request_id": rid, "token_ids": prompt, "stop": {"max_tokens": max_tokens, "ignore_eos": True}}


async def run(engine: MockerEngine, request: TokenRequest) -> tuple[list[int], TokenChunk]:
    chunks = [c async for c in engine.generate(request, Context(request["request_id"]))]
    return [t for c in chunks for t in c.get("token_ids", [])], chunks[-1]


async def started(config: MockerConfig = TIERED) -> tuple[MockerEngine, RecordingSink]:
    engine = MockerEngine(config)
    sink = RecordingSink()
    engine.sink = sink
    await engine.start("w1")
    return engine, sink


def filler(i: int) -> list[int]:
    return [5000 + 100 * i + k for k in range(8 * BS + 1)]  # 8 full blocks each


async def test_a_prompt_evicted_to_a_lower_tier_is_restored_counted_as_cached_with_the_same_output() -> None:
    """Locks: usage.cached_tokens counts restored tokens; greedy output equals the computed run's; stats per tier."""
    engine, sink = await started()
    prompt = list(range(100, 100 + 8 * BS + 2))  # 8 full blocks + 2 tokens
    first, t1 = await run(engine, req(prompt, "a"))
    assert t1["usage"]["cached_tokens"] == 0
    await run(engine, req(filler(0), "f0"))
    await run(engine, req(filler(1), "f1"))  # the prompt's blocks are now all below the device
    host, disk = engine.blocks.tiers
    lower = set(host.hashes()) | set(disk.hashes())
    ours = block_hashes(prompt, BS)
    assert set(ours) <= lower and not set(ours) & set(engine.blocks._by_hash)
    in_host, in_disk = sum(h in host for h in ours), sum(h in disk for h in ours)
    assert in_host and in_disk  # the prompt spans both tiers
    before = engine.stats.prefill_tokens
    again, t2 = await run(engine, req(prompt, "b"))
    assert again == first
    assert t2["usage"]["cached_tokens"] == 8 * BS
    assert engine.stats.prefill_tokens - before == 2  # only the uncached tail was computed
    st = engine.stats
    assert (st.host_hit_tokens, st.disk_hit_tokens) == (in_host * BS, in_disk * BS)
    assert st.cached_tokens == st.device_hit_tokens + 8 * BS
    # The restore was reported: the prompt's blocks left their lower tiers and were stored in DEVICE again.
    left = {h for _, hs, _ in sink.tier_removed for h in hs}
    assert set(ours) <= left
    assert set(ours) <= {b for blocks, _, _ in sink.stored[-3:] for b, _ in blocks}
    await engine.cleanup()


async def test_tiers_are_declared_and_reported_in_load_within_budget() -> None:
    """Locks: EngineConfig.kv_tiers; LoadMetrics.tiers with bytes never above the budget, block bytes, bandwidth."""
    engine = MockerEngine(TIERED)
    sink = RecordingSink()
    engine.sink = sink
    cfg = await engine.start("w1")
    assert cfg.kv_tiers == (KvTier.HOST, KvTier.DISK)
    for i in range(6):
        await run(engine, req(filler(i), f"f{i}"))
    host, disk = engine.blocks.tiers
    assert len(host) == 8 and len(disk) == 8  # full: 6 prompts × 8 blocks overflow both
    usage = engine.blocks.tier_usage()
    assert [(u.tier, u.blocks, u.bytes_used, u.bytes_capacity, u.block_bytes) for u in usage] == [
        (KvTier.HOST, 8, 8 * BS, 8 * BS, BS), (KvTier.DISK, 8, 8 * BS, 8 * BS, BS),
    ]  # fmt: skip
    assert [u.restore_bytes_per_s for u in usage] == [25e9, 10e9]
    tiered_loads = [m for m in sink.loads if m.tiers]
    assert tiered_loads and all(u.bytes_used <= u.bytes_capacity for m in sink.loads for u in m.tiers)
    assert await engine.clear_kv_blocks() >= 16 and all(len(t) == 0 for t in engine.blocks.tiers)
    await engine.cleanup()


async def test_tiers_off_by_default_change_nothing() -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=0.0))
    cfg = await engine.start("w1")
    assert cfg.kv_tiers == () and engine.blocks.tiers == ()
    await engine.cleanup()


async def test_only_a_disk_tier_takes_device_evictions_directly() -> None:
    engine, sink = await started(replace(TIERED, kv_host_bytes=0))
    for i in range(3):
        await run(engine, req(filler(i), f"f{i}"))
    assert [t.tier for t in engine.blocks.tiers] == [KvTier.DISK] and len(engine.blocks.tiers[0]) == 8
    assert {t for t, *_ in sink.tier_stored} == {KvTier.DISK}
    await engine.cleanup()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_host_bytes": -1}, "--kv-host-bytes must be >= 0"),
        ({"kv_disk_bytes": 3}, "--kv-disk-bytes 3 holds no block"),
        ({"kv_host_bandwidth": 0.0}, "--kv-host-bandwidth must be a finite number of GB/s > 0"),
        ({"kv_disk_bandwidth": float("nan")}, "--kv-disk-bandwidth must be"),
        ({"kv_bytes_per_token": 0}, "--kv-host-bytes needs --kv-bytes-per-token > 0"),
        ({"enable_prefix_caching": False}, "--kv-host-bytes needs prefix caching"),
    ],
)
def test_bad_tier_flags_are_one_line_config_errors(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        replace(TIERED, **changes)  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value)


async def test_tier_flags_and_env() -> None:
    engine, _ = await MockerEngine.from_args(["--kv-host-bytes", "64GiB", "--kv-disk-bandwidth", "3"])
    cfg = engine.config
    assert (cfg.kv_host_bytes, cfg.kv_disk_bytes, cfg.kv_host_bandwidth, cfg.kv_disk_bandwidth) == (64 * 2**30, 0, 25.0, 3.0)
    assert parse_bytes("1.5G") == 1_500_000_000 and parse_bytes("8 MiB") == 8 * 2**20 and parse_bytes("12") == 12
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("lots")


def test_restore_time_follows_bandwidth_and_speedup_and_beats_prefill_at_the_defaults() -> None:
    """Locks: restore = blocks × block bytes / bandwidth / speedup; at the default tiers a 4,096-token prefix
    restores faster than the timing model prefills it."""
    assert restore_seconds(8, 1_000_000, 1e9, 1.0) == pytest.approx(0.008)
    assert restore_seconds(8, 1_000_000, 1e9, 4.0) == pytest.approx(0.002)
    assert restore_seconds(8, 1_000_000, 1e9, 0.0) == 0.0 and restore_seconds(0, 1, 1e9, 1.0) == 0.0
    cfg = MockerConfig()
    blocks = 4096 // cfg.block_size
    for gbps in (cfg.kv_host_bandwidth, cfg.kv_disk_bandwidth):
        assert restore_seconds(blocks, cfg.block_bytes, gbps * 1e9, 1.0) * 1000 < prefill_ms(4096)


async def test_the_step_that_restores_a_prefix_carries_the_restore_time_from_the_tier_bandwidth() -> None:
    """Locks: StepReport.restore_ms = restored blocks × block bytes / bandwidth (model ms, before the speedup),
    included in model_ms; steps without restores carry none."""
    engine, _ = await started(replace(TIERED, kv_host_bandwidth=1e-6, kv_disk_bytes=0))  # 1 kB/s: 4 ms a block
    steps: list[StepReport] = []
    engine.on_step = steps.append
    prompt = list(range(100, 100 + 8 * BS + 2))
    await run(engine, req(prompt, "a"))
    await run(engine, req(filler(0), "f0"))
    await run(engine, req(filler(1), "f1"))
    restoring = [s for s in steps if s.restore_ms]
    assert restoring == []
    host = engine.blocks.tiers[0]
    in_host = sum(h in host for h in block_hashes(prompt, BS))
    assert in_host
    await run(engine, req(prompt, "b"))
    restoring = [s for s in steps if s.restore_ms]
    assert len(restoring) == 1 and restoring[0].restore_ms == pytest.approx(in_host * BS / 1000 * 1000)
    assert restoring[0].model_ms >= restoring[0].restore_ms
    await engine.cleanup()
