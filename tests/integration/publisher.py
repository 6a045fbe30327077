"""A KV-event publisher in its own process, driven by tests/integration/test_events_nats.py.

    python publisher.py URL SUBJECT WORKER_ID --count N
        publish batches 1..N, flush, exit 0
    python publisher.py URL SUBJECT WORKER_ID --interval-ms 20
        publish batch 1, 2, 3, ... every interval until stdin reads "stop" or
        closes; a line "phase K" stamps later batches with dp_rank K

Prints "ready" on stdout once connected. Batch n is `make_batch(worker_id, n, phase)`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from meshllm.plane.events.nats import NatsEventBus
from meshllm.v1.events_pb2 import BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, StoredBlock


def make_batch(worker_id: str, n: int, phase: int = 0) -> KvEventBatch:
    """Batch number n: two events (ids 2n-1, 2n) exercising optional, repeated and oneof fields."""
    stored = BlocksStored(
        parent_hash=2**64 - 1 - n,  # near the top of uint64 on purpose
        blocks=[StoredBlock(block_hash=n * 1000 + i, tokens_hash=(n * 1000 + i) ^ 0xFFFF) for i in range(3)],
    )
    removed = BlocksRemoved(block_hashes=[n, n + 1])
    return KvEventBatch(
        worker_id=worker_id,
        dp_rank=phase,
        events=[KvEvent(event_id=2 * n - 1, stored=stored), KvEvent(event_id=2 * n, removed=removed)],
    )


async def _commands(state: dict[str, int], stop: asyncio.Event) -> None:
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line or line.strip() == "stop":
            stop.set()
            return
        word, _, value = line.strip().partition(" ")
        if word == "phase":
            state["phase"] = int(value)


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("subject")
    p.add_argument("worker_id")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--interval-ms", type=float, default=20.0)
    args = p.parse_args()
    bus = await NatsEventBus.connect(args.url, name=f"publisher-{args.worker_id}", reconnect_wait_s=0.1)
    print("ready", flush=True)
    try:
        if args.count:
            for n in range(1, args.count + 1):
                bus.publish(args.subject, make_batch(args.worker_id, n))
            await bus.flush(timeout_s=10)
            return 0
        state = {"phase": 0}
        stop = asyncio.Event()
        reader = asyncio.create_task(_commands(state, stop))
        n = 0
        while not stop.is_set():
            n += 1
            bus.publish(args.subject, make_batch(args.worker_id, n, state["phase"]))
            try:
                await asyncio.wait_for(stop.wait(), args.interval_ms / 1000)
            except TimeoutError:
                pass
        await reader
        return 0
    finally:
        await bus.aclose()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
