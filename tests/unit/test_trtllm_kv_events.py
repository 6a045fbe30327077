"""TensorRT-LLM KV cache events → EngineSink calls with the router's hashes (meshllm.protocol.kv)."""

from __future__ import annotations

import json

from test_trtllm_fakes import (
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    Sink,
    UniqueToken,
    created_event,
    iteration_stats,
    removed_event,
    stored_event,
    updated_event,
)

from meshllm.engine.trtllm.kv_events import (
    KvEventConverter,
    block_size_from_stats,
    load_from_stats,
    parse_event,
    total_blocks_from_stats,
)
from meshllm.protocol.kv import block_hashes, stored_blocks

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks of 4 + 1 partial token


def blocks_of(tokens: list[int]) -> list[tuple[int, list[int]]]:
    """(engine hash, tokens) per block; engine hashes are arbitrary, unlike ours."""
    return [(9000 + i, tokens[i * BS : (i + 1) * BS]) for i in range((len(tokens) + BS - 1) // BS)]


def converter() -> tuple[KvEventConverter, Sink]:
    sink = Sink()
    return KvEventConverter(sink, BS), sink


def test_stored_blocks_get_the_routers_hashes_from_their_token_ids() -> None:
    """Our (block_hash, tokens_hash) pairs equal meshllm.protocol.kv.stored_blocks of the same tokens."""
    conv, sink = converter()
    conv.handle(stored_event(0, None, blocks_of(PROMPT[:12])))
    assert sink.stored == [(stored_blocks(PROMPT[:12], BS), None, 0)]


def test_a_partial_block_is_never_stored_and_its_removal_is_dropped() -> None:
    conv, sink = converter()
    conv.handle(stored_event(0, None, blocks_of(PROMPT)))  # 3 full + 1 partial
    assert [bh for bh, _ in sink.stored[0][0]] == block_hashes(PROMPT, BS)
    assert conv.stats.partial_blocks == 1
    conv.handle(removed_event(1, [9003]))  # the partial block's engine hash
    assert sink.removed == [] and conv.stats.unknown_removals == 1


def test_a_continuation_chains_onto_our_hash_of_its_parent() -> None:
    """A later stored event names its parent by engine hash; we chain onto our hash of that parent."""
    conv, sink = converter()
    conv.handle(stored_event(0, None, blocks_of(PROMPT[:8])))
    conv.handle(stored_event(1, 9001, [(7777, PROMPT[8:12])]))
    full = stored_blocks(PROMPT[:12], BS)
    assert sink.stored[1] == ([full[2]], full[1][0], 0)


def test_removals_translate_engine_hashes_to_ours() -> None:
    conv, sink = converter()
    conv.handle(stored_event(0, None, blocks_of(PROMPT[:12])))
    conv.handle(removed_event(1, [9002, 9001]))
    ours = block_hashes(PROMPT[:12], BS)
    assert sink.removed == [([ours[2], ours[1]], 0)]
    conv.handle(removed_event(2, [9002]))  # already gone
    assert len(sink.removed) == 1


def test_an_event_id_gap_clears_and_restores_what_is_known_parents_first() -> None:
    """Chosen gap policy: all_cleared, re-store every known block (parents first), then apply the event."""
    conv, sink = converter()
    conv.handle(stored_event(10, None, blocks_of(PROMPT[:12])))
    conv.handle(removed_event(11, [9002]))
    sink.stored.clear()
    conv.handle(stored_event(15, 9001, [(5555, [1, 2, 3, 4])]))  # 12..14 were lost
    ours = stored_blocks(PROMPT[:8], BS)
    assert sink.cleared == [0] and conv.stats.gaps == 1
    assert sink.stored[:2] == [([ours[0]], None, 0), ([ours[1]], ours[0][0], 0)]
    assert sink.stored[2][1] == ours[1][0]  # then the new event, chained onto block 1
    conv.handle(removed_event(16, [5555]))
    assert conv.stats.gaps == 1  # continuity restored


def test_a_stored_event_whose_parent_is_unknown_is_dropped() -> None:
    """After lost events a parent may be unknown: its chained hash cannot be computed, so nothing is sent."""
    conv, sink = converter()
    conv.handle(stored_event(0, 4242, blocks_of(PROMPT[:4])))
    assert sink.stored == [] and conv.stats.unknown_parents == 1


def test_an_oversized_block_drops_the_event() -> None:
    """A block longer than the block size means the sizes disagree; no wrong hashes are published."""
    conv, sink = converter()
    conv.handle(stored_event(0, None, [(1, list(range(BS + 1)))]))
    assert sink.stored == [] and conv.stats.oversized_blocks == 1


def test_binding_objects_and_json_strings_convert_like_serialized_dicts() -> None:
    """get_kv_cache_events_async yields dicts; the C++ binding objects and JSON text are accepted too."""
    tokens = PROMPT[:8]
    obj = KVCacheEvent(
        event_id=0,
        window_size=None,
        attention_dp_rank=None,
        data=KVCacheStoredData(
            parent_hash=None,
            blocks=[
                KVCacheStoredBlockData(
                    block_hash=h, tokens=[UniqueToken(token_id=t, token_extra_id=0) for t in toks], cache_level=0, priority=35
                )
                for h, toks in blocks_of(tokens)
            ],
        ),
    )
    assert parse_event(obj) == parse_event(stored_event(0, None, blocks_of(tokens)))
    assert parse_event(json.dumps(stored_event(0, None, blocks_of(tokens)))) == parse_event(obj)
    removed = KVCacheEvent(event_id=3, data=KVCacheRemovedData(block_hashes=[1, 2]))
    assert parse_event(removed).removed == (1, 2)


def test_events_are_tracked_per_attention_dp_rank() -> None:
    conv, sink = converter()
    conv.handle(stored_event(0, None, blocks_of(PROMPT[:4]), attention_dp_rank=0))
    conv.handle(stored_event(0, None, blocks_of(PROMPT[:4]), attention_dp_rank=1))
    conv.handle(stored_event(1, None, blocks_of(PROMPT[4:8]), attention_dp_rank=1))
    assert [rank for _, _, rank in sink.stored] == [0, 1, 1] and conv.stats.gaps == 0


def test_events_of_narrower_attention_windows_are_dropped() -> None:
    """As Dynamo's publisher: the initial "created" events give the largest window; others are ignored."""
    conv, sink = converter()
    conv.handle(created_event(0, 500, window_size=128))
    conv.handle(created_event(1, 800, window_size=4096))
    conv.handle(stored_event(2, None, blocks_of(PROMPT[:4]), window_size=128))
    conv.handle(stored_event(3, None, blocks_of(PROMPT[:4]), window_size=4096))
    assert len(sink.stored) == 1 and conv.stats.dropped_window == 1 and conv.stats.gaps == 0
    assert conv.total_blocks == 500


def test_updated_and_malformed_events_change_nothing() -> None:
    conv, sink = converter()
    conv.handle(stored_event(0, None, blocks_of(PROMPT[:4])))
    conv.handle(updated_event(1, 9000))
    conv.handle({"no": "event"})
    assert len(sink.stored) == 1 and not sink.removed and not sink.cleared
    assert conv.stats.malformed == 1 and conv.stats.gaps == 0


def test_iteration_stats_become_load_metrics() -> None:
    stat = iteration_stats(12, 1000, active=3, queued=2, tokens_per_block=64)
    load = load_from_stats(stat)
    assert load is not None
    assert (load.active_blocks, load.total_blocks, load.running, load.waiting) == (12, 1000, 3, 2)
    assert load_from_stats(json.dumps(stat)) == load
    assert load_from_stats({"iter": 1}) is None and load_from_stats("not json") is None
    assert block_size_from_stats(stat) == 64 and block_size_from_stats({}) == 0
    assert total_blocks_from_stats([{"iter": 0}, stat]) == 1000 and total_blocks_from_stats([]) == 0
