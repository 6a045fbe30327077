"""Benchmark the router's KV index: block-events applied per second and prompt lookup latency.

    .venv/bin/python bench/indexer.py                # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/indexer.py --no-write     # measure and print only

Setup: 16 workers, each filled to exactly 16,384 distinct resident blocks
(block size 16) with the blocks of randomly chosen documents from a shared
pool of 512 4,096-token documents; documents share 1,024-token system
prefixes in groups of 8, so hashes repeat across workers the way real
prefixes do. Then:

- *apply*: the fill, followed by churn (remove 16 blocks, store 16 blocks,
  per event, 4 events per batch) until as many block-events again were
  applied — `KvIndex.apply_batch` on decoded `KvEventBatch` messages, and
  once more including protobuf decoding (`FromString`), the full per-message
  cost behind a NATS subscription;
- *lookup*: 4,096-token prompts (256 blocks): each is hashed with
  `meshllm.protocol.kv` (block size 16) and walked over all 16 workers' dp
  ranks — what the router does per request. Queries are a mix of fully
  cached documents (the walk visits all 256 blocks), half-cached prompts and
  misses. Latency is reported with and without the hashing, and with the
  capacity query `kv` routing makes next (`KvIndex.capacity` per worker,
  every cache full, half the documents touched as reused).

Targets (ISSUE 5): ≥ 200,000 block-events/s applied; p99 lookup < 1 ms.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

from harness.doc import write_section
from harness.runinfo import LoadMonitor, best_phrase, load_sentence, machine, today, versions
from harness.stats import pct

from meshllm.protocol.kv import block_hashes, stored_blocks
from meshllm.router.kv.blocks import BlockMap
from meshllm.router.kv.index import KvIndex
from meshllm.v1 import events_pb2, worker_pb2

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
WORKERS = 16
BLOCKS_PER_WORKER = 16_384
BLOCK_SIZE = 16
DOC_TOKENS = 4096
DOC_BLOCKS = DOC_TOKENS // BLOCK_SIZE
DOCS = 512
PREFIX_TOKENS = 1024
TARGET_EVENTS_PER_S = 200_000
TARGET_P99_MS = 1.0


def document(i: int, rng: random.Random) -> list[int]:
    prefix_rng = random.Random(1_000_000 + i // 8)  # 8 documents share one system prefix
    prefix = [prefix_rng.randrange(32000) for _ in range(PREFIX_TOKENS)]
    return prefix + [rng.randrange(32000) for _ in range(DOC_TOKENS - PREFIX_TOKENS)]


def build_fill(docs: list[list[tuple[int, int]]], rng: random.Random) -> tuple[list[events_pb2.KvEventBatch], list[list[int]]]:
    """Batches that fill every worker to exactly BLOCKS_PER_WORKER distinct blocks; also each worker's documents."""
    batches = []
    held: list[list[int]] = []
    for w in range(WORKERS):
        ids: list[int] = []
        seen: set[int] = set()
        event_id = 0
        for d in rng.sample(range(DOCS), DOCS):
            if len(seen) >= BLOCKS_PER_WORKER:
                break
            ids.append(d)
            new = [(i, b) for i, b in enumerate(docs[d]) if b[0] not in seen][: BLOCKS_PER_WORKER - len(seen)]
            seen.update(b[0] for _, b in new)
            for start in range(0, len(new), 64):  # 4 events of 16 blocks per batch
                batch = events_pb2.KvEventBatch(worker_id=f"w{w}")
                for s in range(start, min(start + 64, len(new)), 16):
                    event_id += 1
                    ev = batch.events.add(event_id=event_id)
                    first = new[s][0]
                    if first:
                        ev.stored.parent_hash = docs[d][first - 1][0]
                    chunk = new[s : s + 16]
                    ev.stored.blocks.extend(events_pb2.StoredBlock(block_hash=bh, tokens_hash=th) for _, (bh, th) in chunk)
                batches.append(batch)
        held.append(ids)
    return batches, held


