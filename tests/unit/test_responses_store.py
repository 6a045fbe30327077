"""The Responses API's stored conversations: LRU bounded in entries and characters, with a TTL (fake clock)."""

from __future__ import annotations

from meshllm.frontend.responses_api import ResponseStore


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_the_least_recently_used_conversation_leaves_first() -> None:
    store = ResponseStore(max_entries=2, max_chars=1000, ttl_s=60)
    store.put("a", msgs("1"))
    store.put("b", msgs("2"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", msgs("3"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None and len(store) == 2


def test_the_character_budget_evicts_and_an_oversized_conversation_is_not_kept() -> None:
    store = ResponseStore(max_entries=100, max_chars=10, ttl_s=60)
    store.put("a", msgs("x" * 6))
    store.put("b", msgs("y" * 6))
    assert store.get("a") is None and store.get("b") is not None and store.chars == 6
    store.put("huge", msgs("z" * 11))
    assert store.get("huge") is None and store.get("b") is not None


def test_entries_expire_ttl_after_their_last_use() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=10, max_chars=1000, ttl_s=10, clock=lambda: now[0])
    store.put("a", msgs("1"))
    store.put("b", msgs("2"))
    now[0] = 8.0
    assert store.get("a") is not None  # used: a lives until 18
    now[0] = 12.0
    assert store.get("b") is None and store.get("a") is not None and store.chars == 1
    now[0] = 40.0
    assert store.get("a") is None and len(store) == 0 and store.chars == 0
