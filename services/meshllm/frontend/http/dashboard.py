"""The live mesh page: `GET /dashboard` (HTML, script, style from the package) over `GET /dashboard/state` (JSON).

The page polls the state once a second and draws it; no build step, nothing
fetched from elsewhere. The state holds:

- `workers`: every worker by model and role with its health, KV usage,
  running/waiting sequences, requests in flight and queued prefill tokens —
  from the embedded routing core's pool and load tracker, or, when the
  frontend routes through `--router-address`, from `Router.ListWorkers` of
  the first replica that answers (the router's view; health checks are
  the router's own and not in that answer);
- `decisions`: the routing core's recent decisions (one per leg), each
  candidate with the terms of its cost — the same as `Router.Route`
  explains (router/recent.py); a remote router keeps its own;
- `events`: migrations, KV index resyncs and gaps (from the routing core),
  and workers joining, leaving, failing or passing health checks (seen
  here, by comparing one second's workers with the next's);
- `planner`: the SLA planner's leader, targets and recent scaling decisions
  with their reasons, read from etcd every few seconds (planner_panel.py);
  null when the frontend has no reader (its discovery is not etcd);
- `series`: one point a second for the last `HISTORY_S` seconds — request
  rate, failed requests, output tokens/s, requests in flight, and
  p50/p90/p99 of TTFT, ITL and end-to-end latency over the trailing
  `WINDOW_S` seconds. The points are read from the frontend's own
  Prometheus registry (the counters and histograms /metrics serves), so
  the page and Grafana agree; percentiles interpolate within buckets as
  PromQL's `histogram_quantile` does. Under `--workers N` the counters are
  the group's totals, the workers and decisions those of the process that
  answered.

Access (app.py): the page, its assets and `/dashboard/state` are governed
like `/metrics` — with API keys set they need a key unless `--open-metrics`.
A browser opening the page gets a login prompt (`WWW-Authenticate: Basic`;
any user name, the API key as password) and sends those credentials with
the page's own polls; a key typed into the page's form is sent as `Bearer`.
Requests appear as `request_tag` digests, never by id (router/recent.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from meshllm.errors import MeshError
from meshllm.frontend.http.planner_panel import PlannerPanel, PlannerReader
from meshllm.lifecycle import AsyncCloseable
from meshllm.router.recent import RecentActivity
from meshllm.router.workers import role_name
from meshllm.served_counts import Counts, delta_buckets, quantile, read_counts

if TYPE_CHECKING:
    from meshllm.frontend.openai.inference import InferenceCore
    from meshllm.router.client import RouterClient
    from meshllm.router.core import RouterCore
    from meshllm.v1 import router_pb2

__all__ = ["ASSETS", "Dashboard"]

log = logging.getLogger(__name__)

HISTORY_S = 600  # points kept (one a second)
WINDOW_S = 5  # rates and percentiles of a point are over this many trailing seconds
REMOTE_TIMEOUT_S = 1.0
# URL path -> (file under meshllm/frontend/http/static, content type)
ASSETS: dict[str, tuple[str, bytes]] = {
    "/dashboard": ("dashboard.html", b"text/html; charset=utf-8"),
    "/dashboard/app.js": ("dashboard.js", b"text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("dashboard.css", b"text/css; charset=utf-8"),
}
_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def asset(path: str) -> tuple[bytes, bytes] | None:
    """The body and content type of a page asset, None for another path."""
    entry = ASSETS.get(path)
    if entry is None:
        return None
    name, content_type = entry
    return _static(name), content_type


@functools.cache
def _static(name: str) -> bytes:
    """A file of the package's static/ folder, read once (not on the event loop per request)."""
    return resources.files("meshllm.frontend.http").joinpath("static", name).read_bytes()


def point(new: Counts, old: Counts) -> dict[str, Any]:
    """One chart point: rates and percentiles between two readings."""
    dt = max(new.at - old.at, 1e-9)
    out: dict[str, Any] = {
        "t": round(new.at, 3),
        "rps": round((new.requests - old.requests) / dt, 3),
        "failed_ps": round((new.failed - old.failed) / dt, 3),
        "tokens_ps": round((new.output_tokens - old.output_tokens) / dt, 1),
        "inflight": new.inflight,
    }
    for key in new.buckets:
        delta = delta_buckets(new, old, key)
        for label, q in _QUANTILES:
            v = quantile(q, delta)
            out[f"{key}_{label}"] = None if v is None else round(v, 6)
    return out