def build_churn(n_block_events: int, rng: random.Random, first_ids: list[int]) -> list[events_pb2.KvEventBatch]:
    """Remove-16 / store-16 events on random workers (fresh random hashes), 4 events per batch."""
    batches = []
    next_id = list(first_ids)
    recent: list[list[int]] = [[] for _ in range(WORKERS)]
    made = 0
    while made < n_block_events:
        w = rng.randrange(WORKERS)
        batch = events_pb2.KvEventBatch(worker_id=f"w{w}")
        for _ in range(2):
            next_id[w] += 1
            fresh = [rng.getrandbits(64) for _ in range(16)]
            batch.events.add(event_id=next_id[w]).stored.blocks.extend(events_pb2.StoredBlock(block_hash=h) for h in fresh)
            recent[w].extend(fresh)
            next_id[w] += 1
            gone, recent[w] = recent[w][:16], recent[w][16:]
            batch.events.add(event_id=next_id[w], removed=events_pb2.BlocksRemoved(block_hashes=gone))
            made += 16 + len(gone)
        batches.append(batch)
    return batches


def fresh_index() -> KvIndex:
    index = KvIndex()
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
        index.apply_snapshot(worker_pb2.KvSnapshot(worker_id=f"w{w}", last_event_id=0))
    return index


def measure_apply(batches: list[events_pb2.KvEventBatch], *, decode: bool) -> tuple[float, int, KvIndex]:
    payloads = [b.SerializeToString() for b in batches] if decode else []
    index = fresh_index()
    gc.collect()
    t0 = time.perf_counter()
    if decode:
        from_string = events_pb2.KvEventBatch.FromString
        for data in payloads:
            index.apply_batch(from_string(data))
    else:
        for batch in batches:
            index.apply_batch(batch)
    elapsed = time.perf_counter() - t0
    return elapsed, index.applied, index


def measure_churn(index: KvIndex, batches: list[events_pb2.KvEventBatch], *, decode: bool) -> tuple[float, int]:
    payloads = [b.SerializeToString() for b in batches] if decode else []
    before = index.applied
    gc.collect()
    t0 = time.perf_counter()
    if decode:
        from_string = events_pb2.KvEventBatch.FromString
        for data in payloads:
            index.apply_batch(from_string(data))
    else:
        for batch in batches:
            index.apply_batch(batch)
    return time.perf_counter() - t0, index.applied - before


