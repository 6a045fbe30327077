"""SlotTable: prefix placement across llama.cpp slots and the KV events it reports (no llama.cpp needed)."""

from __future__ import annotations

from meshllm.engine.llamacpp.slots import BlocksRemoved, BlocksStored, SlotTable, common_prefix
from meshllm.protocol.kv import stored_blocks

BS = 4


def stored(table: SlotTable) -> list[int]:
    return [bh for ev in table.drain_events() if isinstance(ev, BlocksStored) for bh, _ in ev.blocks]


def test_common_prefix_is_capped_and_exact() -> None:
    """Locks: the match length is the longest equal prefix, never beyond the limit."""
    assert common_prefix([1, 2, 3, 4], [1, 2, 9], 10) == 2
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4], 3) == 3
    assert common_prefix([5], [1], 10) == 0
    assert common_prefix(list(range(100)), [*range(57), -1], 1000) == 57


def test_extend_reports_full_blocks_with_the_shared_hashes() -> None:
    """Locks: BlocksStored carries exactly meshllm.protocol.kv's chained hashes of full blocks, in order."""
    t = SlotTable(2, BS)
    slot = t.slots[0]
    t.extend(slot, [1, 2, 3])
    assert t.drain_events() == []  # no full block yet
    t.extend(slot, [4, 5, 6, 7, 8, 9])
    events = t.drain_events()
    assert events == [BlocksStored(stored_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS), None)]
    t.extend(slot, [10, 11, 12])
    (ev,) = t.drain_events()
    assert isinstance(ev, BlocksStored)
    assert ev.parent_hash == events[0].blocks[-1][0]  # type: ignore[union-attr]
    assert ev.blocks == stored_blocks(list(range(1, 13)), BS)[2:]


def test_a_new_prompt_is_copied_from_the_slot_holding_its_longest_prefix() -> None:
    """Locks: a longer prefix in a busy slot is copied into a free one; the shared blocks are not stored again."""
    t = SlotTable(3, BS)
    a = t.slots[0]
    t.claim(a)
    t.extend(a, list(range(20)))
    t.drain_events()
    prompt = [*range(13), 99, 98]
    p = t.place(prompt, min_copy_gain=BS)
    assert p is not None and p.source is a and p.reuse == 13 and p.target is not a
    t.claim(p.target)
    t.copy(a, p.target, p.reuse)
    assert t.drain_events() == []
    t.extend(p.target, prompt[13:])
    fresh = stored(t)
    assert fresh == [bh for bh, _ in stored_blocks(prompt, BS)[3:]]


def test_a_free_slot_with_the_prefix_is_reused_in_place_and_reuse_stops_before_the_last_token() -> None:
    """Locks: in-place reuse is preferred within min_copy_gain, and at most len(prompt) - 1 tokens are reused."""
    t = SlotTable(2, BS)
    a = t.slots[1]
    t.extend(a, list(range(10)))
    p = t.place(list(range(10)), min_copy_gain=BS)
    assert p is not None and p.target is a and p.source is None and p.reuse == 9


def test_empty_free_slots_are_victims_before_cached_ones() -> None:
    """Locks: a prompt with no cached prefix takes an empty slot, keeping other slots' cache."""
    t = SlotTable(3, BS)
    t.extend(t.slots[0], [1, 2, 3, 4])
    t.release(t.slots[0])
    p = t.place([7, 8, 9], min_copy_gain=BS)
    assert p is not None and p.target is not t.slots[0] and p.reuse == 0


def test_a_block_leaves_the_cache_only_when_its_last_slot_drops_it() -> None:
    """Locks: reference counting across slots: BlocksRemoved only for blocks no slot holds."""
    t = SlotTable(2, BS)
    a, b = t.slots
    t.extend(a, list(range(8)))
    t.copy(a, b, 8)
    t.drain_events()
    t.truncate(a, 4)
    assert t.drain_events() == []
    t.truncate(b, 0)
    (ev,) = t.drain_events()
    assert isinstance(ev, BlocksRemoved)
    assert ev.block_hashes == [stored_blocks(list(range(8)), BS)[1][0]]
    assert t.num_cached_blocks == 1  # a still holds the first block


def test_all_slots_busy_means_no_placement() -> None:
    t = SlotTable(1, BS)
    t.claim(t.slots[0])
    assert t.place([1, 2], min_copy_gain=BS) is None


def test_without_caching_nothing_is_reused_or_reported() -> None:
    """Locks: --no-enable-prefix-caching: no reuse, no KV events."""
    t = SlotTable(2, BS, caching=False)
    t.extend(t.slots[0], list(range(12)))
    assert t.drain_events() == []
    p = t.place(list(range(12)), min_copy_gain=BS)
    assert p is not None and p.reuse == 0


def test_a_short_match_never_truncates_a_cached_prefix_it_would_mostly_drop() -> None:
    """Locks: a 1-token health-check canary between two requests sharing a long prefix goes to another slot, so the
    second request still finds the prefix (the canary [1, 2, 3, 4] shares only <|im_start|> with every chat)."""
    t = SlotTable(4, BS)

    def serve(tokens: list[int], out: int) -> int:
        p = t.place(tokens, min_copy_gain=BS)
        assert p is not None
        t.claim(p.target)
        if p.source is not None:
            t.copy(p.source, p.target, p.reuse)
        else:
            t.truncate(p.target, p.reuse)
        t.extend(p.target, tokens[p.reuse :])
        t.extend(p.target, list(range(900, 900 + out)))
        t.release(p.target)
        return p.reuse

    prefix = [1, *range(100, 160)]
    assert serve([*prefix, 7, 8], 5) == 0
    assert serve([1, 2, 3, 4], 1) == 0  # an empty slot, not the chat's
    assert serve([*prefix, 9, 10], 5) == len(prefix)
    assert serve([1, 2, 3, 4], 1) == 3  # its own slot again
    assert serve([1, *range(200, 260)], 5) == 0  # shares one token: an empty slot, the prefix stays
    assert serve([*prefix, 11, 12], 5) == len(prefix)
