"""WorkerSink load samples: an unchanged load is published again, so a router that starts later learns it.

Locks: the latest sample is republished after `LOAD_REFRESH_S` without one
(an idle engine reports no change), with a fresh timestamp; closing the sink
stops the refresh. A sample the 100 ms throttle holds back is stamped with the
time the engine took it, not the time it went out (a router subtracts the
requests that ended after the stamp).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_worker_sink_batching import RecordingBus

from meshllm.engine.base import LoadMetrics
from meshllm.v1 import events_pb2
from meshllm.worker import sink as sink_mod
from meshllm.worker.sink import WorkerSink


async def test_an_unchanged_load_is_published_again_until_the_sink_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_mod, "LOAD_REFRESH_S", 0.05)
    bus = RecordingBus()
    sink = WorkerSink("w1", bus, namespace="ns", component="backend")
    sink.load(LoadMetrics(active_blocks=7, total_blocks=100, waiting=0, running=0))
    assert len(bus.published) == 1  # the first sample goes at once
    bus.arrived.clear()
    await asyncio.wait_for(bus.arrived.wait(), timeout=5)  # no new sample: the same one again
    first, again = bus.published[0], bus.published[1]
    assert isinstance(first, events_pb2.LoadSnapshot) and isinstance(again, events_pb2.LoadSnapshot)
    assert (again.worker_id, again.active_blocks, again.total_blocks) == ("w1", 7, 100)
    assert again.timestamp_ms >= first.timestamp_ms

    sink.close()
    count = len(bus.published)
    bus.arrived.clear()
    with pytest.raises(TimeoutError):  # several refresh intervals pass: nothing more after close
        await asyncio.wait_for(bus.arrived.wait(), timeout=0.3)
    assert len(bus.published) == count


async def test_a_held_back_sample_carries_the_time_it_was_taken() -> None:
    bus = RecordingBus()
    sink = WorkerSink("w1", bus, namespace="ns", component="backend")
    sink.load(LoadMetrics(active_blocks=240, total_blocks=4096, waiting=0, running=8))
    assert len(bus.published) == 1
    bus.arrived.clear()
    before = time.time()
    sink.load(LoadMetrics(active_blocks=0, total_blocks=4096, waiting=0, running=0))  # within the interval: held
    after = time.time()
    assert len(bus.published) == 1
    await asyncio.wait_for(bus.arrived.wait(), timeout=5)
    sent_at = time.time()
    held = bus.published[1]
    assert isinstance(held, events_pb2.LoadSnapshot) and held.running == 0
    assert int(before * 1000) <= held.timestamp_ms <= int(after * 1000) + 1
    assert sent_at - after >= sink_mod.LOAD_INTERVAL_S / 2  # it really was held: the stamp is not the send time
    sink.close()