def measure_lookup(
    index: KvIndex, docs_tokens: list[list[int]], held: list[list[int]], rng: random.Random, n: int
) -> dict[str, list[float]]:
    keys = [(f"w{w}", 0) for w in range(WORKERS)]
    cached = sorted({d for ids in held for d in ids})
    queries: list[list[int]] = []
    for i in range(n):
        kind = i % 4
        if kind <= 1:  # fully cached document: walk all 256 blocks
            queries.append(docs_tokens[rng.choice(cached)])
        elif kind == 2:  # same document head, new tail
            base = docs_tokens[rng.choice(cached)]
            queries.append(base[: DOC_TOKENS // 2] + [rng.randrange(32000) for _ in range(DOC_TOKENS // 2)])
        else:  # shared system prefix only
            base = docs_tokens[rng.randrange(DOCS)]
            queries.append(base[:PREFIX_TOKENS] + [rng.randrange(32000) for _ in range(DOC_TOKENS - PREFIX_TOKENS)])
    for w, key in enumerate(keys):
        index.set_total(key, BLOCKS_PER_WORKER)  # every cache full: each new block evicts one
        for d in rng.sample(held[w], len(held[w])):  # routed again in random order, half of them as reuses
            index.touch(key, block_hashes(docs_tokens[d], BLOCK_SIZE), reused=rng.random() < 0.5)
    total, walk, decide = [], [], []
    gc.collect()
    for q in queries:
        t0 = time.perf_counter()
        hashes = block_hashes(q, BLOCK_SIZE)
        t1 = time.perf_counter()
        overlaps = index.overlaps(hashes, keys)
        t2 = time.perf_counter()
        prompt = frozenset(hashes)  # as RouterCore asks (`Ask.prompt`): its block ids are kept across the workers
        for key in keys:
            index.capacity(key, prompt, len(hashes) - overlaps.get(key, 0))
        t3 = time.perf_counter()
        total.append((t2 - t0) * 1000)
        walk.append((t2 - t1) * 1000)
        decide.append((t3 - t0) * 1000)
    return {"total": total, "walk": walk, "decide": decide}


def build_tiers(
    docs: list[list[tuple[int, int]]], held: list[list[int]], rng: random.Random, first_ids: list[int]
) -> tuple[list[events_pb2.KvEventBatch], list[list[int]]]:
    """Per worker, 32 documents it does not hold reported in host memory and 32 more on disk; also those documents."""
    batches = []
    kept: list[list[int]] = []
    for w in range(WORKERS):
        others = rng.sample([d for d in range(DOCS) if d not in set(held[w])], 64)
        kept.append(others)
        event_id = first_ids[w]
        for i, d in enumerate(others):
            tier = events_pb2.KV_TIER_HOST if i < 32 else events_pb2.KV_TIER_DISK
            for start in range(0, DOC_BLOCKS, 64):
                event_id += 1
                batch = events_pb2.KvEventBatch(worker_id=f"w{w}")
                ev = batch.events.add(event_id=event_id)
                ev.stored.tier = tier
                chunk = docs[d][start : start + 64]
                ev.stored.blocks.extend(events_pb2.StoredBlock(block_hash=bh, tokens_hash=th) for bh, th in chunk)
                batches.append(batch)
    return batches, kept


def measure_tier_lookup(
    index: KvIndex, docs_tokens: list[list[int]], kept: list[list[int]], rng: random.Random, n: int
) -> list[float]:
    keys = [(f"w{w}", 0) for w in range(WORKERS)]
    lowered = sorted({d for ids in kept for d in ids})
    out = []
    gc.collect()
    for _ in range(n):
        q = docs_tokens[rng.choice(lowered)]
        t0 = time.perf_counter()
        hashes = block_hashes(q, BLOCK_SIZE)
        device = index.overlaps(hashes, keys)
        index.tier_overlaps(hashes, keys, device)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def run(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(42)
    t0 = time.perf_counter()
    docs_tokens = [document(i, rng) for i in range(DOCS)]
    docs = [stored_blocks(t, BLOCK_SIZE) for t in docs_tokens]
    fill, held = build_fill(docs, rng)
    fill_events = sum(len(ev.stored.blocks) for b in fill for ev in b.events)
    last_ids = [0] * WORKERS
    for b in fill:
        last_ids[int(b.worker_id[1:])] = b.events[-1].event_id
    churn = build_churn(fill_events, rng, last_ids)
    print(f"workload built in {time.perf_counter() - t0:.1f}s: {len(fill)} fill + {len(churn)} churn batches", file=sys.stderr)
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        for decode in (False, True):
            el_fill, n_fill, idx = measure_apply(fill, decode=decode)
            el_churn, n_churn = measure_churn(idx, churn, decode=decode)
            key = "decode" if decode else "apply"
            best[f"{key}_fill"] = max(best.get(f"{key}_fill", 0.0), n_fill / el_fill)
            best[f"{key}_churn"] = max(best.get(f"{key}_churn", 0.0), n_churn / el_churn)
    # lookups run against the filled index (the churn above replaced part of it with random hashes)
    _, _, index = measure_apply(fill, decode=False)
    best["indexed_blocks"] = float(sum(index.worker_blocks(f"w{w}") for w in range(WORKERS)))
    best["distinct_hashes"] = float(index.size)
    lat = measure_lookup(index, docs_tokens, held, rng, args.lookups)
    for name, values in lat.items():
        best[f"{name}_p50"] = statistics.median(values)
        best[f"{name}_p90"] = pct(values, 90)
        best[f"{name}_p99"] = pct(values, 99)
        best[f"{name}_max"] = max(values)
    best["fill_events"] = float(fill_events)
    ids = [index.last_event_id(f"w{w}") for w in range(WORKERS)]
    tier_batches, kept = build_tiers(docs, held, rng, ids)
    before = index.applied
    gc.collect()
    t1 = time.perf_counter()
    for b in tier_batches:
        index.apply_batch(b)
    best["tier_apply"] = (index.applied - before) / (time.perf_counter() - t1)
    best["tier_events"] = float(index.applied - before)
    tiers = measure_tier_lookup(index, docs_tokens, kept, rng, args.lookups)
    best["tiers_p50"] = statistics.median(tiers)
    best["tiers_p90"] = pct(tiers, 90)
    best["tiers_p99"] = pct(tiers, 99)
    return best


def render(r: dict[str, float], args: argparse.Namespace, loads: list[float], build: str) -> str:
    ok_events = "meets" if min(r["apply_fill"], r["apply_churn"]) >= TARGET_EVENTS_PER_S else "MISSES"
    ok_p99 = "meets" if r["total_p99"] < TARGET_P99_MS else "MISSES"
    ok_decide = "meets" if r["decide_p99"] < TARGET_P99_MS else "misses"
    ok_tiers = "meets" if r["tiers_p99"] < TARGET_P99_MS else "MISSES"
    target_ms = f"{TARGET_P99_MS:g} ms"

    def us(name: str, fmt: str = "{:,.0f}") -> str:
        return " / ".join(fmt.format(r[f"{name}_{p}"] * 1000) for p in ("p50", "p90", "p99"))

    impl = (
        "in C (`kv/_blockcore.c`)"
        if BlockMap.__module__.endswith("compiled")
        else "the Python map (`kv/blocks.py`: the C extension was not built)"
    )
    return f"""## KV indexer

`.venv/bin/python bench/indexer.py --repeat {args.repeat} --lookups {args.lookups}` on {today()} ({machine()}; {build}).
{WORKERS} workers × {BLOCKS_PER_WORKER:,} resident blocks (block size {BLOCK_SIZE}; {int(r["indexed_blocks"]):,} indexed
(worker, block) pairs, {int(r["distinct_hashes"]):,} distinct hashes: documents share 1,024-token prefixes).
Apply: the fill ({int(r["fill_events"]):,} stored block-events in 64-block batches), then as many churn
block-events (remove 16 + store 16 per event pair); the {best_phrase(args.repeat)} (highest rate). Lookup: one run
of {args.lookups:,} prompts of 4,096 tokens (half fully cached, a quarter half-cached, a quarter sharing only the
system prefix), each hashed and walked over all {WORKERS} workers; percentiles over the prompts.
{load_sentence(loads)}

| measurement | value |
|---|---|
| block-events/s applied, fill | {r["apply_fill"]:,.0f} |
| block-events/s applied, churn | {r["apply_churn"]:,.0f} ({ok_events} the {TARGET_EVENTS_PER_S:,} target) |
| block-events/s incl. protobuf decode, fill | {r["decode_fill"]:,.0f} |
| block-events/s incl. protobuf decode, churn | {r["decode_churn"]:,.0f} |
| lookup p50 / p90 / p99 (hash + walk) | {us("total")} µs (p99 {ok_p99} the {TARGET_P99_MS:g} ms target) |
| lookup max (hash + walk) | {r["total_max"] * 1000:,.0f} µs |
| walk alone p50 / p90 / p99 | {us("walk", "{:,.1f}")} µs |
| lookup + capacity of all {WORKERS} workers p50 / p90 / p99 | {us("decide")} µs (p99 {ok_decide} the {target_ms} target) |
| block-events/s applied, lower tiers ({int(r["tier_events"]):,} host and disk block-events, one run) | {r["tier_apply"]:,.0f} |
| lookup with lower tiers (hash + walk + tier walk) p50 / p90 / p99 | {us("tiers")} µs (p99 {ok_tiers} the {target_ms} target) |

The index is the one a router uses, {impl}: each block hash maps to the (worker, dp rank) slots holding it, and
each slot keeps its blocks in eviction order with reuse counts (docs/routing.md "The KV index"); a lookup
intersects the holders along the prompt's chained hashes, stopping at the first block no candidate holds.
Hashing the prompt (XXH3 over 256 blocks) is most of a lookup. The last
row adds what `kv` routing asks next, per worker: `KvIndex.capacity` with every cache full (the prompt's
new blocks evict as many least recently used ones, each checked for reuse; half the documents were touched as
reused, in random order, so reused blocks are spread through the eviction order). The last two rows
add lower tiers: each worker reports 32 documents it does not hold on the device as kept in host memory
and 32 on disk; lower-tier blocks go into a set per worker and tier plus one "held in some lower tier"
bitmask per hash, and a lookup of a document some workers keep in a lower tier walks the prompt once more
over device ∪ lower masks (where each worker's servable run ends), then splits each run into tiers with
set intersections.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of the apply measurement (best is kept)")
    parser.add_argument("--lookups", type=int, default=4000, help="prompts looked up")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    with LoadMonitor() as monitor:
        figures = run(args)
    section = render(figures, args, monitor.samples, versions("protobuf", "xxhash"))
    print(section)
    if not args.no_write:
        write_section("## KV indexer", section)
        print(f"updated {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
