"""The router's worker pool: live workers per model and role, from a discovery watch or a static list.

Discovery mode watches every instance of the namespace (a worker is an
instance with a role) and every model card; a worker's card is the one it
published, fetched with `Worker.GetInfo` when it has not shown up shortly
after the instance. An instance that leaves discovery leaves the pool at
once, and `on_removed` tells the core (which drops it from the KV index and
the load tracker in the same breath).

Static mode asks each `--static-workers` address `GetInfo` until it answers,
then re-asks every few seconds: a worker that stops answering leaves the pool
until it answers again (with a new instance id after a restart).

Workers that just failed a call are *cooling down* for a few seconds and
are not offered for routing; discovery usually confirms their death soon
after.

Health: every `health_interval_s` the pool asks each worker the standard
`grpc.health.v1.Health/Check` (bounded by `health_timeout_s`). A worker that
does not answer in time (stopped, hung, partitioned), or answers anything but
SERVING (its engine canary failed, it drains), is taken out of routing at once
— within interval + timeout (3 s by default), long before its discovery lease
(10 s) expires — and comes back when a check succeeds again. When every worker
of a pool is out, routing ignores the checks (they may be what is failing: a
starved router process) rather than refusing the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshllm.errors import MeshError
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.discovery.base import Discovery
from meshllm.plane.request.channels import ChannelCache
from meshllm.v1 import discovery_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["AGGREGATED", "DECODE", "PREFILL", "PoolWorker", "WorkerPool", "role_name"]

log = logging.getLogger(__name__)

AGGREGATED = discovery_pb2.WORKER_ROLE_AGGREGATED
PREFILL = discovery_pb2.WORKER_ROLE_PREFILL
DECODE = discovery_pb2.WORKER_ROLE_DECODE

CARD_GRACE_S = 2.0  # wait this long for a card to arrive by watch before asking GetInfo
STATIC_PROBE_S = 5.0


def role_name(role: int) -> str:
    names: dict[int, str] = {AGGREGATED: "agg", PREFILL: "prefill", DECODE: "decode"}
    return names.get(role, "unspecified")


@dataclass(frozen=True, slots=True)
class PoolWorker:
    """One live worker as the router routes to it."""

    id: str
    address: str
    role: int  # discovery_pb2.WorkerRole
    model: str
    dp_size: int = 1
    card: discovery_pb2.ModelCard | None = None
    session_address: str = ""  # where it serves Generate sessions on TCP ("" = gRPC only)


class WorkerPool(AsyncCloseable):
    """Live workers by id; `workers(model, role)` is what routing chooses from."""

    def __init__(
        self,
        discovery: Discovery,
        channels: ChannelCache,
        *,
        static_workers: Sequence[str] = (),
        model_name: str | None = None,
        failure_cooldown_s: float = 5.0,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 2.0,
    ) -> None:
        self.discovery = discovery
        self.channels = channels
        self.static_workers = tuple(static_workers)
        self.model_name = model_name
        self.failure_cooldown_s = failure_cooldown_s
        self.health_interval_s = health_interval_s  # 0 = no health checks
        self.health_timeout_s = health_timeout_s
        self.on_added: Callable[[PoolWorker], None] = lambda w: None
        self.on_removed: Callable[[PoolWorker], None] = lambda w: None
        self._workers: dict[str, PoolWorker] = {}
        self._by_id: list[PoolWorker] = []  # _workers' values sorted by id (sorted once per change, not per request)
        # (model, role) -> its workers in id order, built once per pool change: a fleet's decision does not
        # filter every worker of every model per request. Returned as they are: callers never modify them.
        self._lists: dict[tuple[str, int | None], list[PoolWorker]] = {}
        self._instances: dict[str, discovery_pb2.Instance] = {}
        self._cards: dict[str, discovery_pb2.ModelCard] = {}
        self._fetched: dict[str, discovery_pb2.ModelCard] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._cooldown: dict[str, float] = {}
        self._unhealthy: dict[str, str] = {}  # worker id -> why its last health check failed
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()

    async def start(self) -> None:
        """Start watching (or probing the static workers) in background tasks."""
        if self.static_workers:
            self._tasks.append(asyncio.create_task(self._probe_static(), name="router-static-workers"))
        else:
            self._tasks.append(asyncio.create_task(self._watch_instances(), name="router-watch-instances"))
            self._tasks.append(asyncio.create_task(self._watch_models(), name="router-watch-models"))
        if self.health_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._check_health(), name="router-worker-health"))

    # ------------------------------------------------------------ queries
    def get(self, worker_id: str) -> PoolWorker | None:
        return self._workers.get(worker_id)

    def all(self) -> list[PoolWorker]:
        return list(self._by_id)

    def workers(self, model: str, role: int | None = None, *, include_cooling: bool = False) -> list[PoolWorker]:
        """Live workers of `model` (in `role` when given), sorted by id; cooling-down and unhealthy ones left out.

        Unhealthy ones are left out only while some healthy one remains (see the module docstring).
        """
        live = self._lists.get((model, role))
        if live is None:
            live = self._lists[(model, role)] = [w for w in self._by_id if w.model == model and (role is None or w.role == role)]
        if not include_cooling and self._cooldown:
            now = time.monotonic()
            for wid in [k for k, until in self._cooldown.items() if until <= now]:
                del self._cooldown[wid]
            if self._cooldown:
                live = [w for w in live if w.id not in self._cooldown]
        if include_cooling or not self._unhealthy:
            return live
        return [w for w in live if w.id not in self._unhealthy] or live

    def healthy(self, worker_id: str) -> bool:
        """False while the worker's last health check failed."""
        return worker_id not in self._unhealthy

    def models(self) -> dict[str, discovery_pb2.ModelCard]:
        """One card per known model (from its worker with the smallest id)."""
        out: dict[str, discovery_pb2.ModelCard] = {}
        for w in self.all():
            if w.model not in out:
                card = discovery_pb2.ModelCard()
                if w.card is not None:
                    card.CopyFrom(w.card)
                card.name = w.model
                out[w.model] = card
        return out

    def card(self, model: str) -> discovery_pb2.ModelCard | None:
        """A card of `model` with a block size, if any worker published one."""
        fallback = None
        for w in self.all():
            if w.model == model and w.card is not None:
                if w.card.kv_block_size:
                    return w.card
                fallback = w.card
        return fallback

    def mark_failed(self, worker_id: str) -> None:
        """Skip a worker for a few seconds (a call to it just failed)."""
        self._cooldown[worker_id] = time.monotonic() + self.failure_cooldown_s

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Return once `predicate()` holds after some pool change; TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    # ------------------------------------------------------------ discovery mode
    async def _watch_instances(self) -> None:
        async for snapshot in self.discovery.watch_instances():
            self._instances = {k: v for k, v in snapshot.items() if v.role != discovery_pb2.WORKER_ROLE_UNSPECIFIED}
            self._reconcile()

    async def _watch_models(self) -> None:
        async for snapshot in self.discovery.watch_models():
            self._cards = snapshot
            self._reconcile()

    def _reconcile(self) -> None:
        wanted: dict[str, PoolWorker] = {}
        for wid, inst in self._instances.items():
            card = self._cards.get(wid) or self._fetched.get(wid)
            if card is None and wid not in self._fetching:
                self._fetching[wid] = asyncio.create_task(self._fetch_card(wid, inst.address), name=f"router-card-{wid}")
            wanted[wid] = PoolWorker(
                id=wid,
                address=inst.address,
                role=inst.role,
                model=inst.model or (card.name if card is not None else ""),
                dp_size=max(inst.dp_size, 1),
                card=card,
                session_address=inst.session_address,
            )
        for gone in set(self._fetched) - set(self._instances):
            self._fetched.pop(gone, None)
        self._update(wanted)

    async def _fetch_card(self, wid: str, address: str) -> None:
        try:
            with contextlib.suppress(TimeoutError):
                await self.wait_until(lambda: wid in self._cards or wid not in self._instances, CARD_GRACE_S)
            if wid in self._cards or wid not in self._instances:
                return
            info = await WorkerClient(self.channels, address).get_info(timeout_s=5.0)
            self._fetched[wid] = info.model_card
            self._reconcile()
        except MeshError as exc:
            log.warning("GetInfo of worker %s at %s failed: %s", wid, address, exc)
        finally:
            self._fetching.pop(wid, None)

    # ------------------------------------------------------------ static mode
    async def _probe_static(self) -> None:
        by_address: dict[str, PoolWorker] = {}
        while True:
            results = await asyncio.gather(*(self._probe(a) for a in self.static_workers))
            for address, w in zip(self.static_workers, results, strict=True):
                if w is None:
                    by_address.pop(address, None)
                else:
                    by_address[address] = w
            self._update({w.id: w for w in by_address.values()})
            await asyncio.sleep(STATIC_PROBE_S if len(by_address) == len(self.static_workers) else 0.5)

    async def _probe(self, address: str) -> PoolWorker | None:
        try:
            info = await WorkerClient(self.channels, address).get_info(timeout_s=3.0)
        except MeshError as exc:
            log.debug("static worker %s does not answer: %s", address, exc)
            return None
        card = discovery_pb2.ModelCard()
        card.CopyFrom(info.model_card)
        model = self.model_name or card.name or info.instance.model
        card.name = model
        return PoolWorker(
            id=info.instance.id or address,
            address=address,
            role=info.role or discovery_pb2.WORKER_ROLE_AGGREGATED,
            model=model,
            dp_size=max(info.instance.dp_size, info.engine.data_parallel_size, 1),
            card=card,
            session_address=info.instance.session_address,
        )

    # ------------------------------------------------------------ health
    async def _check_health(self) -> None:
        while True:
            workers = list(self._workers.values())
            await asyncio.gather(*(self._check(w) for w in workers))
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, w: PoolWorker) -> None:
        why = ""
        try:
            stub = health_pb2_grpc.HealthStub(self.channels.get(w.address))
            resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.health_timeout_s)
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                why = f"it reports {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
        except grpc.aio.AioRpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
        except (MeshError, grpc.aio.UsageError) as exc:  # the channel (cache) is closing: not the worker's fault
            log.debug("health check of %s skipped: %s", w.id, exc)
            return
        if self._workers.get(w.id) != w:
            return  # it left (or changed) meanwhile
        if not why:
            if self._unhealthy.pop(w.id, None) is not None:
                log.info("worker %s (%s) answers health checks again; routing to it", w.id, w.address)
                self._changed.set()
        elif w.id not in self._unhealthy:
            self._unhealthy[w.id] = why
            log.warning("worker %s (%s) failed a health check (%s); taken out of routing", w.id, w.address, why)
            self._changed.set()

    # ------------------------------------------------------------ shared
    def _update(self, wanted: dict[str, PoolWorker]) -> None:
        old = self._workers
        self._workers = wanted
        for w in wanted.values():
            self.channels.route_sessions(w.address, w.session_address)
        self._by_id = sorted(wanted.values(), key=lambda w: w.id)
        self._lists = {}
        for wid, w in old.items():
            if wid not in wanted:
                self._cooldown.pop(wid, None)
                self._unhealthy.pop(wid, None)
                log.info("worker %s (%s, %s) left the pool", wid, role_name(w.role), w.address)
                self.on_removed(w)
        for wid, w in wanted.items():
            if wid not in old:
                log.info("worker %s (%s, %s, model %s) joined the pool", wid, role_name(w.role), w.address, w.model)
                self.on_added(w)
        self._changed.set()

    async def _aclose(self) -> None:
        tasks = [*self._tasks, *self._fetching.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
