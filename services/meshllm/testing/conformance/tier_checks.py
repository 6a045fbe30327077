"""The checks of engines with lower KV tiers (`EngineConfig.kv_tiers`): evicted blocks come back, unchanged.

Both checks run one procedure on a fresh engine: a greedy request for a
prompt of `tier_prompt_blocks` full blocks (plus two tokens) is the
reference; filler prompts of fresh tokens then fill the device cache until
the sink's events say the prompt's first block left the DEVICE tier and sits
in a lower one (at most `tier_fill_factor` × `total_kv_blocks` blocks of
filler); the prompt is requested again. The blocks are the chained hashes of
`meshllm.protocol.kv`, as every engine reports them.

So an engine needs no hook for the kit: configure it (through the factory's
flags) with a device cache small enough to fill quickly, e.g. the mocker's
`--num-gpu-blocks`, llama.cpp's context size, and lower tiers that can hold
a few of those prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.engine.base import EngineConfig, KvTier, LLMEngine
from meshllm.protocol.kv import block_hashes
from meshllm.testing.conformance.kit import EngineFactory, RecordingSink, Stream, _Probe, _require_terminal

__all__ = ["check_kv_tier_restore", "check_kv_tier_restore_output"]

_LOWER = (KvTier.HOST, KvTier.DISK)


@dataclass(slots=True)
class _Restored:
    """What the procedure saw: the reference run, the run after the restore, and what the tiers held."""

    reference: Stream
    again: Stream
    prefix_blocks: int  # leading prompt blocks held in some tier just before the second request
    lower_blocks: int  # of those, the ones held only in a lower tier
    where: str  # e.g. "3 in HOST, 1 in DISK"
    block_size: int
    hashes: list[int]  # the prefix's block hashes
    sink: RecordingSink


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    """`n` token ids of prompt `seed`: distinct prompts from their first token on, all below `vocab`."""
    span = max(vocab - 20, 100)
    return [10 + (seed * 7919 + i * 31) % span for i in range(n)]


def _config_for_tiers(p: _Probe, cfg: EngineConfig) -> tuple[int, int, int]:
    """(block size, device blocks, room for a prompt) of a tiered engine, or the clause fails / does not apply."""
    if not isinstance(cfg, EngineConfig):  # start_config's failure; whether tiers apply is unknown
        raise p.skip(f"start() returned {type(cfg).__name__}, not an EngineConfig, so no kv_tiers are declared")
    if not cfg.kv_tiers:
        raise p.skip("the engine declares no lower KV tiers (EngineConfig.kv_tiers)")
    if cfg.kv_block_size <= 0 or cfg.total_kv_blocks <= 0:
        raise p.fail(
            f"an engine declaring kv_tiers {[t.name for t in cfg.kv_tiers]} must report kv_block_size and total_kv_blocks,"
            f" got {cfg.kv_block_size} and {cfg.total_kv_blocks}"
        )
    room = (cfg.context_length or 1 << 20) - p.options.max_tokens
    return cfg.kv_block_size, cfg.total_kv_blocks, room


# size: one conformance scenario step after step (start, fill, evict, restore, compare), as its clause reads
async def _evict_and_restore(factory: EngineFactory, p: _Probe) -> _Restored:
    if p.shared is not None and isinstance(p.shared.config, EngineConfig) and not p.shared.config.kv_tiers:
        _config_for_tiers(p, p.shared.config)  # skips: no tiers, so no engine of its own is started to learn that
    engine: LLMEngine = await p.new_engine(factory)
    try:
        cfg = await p.call("start()", engine.start(f"conformance-{p.clause}"), p.options.start_timeout_s)
        bs, device_blocks, room = _config_for_tiers(p, cfg)
        sink = engine.sink
        assert isinstance(sink, RecordingSink)
        vocab = cfg.vocab_size or 32000
        k = min(p.options.tier_prompt_blocks, (room - 2) // bs)
        if k < 1:
            raise p.fail(f"context_length {cfg.context_length} leaves no room for a {bs}-token block and a reply")
        prompt = _tokens(0, k * bs + 2, vocab)
        hashes = block_hashes(prompt, bs)[:k]
        n = p.options.max_tokens
        reference = await p.stream(engine, p.request(prompt=prompt, max_tokens=n, ignore_eos=True))
        _require_terminal(p, reference, "the reference run")
        if not set(hashes) <= sink.held[KvTier.DEVICE]:
            raise p.fail(f"after the reference run the prompt's {k} full blocks were not reported stored in DEVICE")

        filler_len = max(bs, min(room - 1, device_blocks * bs // 2) // bs * bs)
        limit = p.options.tier_fill_factor * device_blocks * bs
        sent, seed = 0, 1
        lower = set[int]().union(*(sink.held[t] for t in _LOWER))
        while hashes[0] in sink.held[KvTier.DEVICE] or hashes[0] not in lower:
            if sent >= limit:
                raise p.fail(
                    f"after {sent:,} filler tokens ({p.options.tier_fill_factor:g} × the {device_blocks}-block device cache)"
                    f" the prompt's first block was not reported moved from DEVICE to a lower tier; give the engine a"
                    f" smaller device cache or lower tiers that keep evicted blocks"
                )
            await p.stream(engine, p.request(prompt=_tokens(seed, filler_len, vocab), max_tokens=1, ignore_eos=True))
            sent, seed = sent + filler_len, seed + 1
            lower = set[int]().union(*(sink.held[t] for t in _LOWER))

        prefix = 0
        counts = dict.fromkeys(_LOWER, 0)
        for h in hashes:
            tier = next((t for t in (KvTier.DEVICE, *_LOWER) if h in sink.held[t]), None)
            if tier is None:
                break
            prefix += 1
            if tier != KvTier.DEVICE:
                counts[tier] += 1
        where = ", ".join(f"{c} in {t.name}" for t, c in counts.items() if c)
        again = await p.stream(engine, p.request(prompt=prompt, max_tokens=n, ignore_eos=True))
        _require_terminal(p, again, "the request after the eviction")
        return _Restored(reference, again, prefix, sum(counts.values()), where, bs, hashes[:prefix], sink)
    finally:
        await p.cleanup_quietly(engine)


async def check_kv_tier_restore(factory: EngineFactory, p: _Probe) -> None:
    r = await _evict_and_restore(factory, p)
    usage = r.again.terminal.get("usage") if r.again.terminal else None
    cached = usage.get("cached_tokens") if isinstance(usage, dict) else None
    want = r.prefix_blocks * r.block_size
    if not isinstance(cached, int) or cached < want:
        raise p.fail(
            f"the prompt's first {r.prefix_blocks} blocks were held ({r.where}, the rest in DEVICE), yet requesting it"
            f" again reported usage.cached_tokens {cached!r}, expected >= {want}"
        )
    missing = [h for h in r.hashes if h not in r.sink.held[KvTier.DEVICE]]
    if missing:
        raise p.fail(
            f"after the restore {len(missing)} of the prompt's {r.prefix_blocks} blocks were not reported stored in DEVICE"
        )


async def check_kv_tier_restore_output(factory: EngineFactory, p: _Probe) -> None:
    r = await _evict_and_restore(factory, p)
    if (r.again.tokens, r.again.finish_reason) != (r.reference.tokens, r.reference.finish_reason):
        raise p.fail(
            f"greedy output with the prefix restored ({r.where}) was {r.again.tokens} ({r.again.finish_reason!r}); computed"
            f" from scratch it was {r.reference.tokens} ({r.reference.finish_reason!r})"
        )
