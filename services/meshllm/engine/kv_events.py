"""Engine KV cache events re-hashed for the router, whatever engine reported them.

Engines (TensorRT-LLM, vLLM) name KV blocks by hashes of their own; the router
hashes prompts with `meshllm.protocol.kv`. `KvEventConverter.apply` takes
normalized `KvCacheEvent`s (each engine's adapter builds them from its own
shapes: trtllm/kv_events.py, vllm/kv_events.py) and feeds an `EngineSink`:
every stored block is re-hashed from its token ids (tokens hash, chained onto
our hash of its parent), and a per-rank map from engine hash to our hash
translates parents and removals. Only full blocks (exactly `block_size`
tokens) are kept: a partial block ends the stored run, never enters the map,
and its later removal is dropped as unknown.

Event-id continuity (per data-parallel rank). On a gap we cannot know what the
lost events stored or removed, so we **resync**: `all_cleared` for that rank,
then re-store every block still in the map (parents first), then apply the new
event. Chosen over "log and carry on" because the router's view is then at
least a subset-or-equal of what we know rather than a silent drift; the cost is
that blocks removed inside the lost range stay advertised until the next
resync (a router that trusts them pays one cache miss). Blocks stored inside
the lost range are unknown parents for later events; those events are dropped
(counted in `stats.unknown_parents`) because their chained hashes cannot be
computed. A "cleared" event (every block dropped) clears the rank's map and
the router's view alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from meshllm.engine.base import EngineSink
from meshllm.protocol.kv import chain_hash, tokens_hash

__all__ = ["KvCacheEvent", "KvEventConverter", "KvEventStats", "StoredBlock"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    engine_hash: int | None
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCacheEvent:
    """One engine KV cache event, normalized."""

    event_id: int
    kind: str  # "created" | "stored" | "removed" | "cleared" | "updated" (anything else is ignored)
    dp_rank: int = 0
    window_size: int | None = None
    parent_hash: int | None = None
    blocks: tuple[StoredBlock, ...] = ()
    removed: tuple[int, ...] = ()
    num_blocks: tuple[int, ...] = ()


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
    """Feeds normalized KV events to an EngineSink with router-compatible hashes.

    `apply` is synchronous and never raises for odd input (it logs and counts),
    so one bad event cannot stop the loop that reads them.
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

    def known_blocks(self) -> int:
        """Full blocks the engine holds as the events so far leave them (every rank)."""
        return sum(len(rank.known) for rank in self._ranks.values())

    def apply(self, event: KvCacheEvent) -> None:
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
        elif event.kind == "cleared":
            rank.known.clear()
            self.sink.all_cleared(event.dp_rank)
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
                    "(is the KV block size the engine's?)",
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
            "KV event gap on dp rank %d (expected event %d, got %d): resyncing %d known blocks",
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
