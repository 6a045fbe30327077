"""The Responses API's stored responses: LRU bounded in entries and characters, with a TTL (fake clock), owned by a
tenant (another tenant's use neither finds, renews nor reorders an entry)."""

from __future__ import annotations

from meshllm.frontend.openai.response_store import ResponseStore

EMPTY = {"output": []}  # the stored Response object; its output counts 2 characters ("[]")


def put(store: ResponseStore, rid: str, text: str, tenant: str = "t") -> None:
    store.put(rid, tenant, [{"role": "user", "content": text}], EMPTY)


def test_the_least_recently_used_conversation_leaves_first() -> None:
    store = ResponseStore(max_entries=2, max_chars=1000, ttl_s=60)
    put(store, "a", "1")
    put(store, "b", "2")
    assert store.get("a", "t") is not None  # a is now the most recently used
    put(store, "c", "3")
    assert store.get("b", "t") is None and store.get("a", "t") is not None and store.get("c", "t") is not None
    assert len(store) == 2


def test_the_character_budget_evicts_and_an_oversized_conversation_is_not_kept() -> None:
    store = ResponseStore(max_entries=100, max_chars=10, ttl_s=60)
    put(store, "a", "x" * 6)
    put(store, "b", "y" * 6)
    assert store.get("a", "t") is None and store.get("b", "t") is not None and store.chars == 8
    put(store, "huge", "z" * 9)
    assert store.get("huge", "t") is None and store.get("b", "t") is not None


def test_entries_expire_ttl_after_their_last_use() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=10, max_chars=1000, ttl_s=10, clock=lambda: now[0])
    put(store, "a", "1")
    put(store, "b", "2")
    now[0] = 8.0
    assert store.get("a", "t") is not None  # used: a lives until 18
    now[0] = 12.0
    assert store.get("b", "t") is None and store.get("a", "t") is not None and store.chars == 3
    now[0] = 40.0
    assert store.get("a", "t") is None and len(store) == 0 and store.chars == 0


def test_another_tenant_neither_finds_renews_reorders_nor_deletes_an_entry() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, max_chars=1000, ttl_s=10, clock=lambda: now[0])
    put(store, "a", "1", tenant="team-a")
    put(store, "b", "2", tenant="team-a")
    now[0] = 8.0
    assert store.get("a", "team-b") is None and not store.delete("a", "team-b")
    put(store, "c", "3", tenant="team-b")  # "a" is still the least recently used: it leaves, not "b"
    assert store.get("a", "team-a") is None and store.get("b", "team-a") is not None
    now[0] = 17.0  # "b" was renewed at 8 by its owner; "c" (made at 8) too
    assert store.get("b", "team-a") is not None and store.delete("c", "team-b") and len(store) == 1
