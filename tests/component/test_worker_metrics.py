"""The worker's Prometheus metrics: every name carries `meshllm_worker_`, and the KV events counter moves (issue 14)."""

from __future__ import annotations

from prometheus_client import generate_latest

from meshllm.engine.mocker import MockerEngine
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.plane.request.channels import ChannelCache
from meshllm.testing.waiting import wait_until
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

BLOCK_SIZE = 16


async def test_kv_events_total_counts_every_published_event_and_every_name_is_prefixed() -> None:
    engine, config = await MockerEngine.from_args(
        ["--discovery", "memory", "--events", "memory", "--block-size", str(BLOCK_SIZE), "--speedup-ratio", "0"]
    )
    async with await Worker.start(engine, config, memory_store=MemoryStore(), memory_broker=MemoryBroker()) as worker:
        registry = worker.metrics.registry
        assert worker.model_card is not None
        labels = {"worker_id": worker.id, "model": worker.model_card.name, "role": "agg"}  # every series: worker, model, role

        def kv_events() -> float:
            return registry.get_sample_value("meshllm_worker_kv_events_total", labels) or 0.0

        assert kv_events() == 0
        async with ChannelCache() as channels:
            request = {"request_id": "r", "token_ids": list(range(100, 100 + 4 * BLOCK_SIZE)), "stop": {"max_tokens": 2}}
            chunks = [c async for c in WorkerClient(channels, worker.address).generate(request)]  # type: ignore[arg-type]
        assert chunks[-1]["finish_reason"] == "length"
        assert worker.sink is not None
        # The prompt's 4 full blocks were stored: events were published, and the counter says how many.
        await wait_until(lambda: worker.sink is not None and worker.sink.events_published > 0, what="KV events published")
        await wait_until(lambda: kv_events() == worker.sink.events_published, what="the counter to follow")  # type: ignore[union-attr]
        assert kv_events() >= 1

        names = {line.split("{")[0].split(" ")[0] for line in generate_latest(registry).decode().splitlines()}
        names = {n for n in names if n and not n.startswith("#")}
        assert {
            "meshllm_worker_model_load_time_seconds",
            "meshllm_worker_drain_time_seconds",
            "meshllm_worker_cleanup_time_seconds",
        } <= names
        assert all(n.startswith("meshllm_worker_") for n in names), sorted(names)
