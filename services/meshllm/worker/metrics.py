"""Prometheus metrics of one worker (its own registry, so several workers share a process)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

__all__ = ["WorkerMetrics"]

disable_created_metrics()  # no `_created` series (see frontend/metrics.py)


class _LabelledRegistry(CollectorRegistry):
    """A registry that adds `extra` labels to every sample it exposes (the model and role, known after start)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra: dict[str, str] = {}

    def collect(self) -> Iterable[Any]:
        extra = self.extra
        for family in super().collect():
            if extra:
                family.samples = [s._replace(labels={**s.labels, **extra}) for s in family.samples]
            yield family


class WorkerMetrics:
    """Lifecycle gauges, load, aborts and KV transfer bytes, labelled by worker (and model and role once known)."""

    def __init__(self, worker_id: str) -> None:
        self._labelled = _LabelledRegistry()
        self.registry: CollectorRegistry = self._labelled
        labels = {"worker_id": worker_id}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self._labelled).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self._labelled).labels(**labels)

        self.model_load_time = gauge("meshllm_worker_model_load_time_seconds", "Seconds engine.start() took")
        self.drain_time = gauge("meshllm_worker_drain_time_seconds", "Seconds the last shutdown spent draining in-flight work")
        self.cleanup_time = gauge("meshllm_worker_cleanup_time_seconds", "Seconds engine.cleanup() took")
        self.inflight = gauge("meshllm_worker_inflight_requests", "Requests in flight")
        self.kv_active_blocks = gauge("meshllm_worker_kv_active_blocks", "KV blocks in use")
        self.kv_total_blocks = gauge("meshllm_worker_kv_total_blocks", "KV blocks in the cache")
        self.kv_usage = gauge("meshllm_worker_kv_usage_ratio", "Fraction of KV blocks in use")
        self.waiting = gauge("meshllm_worker_waiting_requests", "Sequences waiting for admission")
        self.running = gauge("meshllm_worker_running_requests", "Sequences running")
        self.requests = counter("meshllm_worker_requests", "Generate requests accepted")
        self.aborts = counter("meshllm_worker_aborts", "Requests aborted (cancel or Abort)")
        self.kv_transfer_bytes = counter("meshllm_worker_kv_transfer_bytes", "KV bytes served by PullKv")
        self.kv_events = counter("meshllm_worker_kv_events", "KV events published")
        self.health_failures = counter("meshllm_worker_health_check_failures", "Failed canary requests")
        tier_labels = [*labels, "tier"]
        self._tier_blocks = Gauge(
            "meshllm_worker_kv_tier_blocks", "KV blocks held in a lower tier (host, disk)", tier_labels, registry=self._labelled
        )
        self._tier_bytes = Gauge(
            "meshllm_worker_kv_tier_bytes", "Bytes used in a lower KV tier", tier_labels, registry=self._labelled
        )
        self._tier_capacity = Gauge(
            "meshllm_worker_kv_tier_capacity_bytes", "Byte budget of a lower KV tier", tier_labels, registry=self._labelled
        )
        self._worker_id = worker_id

    def tier_usage(self, tier: str, *, blocks: int, bytes_used: int, bytes_capacity: int) -> None:
        """The latest usage of lower tier `tier` ("host", "disk")."""
        labels = {"worker_id": self._worker_id, "tier": tier}
        self._tier_blocks.labels(**labels).set(blocks)
        self._tier_bytes.labels(**labels).set(bytes_used)
        self._tier_capacity.labels(**labels).set(bytes_capacity)

    def label(self, *, model: str, role: str) -> None:
        """Add `model` and `role` to every series from now on (called once the model card is known)."""
        self._labelled.extra = {"model": model, "role": role}
