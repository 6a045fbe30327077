"""What the planner sees of the mesh each interval.

- **Load and SLA** from the frontends' `/metrics` (every frontend process:
  meshllm.planner.scrape), scraped directly as
  Prometheus text (no Prometheus server in between, so no scrape lag and no
  extra dependency): requests finished, prompt and output tokens, and the
  TTFT and ITL histograms. TTFT and ITL as clients see them exist only
  there; the interval's p90 interpolates within buckets as PromQL's
  `histogram_quantile` does (meshllm.served_counts), so the planner, the
  dashboard and Grafana read the same figure.
- **Workers per role** from discovery (etcd): the membership itself, what a
  worker that registered, drained or died did, not what a connector asked for.
- **Queue depth and KV usage**, when `--router-address` is given, from the
  router's `ListWorkers` (waiting sequences, active/total blocks); the
  frontend's metrics do not carry them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshllm.errors import MeshError
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.discovery.base import Discovery
from meshllm.planner.model import Observation
from meshllm.planner.scrape import SCRAPE_TIMEOUT_S, FrontendScraper, Resolver, resolve_addresses
from meshllm.router.client import RouterClient
from meshllm.served_counts import Counts, delta_buckets, quantile
from meshllm.v1 import discovery_pb2

__all__ = ["MeshReader", "WorkerLoad", "observation"]

log = logging.getLogger(__name__)

ROLE_NAMES = {
    discovery_pb2.WORKER_ROLE_AGGREGATED: "agg",
    discovery_pb2.WORKER_ROLE_PREFILL: "prefill",
    discovery_pb2.WORKER_ROLE_DECODE: "decode",
}


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The workers at one moment: how many of each role, and their queues and KV use (router's view)."""

    workers: dict[str, int]
    waiting: int = 0
    kv_usage: float | None = None
    busy: dict[str, int] = field(default_factory=dict)  # instance id -> requests the router has in flight on it


def observation(new: Counts, old: Counts, load: WorkerLoad) -> Observation:
    """One interval between two readings of the frontends' counters.

    Load is read from the latency histograms, which count as tokens stream, not from the counters a request
    adds to when it ends: a request is counted when its first token is sent (a TTFT observation), an output
    token when it is sent (an ITL observation per token after the first; further tokens of a first chunk are
    not counted). Counted at the end, a few long streams would read as bursts and silences. ISL and OSL are
    means over the requests that ended: lengths, not rates. A request ended when the frontend closed its stream
    and counted its tokens, which is when it observes its end-to-end latency: the e2e histogram counts them.
    (The requests counter also counts refusals, a 429 or a 400, that never had tokens: dividing by it would read
    an overloaded mesh's prompts as shorter, and plan too few prefill workers, just when it needs more.)
    """
    ttft = delta_buckets(new, old, "ttft")
    itl = delta_buckets(new, old, "itl")
    started = _count(ttft)
    ended = _count(delta_buckets(new, old, "e2e"))
    isl = max(0.0, new.input_tokens - old.input_tokens) / ended if ended > 0 else None
    osl = max(0.0, new.output_tokens - old.output_tokens) / ended if ended > 0 else None
    return Observation(
        at=new.at,
        interval_s=max(new.at - old.at, 1e-9),
        requests=started,
        isl=isl,
        osl=osl,
        ttft_p90_s=quantile(0.9, ttft),
        itl_p90_s=quantile(0.9, itl),
        waiting=load.waiting,
        kv_usage=load.kv_usage,
        workers=dict(load.workers),
        output_tokens=started + _count(itl),
    )


def _count(buckets: dict[float, float]) -> float:
    """Observations in a histogram's interval (its +Inf bucket)."""
    return buckets.get(math.inf, max(buckets.values(), default=0.0))


class MeshReader(AsyncCloseable):
    """Reads the frontends' counters (summed over every frontend process, meshllm.planner.scrape) and the
    workers, once per call."""

    def __init__(
        self,
        frontend_urls: Sequence[str],
        discovery: Discovery,
        *,
        api_key: str | None = None,
        router: RouterClient | None = None,
        resolve: Resolver = resolve_addresses,
    ) -> None:
        self._frontends = FrontendScraper(frontend_urls, api_key=api_key, resolve=resolve)
        self._discovery = discovery
        self._router = router

    async def counts(self, at: float) -> Counts:
        """The frontends' counters now (CannotConnect when one does not answer: a partial sum would read as a
        drop in load)."""
        return await self._frontends.counts(at)

    async def workers(self) -> WorkerLoad:
        """Workers per role from discovery; queues and KV use from the router when one is configured."""
        instances = await self._discovery.list_instances()
        counts: dict[str, int] = {}
        for inst in instances.values():
            name = ROLE_NAMES.get(inst.role)
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        if self._router is None:
            return WorkerLoad(counts)
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                resp = await self._router.list_workers()
        except (MeshError, TimeoutError) as exc:
            log.warning("router %s did not answer ListWorkers (%s); no queue or KV figures this interval",
                        self._router.address, exc or "timed out")  # fmt: skip
            return WorkerLoad(counts)
        total = sum(w.total_blocks for w in resp.workers)
        active = sum(w.active_blocks for w in resp.workers)
        waiting = sum(w.waiting for w in resp.workers)
        busy = {w.worker_id: w.in_flight for w in resp.workers}
        return WorkerLoad(counts, waiting, active / total if total else None, busy)

    async def _aclose(self) -> None:
        await self._frontends.aclose()
