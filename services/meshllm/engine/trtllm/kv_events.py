"""TensorRT-LLM KV cache events and iteration stats, turned into `EngineSink` calls.

Event shapes (NVIDIA/TensorRT-LLM `tensorrt_llm/_utils.py`,
`KVCacheEventSerializer`; `LLM.get_kv_cache_events_async` yields these dicts,
the C++ bindings the same fields as attributes):

    {"event_id": 7, "window_size": 4096, "attention_dp_rank": 0,   # the last two only in newer versions
     "data": {"type": "stored", "parent_hash": 11 | None,
              "blocks": [{"type": "stored_block", "block_hash": 12, "cache_level": 0, "priority": 35,
                          "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}, ...]}]}}
    data = {"type": "removed", "block_hashes": [12, ...]}
    data = {"type": "created", "num_blocks_per_cache_level": [gpu_blocks, host_blocks]}
    data = {"type": "updated", "block_hash": 12, "cache_level": {...}, "priority": {...}}

TensorRT-LLM's block hashes are its own; the router hashes prompts with
`meshllm.protocol.kv`. So every stored block is re-hashed from its token ids
(tokens hash, chained onto our hash of its parent), and a per-rank map from
engine hash to our hash translates parents and removals. Only full blocks
(exactly `block_size` tokens) are kept: a partial block ends the stored run,
never enters the map, and its later removal is dropped as unknown. Events of
attention layers narrower than the model's largest window are dropped, as
Dynamo's publisher does (ai-dynamo/dynamo `components/src/dynamo/trtllm/publisher.py`).

Event-id continuity (per attention-DP rank). On a gap we cannot know what the
lost events stored or removed, so we **resync**: `all_cleared` for that rank,
then re-store every block still in the map (parents first), then apply the new
event. Chosen over "log and carry on" because the router's view is then at
least a subset-or-equal of what we know rather than a silent drift; the cost is
that blocks removed inside the lost range stay advertised until the next
resync (a router that trusts them pays one cache miss). Blocks stored inside
the lost range are unknown parents for later events; those events are dropped
(counted in `stats.unknown_parents`) because their chained hashes cannot be
computed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshllm.engine.base import EngineSink, LoadMetrics
from meshllm.protocol.kv import chain_hash, tokens_hash

__all__ = [
    "KvCacheEvent",
    "KvEventConverter",
    "KvEventStats",
    "StoredBlock",
    "block_size_from_stats",
    "load_from_stats",
    "parse_event",
    "total_blocks_from_stats",
]

log = logging.getLogger(__name__)

# Binding class names -> serialized "type" (KVCacheEventSerializer.get_event_serialize_func).
_OBJECT_KINDS = {
    "KVCacheCreatedData": "created",
    "KVCacheStoredData": "stored",
    "KVCacheRemovedData": "removed",
    "KVCacheUpdatedData": "updated",
}


@dataclass(frozen=True, slots=True)
class StoredBlock:
    engine_hash: int | None
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCacheEvent:
    """One TensorRT-LLM KV cache event, whatever shape it arrived in."""

    event_id: int
    kind: str  # "created" | "stored" | "removed" | "updated" (anything else is ignored)
    dp_rank: int = 0
    window_size: int | None = None
    parent_hash: int | None = None
    blocks: tuple[StoredBlock, ...] = ()
    removed: tuple[int, ...] = ()
    num_blocks: tuple[int, ...] = ()


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def parse_event(raw: Any) -> KvCacheEvent:
    """Normalize a serialized dict, a JSON string or a bindings `KVCacheEvent` object."""
    if isinstance(raw, str | bytes):
        raw = json.loads(raw)
    data = _field(raw, "data")
    event_id = _field(raw, "event_id")
    if data is None or event_id is None:
        raise ValueError(f"not a KV cache event: {raw!r:.200}")
    kind = _field(data, "type") if isinstance(data, Mapping) else _OBJECT_KINDS.get(type(data).__name__, "")
    window = _field(raw, "window_size")
    common: dict[str, Any] = {
        "event_id": int(event_id),
        "kind": str(kind),
        "dp_rank": int(_field(raw, "attention_dp_rank") or 0),
        "window_size": None if window is None else int(window),
    }
    if kind == "stored":
        parent = _field(data, "parent_hash")
        blocks = tuple(
            StoredBlock(
                engine_hash=None if (h := _field(b, "block_hash")) is None else int(h),
                tokens=tuple(int(_field(t, "token_id")) for t in _field(b, "tokens", ())),
            )
            for b in _field(data, "blocks", ())
        )
        return KvCacheEvent(**common, parent_hash=None if parent is None else int(parent), blocks=blocks)
    if kind == "removed":
        return KvCacheEvent(**common, removed=tuple(int(h) for h in _field(data, "block_hashes", ()) if h is not None))
    if kind == "created":
        return KvCacheEvent(**common, num_blocks=tuple(int(n) for n in _field(data, "num_blocks_per_cache_level", ())))
    return KvCacheEvent(**common)


@dataclass(slots=True)
class KvEventStats:
    """Counters for logs and tests."""

    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    partial_blocks: int = 0
    unknown_removals: int = 0
    unknown_parents: int = 0
    oversized_blocks: int = 0
    dropped_window: int = 0
    malformed: int = 0
    gaps: int = 0


@dataclass(frozen=True, slots=True)
class _Known:
    block_hash: int
    tokens_hash: int
    parent: int | None  # our hash of the parent block


@dataclass(slots=True)
class _Rank:
    last_event_id: int | None = None
    known: dict[int, _Known] = field(default_factory=dict)  # engine block hash -> ours


class KvEventConverter:
    """Feeds TensorRT-LLM KV events to an EngineSink with router-compatible hashes.

    `handle` is synchronous and never raises for bad input (it logs and counts),
    so one malformed event cannot stop the polling loop.
    """

    def __init__(self, sink: EngineSink, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.sink = sink
        self.block_size = block_size
        self.stats = KvEventStats()
        self.total_blocks = 0  # GPU blocks from the first "created" event (0 = not seen)
        self._ranks: dict[int, _Rank] = {}
        self._max_window: int | None = None
        self._initial_created = True

    def handle(self, raw: Any) -> None:
        try:
            event = parse_event(raw)
        except (ValueError, TypeError, KeyError) as exc:
            self.stats.malformed += 1
            log.warning("dropping a malformed TensorRT-LLM KV event: %s", exc)
            return
        self.stats.events += 1
        rank = self._ranks.setdefault(event.dp_rank, _Rank())
        if rank.last_event_id is not None and event.event_id != rank.last_event_id + 1:
            self._resync(event.dp_rank, rank, expected=rank.last_event_id + 1, got=event.event_id)
        rank.last_event_id = event.event_id
        if event.kind == "created":
            self._on_created(event)
            return
        self._initial_created = False
        if event.window_size is not None and self._max_window is not None and event.window_size != self._max_window:
            self.stats.dropped_window += 1
            return
        if event.kind == "stored":
            self._on_stored(event, rank)
        elif event.kind == "removed":
            self._on_removed(event, rank)
        # "updated" (priority / cache level changes) does not change residency for routing.

    def _on_created(self, event: KvCacheEvent) -> None:
        if event.num_blocks and not self.total_blocks:
            self.total_blocks = event.num_blocks[0]
        if self._initial_created and event.window_size is not None:
            self._max_window = max(self._max_window or 0, event.window_size)

    def _on_stored(self, event: KvCacheEvent, rank: _Rank) -> None:
        parent: int | None = None
        if event.parent_hash is not None:
            known_parent = rank.known.get(event.parent_hash)
            if known_parent is None:
                self.stats.unknown_parents += 1
                log.debug("dropping stored event %d: parent block %d is unknown", event.event_id, event.parent_hash)
                return
            parent = known_parent.block_hash
        first_parent = parent
        out: list[tuple[int, int]] = []
        learned: list[tuple[int, _Known]] = []
        for block in event.blocks:
            n = len(block.tokens)
            if n > self.block_size:
                self.stats.oversized_blocks += 1
                log.error(
                    "stored event %d has a block of %d tokens but the block size is %d; dropping it "
                    "(is --kv-block-size the engine's tokens_per_block?)",
                    event.event_id,
                    n,
                    self.block_size,
                )
                return
            if n < self.block_size:
                self.stats.partial_blocks += 1
                break  # a partial block is always the last one; it is never advertised
            th = tokens_hash(block.tokens)
            bh = chain_hash(parent, th)
            out.append((bh, th))
            if block.engine_hash is not None:
                learned.append((block.engine_hash, _Known(bh, th, parent)))
            parent = bh
        rank.known.update(learned)
        if out:
            self.stats.stored_blocks += len(out)
            self.sink.blocks_stored(out, first_parent, event.dp_rank)

    def _on_removed(self, event: KvCacheEvent, rank: _Rank) -> None:
        ours: list[int] = []
        for engine_hash in event.removed:
            known = rank.known.pop(engine_hash, None)
            if known is None:
                self.stats.unknown_removals += 1  # a partial block, or one stored before a lost event
            else:
                ours.append(known.block_hash)
        if ours:
            self.stats.removed_blocks += len(ours)
            self.sink.blocks_removed(ours, event.dp_rank)

    def _resync(self, dp_rank: int, rank: _Rank, *, expected: int, got: int) -> None:
        self.stats.gaps += 1
        log.warning(
            "TensorRT-LLM KV event gap on dp rank %d (expected event %d, got %d): resyncing %d known blocks",
            dp_rank,
            expected,
            got,
            len(rank.known),
        )
        self.sink.all_cleared(dp_rank)
        for known in _parents_first(rank.known.values()):
            self.sink.blocks_stored([(known.block_hash, known.tokens_hash)], known.parent, dp_rank)


def _parents_first(blocks: Iterable[_Known]) -> list[_Known]:
    """Order blocks so that every parent we know comes before its children."""
    pending = list(blocks)
    ours = {k.block_hash for k in pending}
    done: set[int] = set()
    order: list[_Known] = []
    while pending:
        ready = [k for k in pending if k.parent is None or k.parent not in ours or k.parent in done]
        if not ready:  # chained hashes cannot form a cycle; emit the rest as they are
            ready = pending
        order.extend(ready)
        done.update(k.block_hash for k in ready)
        emitted = {id(k) for k in ready}
        pending = [k for k in pending if id(k) not in emitted]
    return order


# ------------------------------------------------------------------ stats


def _stat_dict(stat: Any) -> Mapping[str, Any] | None:
    if isinstance(stat, str | bytes):
        try:
            stat = json.loads(stat)
        except json.JSONDecodeError:
            return None
    return stat if isinstance(stat, Mapping) else None


def load_from_stats(stat: Any) -> LoadMetrics | None:
    """A LoadMetrics from one `get_stats_async` iteration sample (None if it has no KV stats).

    Keys from TensorRT-LLM's iteration stats JSON (`kvCacheStats.usedNumBlocks`,
    `maxNumBlocks`, `numActiveRequests`, `numQueuedRequests`; see
    NVIDIA/TensorRT-LLM `tests/unittest/llmapi/apps/_test_openai_metrics.py`).
    """
    d = _stat_dict(stat)
    kv = d.get("kvCacheStats") if d is not None else None
    if d is None or not isinstance(kv, Mapping):
        return None
    return LoadMetrics(
        active_blocks=int(kv.get("usedNumBlocks", 0)),
        total_blocks=int(kv.get("maxNumBlocks", 0)),
        waiting=int(d.get("numQueuedRequests", 0)),
        running=int(d.get("numActiveRequests", 0)),
    )


def block_size_from_stats(stat: Any) -> int:
    """`kvCacheStats.tokensPerBlock` of a stats sample (0 when absent)."""
    d = _stat_dict(stat)
    kv = d.get("kvCacheStats") if d is not None else None
    return int(kv.get("tokensPerBlock", 0)) if isinstance(kv, Mapping) else 0


def total_blocks_from_stats(stats: Sequence[Any]) -> int:
    """The largest `kvCacheStats.maxNumBlocks` among samples (0 when none has it)."""
    loads = [m for s in stats if (m := load_from_stats(s)) is not None]
    return max((m.total_blocks for m in loads), default=0)
