"""Worker metrics show each lower KV tier's blocks, bytes and budget, labelled by tier."""

from __future__ import annotations

from prometheus_client import generate_latest

from meshllm.worker.metrics import WorkerMetrics


def test_tier_usage_is_exposed_per_tier_and_the_latest_sample_wins() -> None:
    m = WorkerMetrics("w1")
    m.tier_usage("host", blocks=3, bytes_used=3072, bytes_capacity=4096)
    m.tier_usage("disk", blocks=9, bytes_used=9216, bytes_capacity=65536)
    m.tier_usage("host", blocks=4, bytes_used=4096, bytes_capacity=4096)
    text = generate_latest(m.registry).decode()
    assert 'meshllm_worker_kv_tier_blocks{tier="host",worker_id="w1"} 4.0' in text
    assert 'meshllm_worker_kv_tier_bytes{tier="host",worker_id="w1"} 4096.0' in text
    assert 'meshllm_worker_kv_tier_capacity_bytes{tier="disk",worker_id="w1"} 65536.0' in text
    assert 'meshllm_worker_kv_tier_blocks{tier="disk",worker_id="w1"} 9.0' in text
