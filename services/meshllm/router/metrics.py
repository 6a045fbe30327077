"""Prometheus metrics of one RouterCore (its own registry, so several routers share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from meshllm.router.recent import RecentActivity

__all__ = ["RouterMetrics"]

disable_created_metrics()  # no `_created` series (see frontend/metrics.py)

_OVERLAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RouterMetrics:
    """Decisions, overlap, index size and churn, migrations, disaggregation.

    `recent` keeps the last decisions and events for the live mesh page (router/recent.py).
    """

    def __init__(self, router_id: str, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.recent = RecentActivity()
        r = self.registry
        base = {"router_id": router_id}
        names = list(base)
        self.decisions = Counter("meshllm_router_decisions", "Routing decisions", [*names, "policy", "role"], registry=r)
        self._base = base
        self.overlap_blocks = Histogram(
            "meshllm_router_overlap_blocks", "Cached prompt blocks on the chosen worker", names,
            buckets=_OVERLAP_BUCKETS, registry=r,
        ).labels(**base)  # fmt: skip
        self.index_blocks = Gauge("meshllm_router_kv_index_blocks", "Distinct block hashes in the KV index", names,
                                  registry=r).labels(**base)  # fmt: skip
        self.events_applied = Counter("meshllm_router_kv_events_applied", "Block events applied to the KV index", names,
                                      registry=r).labels(**base)  # fmt: skip
        self.resyncs = Counter("meshllm_router_kv_resyncs", "KV index resyncs from worker snapshots", names,
                               registry=r).labels(**base)  # fmt: skip
        self.migrations = Counter("meshllm_router_migrations", "Streams moved to another worker", names,
                                  registry=r).labels(**base)  # fmt: skip
        self.requests = Counter("meshllm_router_requests", "Generate requests", names, registry=r).labels(**base)
        self.errors = Counter("meshllm_router_request_errors", "Generate requests that failed", names,
                              registry=r).labels(**base)  # fmt: skip
        self.workers = Gauge("meshllm_router_workers", "Workers in the pool", names, registry=r).labels(**base)
        self.local_prefills = Counter(
            "meshllm_router_disagg_local_prefills", "Disaggregated requests prefilled on the decode worker", names,
            registry=r,
        ).labels(**base)  # fmt: skip

    def decided(self, policy: str, role: str, overlap_blocks: int) -> None:
        self.decisions.labels(**self._base, policy=policy, role=role).inc()
        self.overlap_blocks.observe(overlap_blocks)
