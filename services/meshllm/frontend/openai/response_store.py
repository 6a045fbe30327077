"""The Responses API's stored responses: owned by a tenant, an LRU bounded in entries and characters, expiring."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["MAX_STORED_CHARS", "MAX_STORED_RESPONSES", "STORED_TTL_S", "ResponseStore", "StoredResponse"]

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 32 * 1024 * 1024  # message text over all stored conversations (~32 MB, plus per-message overhead)
STORED_TTL_S = 3600.0


@dataclass(slots=True)
class StoredResponse:
    """One stored response: its owner, the conversation it ends, and the Response object as answered."""

    tenant: str
    messages: tuple[dict[str, Any], ...]
    response: dict[str, Any]
    size: int
    expires: float


class ResponseStore:
    """Responses by id, each owned by a tenant: an LRU bounded in entries and characters, each expiring `ttl_s`
    after last use. Another tenant's entry is never returned, touched or dropped: to it the id is unknown."""

    def __init__(
        self,
        max_entries: int = MAX_STORED_RESPONSES,
        max_chars: int = MAX_STORED_CHARS,
        ttl_s: float = STORED_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str, tenant: str) -> StoredResponse | None:
        """Response `rid` of `tenant` (its use renews it), None when unknown, expired or another tenant's."""
        self._expire()
        entry = self._items.get(rid)
        if entry is None or entry.tenant != tenant:
            return None
        entry.expires = self._clock() + self.ttl_s
        self._items.move_to_end(rid)
        return entry

    def put(self, rid: str, tenant: str, messages: Sequence[dict[str, Any]], response: dict[str, Any]) -> None:
        size = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages)
        size += len(orjson.dumps(response["output"]))
        if size > self.max_chars:
            return  # larger than the whole store: not kept (a later previous_response_id gets a 404)
        self._drop(rid)
        self._items[rid] = StoredResponse(tenant, tuple(messages), response, size, self._clock() + self.ttl_s)
        self.chars += size
        while len(self._items) > self.max_entries or self.chars > self.max_chars:
            self._drop(next(iter(self._items)))

    def delete(self, rid: str, tenant: str) -> bool:
        """Forget response `rid` of `tenant`; False when unknown, expired or another tenant's."""
        if self.get(rid, tenant) is None:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self.chars -= entry.size

    def _expire(self) -> None:
        now = self._clock()
        # Entries are in last-use order and every use extends by the same TTL: expired ones lead.
        while self._items:
            rid, entry = next(iter(self._items.items()))
            if entry.expires > now:
                return
            self._drop(rid)
