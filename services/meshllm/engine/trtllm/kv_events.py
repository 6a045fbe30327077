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

TensorRT-LLM's block hashes are its own: `parse_event` normalizes each event
and the generic `meshllm.engine.kv_events.KvEventConverter` re-hashes stored
blocks for the router (full blocks only, resync on an event-id gap). Events
of attention layers narrower than the model's largest window are dropped, as
Dynamo's publisher does (ai-dynamo/dynamo `components/src/dynamo/trtllm/publisher.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from meshllm.engine import kv_events
from meshllm.engine.base import LoadMetrics
from meshllm.engine.kv_events import KvCacheEvent, KvEventStats, StoredBlock

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


class KvEventConverter(kv_events.KvEventConverter):
    """The generic converter (engine/kv_events.py) fed TensorRT-LLM's own event shapes: `handle(raw)`."""

    def handle(self, raw: Any) -> None:
        try:
            event = parse_event(raw)
        except (ValueError, TypeError, KeyError) as exc:
            self.stats.malformed += 1
            log.warning("dropping a malformed TensorRT-LLM KV event: %s", exc)
            return
        self.apply(event)


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