class Dashboard(AsyncCloseable):
    """Samples the frontend's metrics once a second and answers the page's state requests."""

    def __init__(
        self,
        core: InferenceCore,
        *,
        router: RouterCore | None = None,
        routers: Sequence[RouterClient] = (),
        planner: PlannerReader | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.core = core
        self.planner = PlannerPanel(planner) if planner is not None else None  # read every few seconds, not per poll
        self.router = router
        self.routers = list(routers)
        self.interval_s = interval_s
        self.recent = RecentActivity()  # what this frontend saw itself: workers joining, leaving, health
        self._counts: deque[Counts] = deque(maxlen=WINDOW_S + 1)
        self._points: deque[dict[str, Any]] = deque(maxlen=HISTORY_S)
        self._workers: list[dict[str, Any]] = []
        self._remote_note = ""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Dashboard:
        """Take the first reading of the counters and sample in the background from now on (nothing waits on a router)."""
        self._counts.append(read_counts(self.core.metrics.registry.collect(), time.time()))
        self._task = asyncio.create_task(self._run(), name="dashboard-sampler")
        return self

    async def _run(self) -> None:
        await self._refresh_workers()
        if self.planner is not None:
            await self.planner.refresh()
        while True:
            await asyncio.sleep(self.interval_s)  # a ticker: one reading a second
            try:
                await self.sample()
            except Exception as exc:  # a bad reading must not end the page's history
                log.warning("dashboard sample failed: %s: %s", type(exc).__name__, exc)

    async def sample(self) -> None:
        """One reading: a chart point, the workers, and the events their change makes."""
        counts = read_counts(self.core.metrics.registry.collect(), time.time())
        if self._counts:
            self._points.append(point(counts, self._counts[0]))
        self._counts.append(counts)
        await self._refresh_workers()
        if self.planner is not None:
            await self.planner.refresh()  # reads only when the last read is a few seconds old

    async def _refresh_workers(self) -> None:
        workers = await self._read_workers()
        self._note_changes(self._workers, workers)
        self._workers = workers

    # ------------------------------------------------------------ workers
    async def _read_workers(self) -> list[dict[str, Any]]:
        if self.router is not None:
            return embedded_workers(self.router)
        for client in self.routers:
            try:
                async with asyncio.timeout(REMOTE_TIMEOUT_S):
                    resp = await client.list_workers()
            except (MeshError, TimeoutError) as exc:
                self._remote_note = f"router {client.address} did not answer ListWorkers: {exc}"
                continue
            self._remote_note = ""
            return remote_workers(resp, client.address)
        return []

    def _note_changes(self, old: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
        before = {w["id"]: w for w in old}
        after = {w["id"]: w for w in new}
        for wid, w in after.items():
            was = before.get(wid)
            if was is None:
                self.recent.event(
                    "worker-joined", f"worker {wid} ({w['role']}, {w['model']}) joined at {w['address']}", worker_id=wid
                )
            elif was["health"] != w["health"] and "unknown" not in (was["health"], w["health"]):
                self.recent.event("health", f"worker {wid} is {w['health']} (was {was['health']})", worker_id=wid)
        for wid, w in before.items():
            if wid not in after:
                self.recent.event("worker-left", f"worker {wid} ({w['role']}, {w['model']}) left the pool", worker_id=wid)

    # ------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """What the page draws (see the module docstring)."""
        router = self.router
        events = self.recent.events()
        decisions: list[dict[str, Any]] = []
        source: dict[str, Any]
        if router is not None:
            events = sorted([*events, *router.metrics.recent.events()], key=lambda e: e["at"], reverse=True)
            decisions = router.metrics.recent.decisions()
            source = {"kind": "embedded", "id": router.id, "mode": router.mode.value, "note": ""}
        elif self.routers:
            note = self._remote_note or (
                "this frontend routes through --router-address: workers are the router's view (Router.ListWorkers); "
                "routing decisions stay in the router process"
            )
            source = {"kind": "remote", "addresses": [c.address for c in self.routers], "note": note}
        else:
            source = {"kind": "none", "note": "no routing core"}
        core = self.core
        return {
            "now": time.time(),
            "frontend": {
                "admitting": core.admitting,
                "inflight": core.inflight,
                "models": [m.name for m in core.registry.list()],
            },
            "router": source,
            "workers": self._workers,
            "decisions": decisions,
            "events": events[:100],
            "planner": self.planner.state() if self.planner is not None else None,
            "series": list(self._points),
            "window_s": WINDOW_S,
        }

    async def _aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def embedded_workers(router: RouterCore) -> list[dict[str, Any]]:
    """Every worker of an embedded routing core with its load and health."""
    out = []
    pool = router.pool
    for w in pool.all():
        load = router.load.worker(w.id)
        rep = load.reported
        total = rep.total_blocks if rep is not None and rep.total_blocks else 0
        if not total and w.card is not None:
            total = w.card.runtime_limits.total_kv_blocks
        if not pool.healthy(w.id):
            health = "unhealthy"
        elif all(x.id != w.id for x in pool.workers(w.model, w.role)):
            health = "cooling"  # a call to it just failed: not offered for a few seconds
        else:
            health = "healthy"
        out.append(
            _worker(
                w.id, w.model, role_name(w.role), w.address, health, load.active_blocks, int(total),
                waiting=rep.waiting if rep is not None else 0, running=rep.running if rep is not None else 0,
                in_flight=load.in_flight, queued=load.queued_prefill_tokens, indexed=router.index.worker_blocks(w.id),
            )
        )  # fmt: skip
    return out


def remote_workers(resp: router_pb2.ListWorkersResponse, address: str) -> list[dict[str, Any]]:
    """A remote router's ListWorkers answer as the page's workers (health is not in it)."""
    return [
        _worker(
            w.worker_id, w.model, role_name(w.role), w.address, "unknown", w.active_blocks, w.total_blocks,
            waiting=w.waiting, running=w.running, in_flight=w.in_flight, queued=w.queued_prefill_tokens,
            indexed=w.indexed_blocks,
        )
        for w in resp.workers
    ]  # fmt: skip


def _worker(
    wid: str, model: str, role: str, address: str, health: str, active: int, total: int, *,
    waiting: int, running: int, in_flight: int, queued: int, indexed: int,
) -> dict[str, Any]:  # fmt: skip
    return {
        "id": wid, "model": model, "role": role, "address": address, "health": health,
        "kv_active_blocks": active, "kv_total_blocks": total, "kv_usage": round(active / total, 4) if total else None,
        "waiting": waiting, "running": running, "in_flight": in_flight, "queued_prefill_tokens": queued,
        "indexed_blocks": indexed,
    }  # fmt: skip
