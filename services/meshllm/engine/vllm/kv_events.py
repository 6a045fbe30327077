"""vLLM's KV cache events (ZMQ) as the router's KV events.

vLLM publishes on a ZMQ PUB socket (`KVEventsConfig(publisher="zmq")`,
`vllm/distributed/kv_events.py`) multipart messages
`[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]`; a batch is
`[ts, [events...], data_parallel_rank]` and each event is tagged:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...)
    BlockRemoved(block_hashes, medium, ...)
    AllBlocksCleared()

`token_ids` are the tokens of all the stored blocks, `block_size` each. Each
event becomes a `meshllm.engine.kv_events.KvCacheEvent` (one block per
`block_size` tokens, vLLM's own hashes kept as engine hashes) and goes
through the generic converter, which re-hashes blocks with
`meshllm.protocol.kv` so the router keeps one hashing scheme. Event ids are
numbered here, one per event, and a jump in the batch sequence number (a
message ZMQ dropped) skips an id so the converter resyncs the router. Events
of another medium than the device's ("GPU", which vLLM also says on CPU)
or of another KV cache group than the first are not for the router and are
dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from meshllm.engine.base import EngineSink
from meshllm.engine.kv_events import KvCacheEvent, KvEventConverter, StoredBlock

__all__ = ["VllmKvEvents", "events_of_batch"]

log = logging.getLogger(__name__)

_DEVICE_MEDIA = (None, "GPU")


def _tag(event: Any) -> str:
    return str(event.get("type", "")) if isinstance(event, dict) else type(event).__name__


def _get(event: Any, name: str, default: Any = None) -> Any:
    """A field of an event decoded typed (an attribute) or as a plain map."""
    return event.get(name, default) if isinstance(event, dict) else getattr(event, name, default)


def events_of_batch(events: Sequence[Any], dp_rank: int, first_id: int) -> list[KvCacheEvent]:
    """The normalized events of one batch, numbered from `first_id` (dropped ones keep their number)."""
    out: list[KvCacheEvent] = []
    for offset, ev in enumerate(events):
        eid = first_id + offset
        tag = _tag(ev)
        if tag == "BlockStored":
            medium, group = _get(ev, "medium"), _get(ev, "group_idx")
            if medium not in _DEVICE_MEDIA or group not in (None, 0):
                out.append(KvCacheEvent(event_id=eid, kind="skipped", dp_rank=dp_rank))
                continue
            hashes = list(_get(ev, "block_hashes", ()))
            tokens = list(_get(ev, "token_ids", ()))
            size = int(_get(ev, "block_size", 0) or 0)
            parent = _get(ev, "parent_block_hash")
            blocks = tuple(
                StoredBlock(engine_hash=_hash(h), tokens=tuple(tokens[i * size : (i + 1) * size])) for i, h in enumerate(hashes)
            )
            out.append(KvCacheEvent(event_id=eid, kind="stored", dp_rank=dp_rank, parent_hash=_hash(parent), blocks=blocks))
        elif tag == "BlockRemoved":
            medium, group = _get(ev, "medium"), _get(ev, "group_idx")
            if medium not in _DEVICE_MEDIA or group not in (None, 0):
                out.append(KvCacheEvent(event_id=eid, kind="skipped", dp_rank=dp_rank))
                continue
            removed = tuple(h for h in (_hash(x) for x in _get(ev, "block_hashes", ())) if h is not None)
            out.append(KvCacheEvent(event_id=eid, kind="removed", dp_rank=dp_rank, removed=removed))
        elif tag == "AllBlocksCleared":
            out.append(KvCacheEvent(event_id=eid, kind="cleared", dp_rank=dp_rank))
        else:
            out.append(KvCacheEvent(event_id=eid, kind="unknown", dp_rank=dp_rank))
    return out


def _hash(value: Any) -> int | None:
    """vLLM's external block hash: an int, or bytes (newer hash functions) folded to an int."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[:8], "big")
    return int(value)


class VllmKvEvents:
    """Subscribes to vLLM's KV event socket and feeds a sink with router hashes; `run()` until cancelled."""

    def __init__(self, sink: EngineSink, block_size: int, endpoint: str, topic: str = "kv") -> None:
        self.converter = KvEventConverter(sink, block_size)
        self.endpoint = endpoint
        self.topic = topic
        self.batches = 0
        self._next_id: dict[int, int] = {}
        self._last_seq: int | None = None
        self._ctx: Any = None
        self._sock: Any = None
        self.ready = asyncio.Event()

    def open(self) -> None:
        """Connect the SUB socket (before vLLM starts publishing: ZMQ's slow-joiner problem loses early messages)."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sock.connect(self.endpoint)

    async def run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        if self._sock is None:
            self.open()
        self.ready.set()
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) < 3:
                continue
            try:
                seq = int.from_bytes(frames[1], "big")
                batch = decoder.decode(frames[2])
            except (ValueError, msgspec.DecodeError) as exc:
                log.warning("dropping an undecodable vLLM KV event batch: %s", exc)
                continue
            self.feed(seq, batch.events, int(getattr(batch, "data_parallel_rank", 0) or 0))

    def feed(self, seq: int, events: Sequence[Any], dp_rank: int) -> None:
        """Apply one batch (sequence number `seq`): a gap since the last batch resyncs the router."""
        self.batches += 1
        first = self._next_id.get(dp_rank, 0)
        if self._last_seq is not None and seq > self._last_seq + 1:
            first += 1  # an id the converter never sees: it resyncs before the next event
        self._last_seq = seq
        for event in events_of_batch(events, dp_rank, first):
            self.converter.apply(event)
        self._next_id[dp_rank] = first + len(events)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
