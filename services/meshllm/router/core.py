"""`RouterCore`: the routing library — pool, KV index, load, policy — behind `meshllm router` or a frontend.

    core = RouterCore(config, discovery, bus, channels)
    await core.start()                       # subscribe, then watch workers, resync the index
    async for chunk in core.generate(request):
        ...
    decision = await core.route(model, token_ids)
    await core.aclose()

A request's path reads as a sentence: `generate → plan (policy.pick per
pool) → leg(s) → WorkerClient.generate`, with coalescing in front and
migration around (`meshllm.router.stream.legs`). This module holds the state and
the decisions; the streaming lives in `router/stream/legs.py`.

Errors: `generate` raises `NotFound` for a model no worker ever served,
`Unavailable` when none of its workers is live, and the worker's own error
class otherwise (before the first chunk; after it, the stream ends with an
"error" terminal chunk).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence

from meshllm.errors import NotFound, Unavailable
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.discovery.base import Discovery
from meshllm.plane.events.base import EventBus, NullEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.kv import block_hashes
from meshllm.protocol.types import RouteHints, TokenChunk, TokenRequest
from meshllm.router.config import RouterConfig, RouterMode
from meshllm.router.kv.feed import EventFeed
from meshllm.router.kv.index import KvIndex
from meshllm.router.kv.predicted import PredictedIndex, RoutedCache
from meshllm.router.kv.pull import PeerPrefix, PullDecision, decide_pull
from meshllm.router.metrics import RouterMetrics
from meshllm.router.policy.candidates import Candidates
from meshllm.router.policy.choice import make_policy, score
from meshllm.router.policy.decision import AttemptPlan, Decision
from meshllm.router.policy.load import LoadTracker
from meshllm.router.policy.timing import WorkerTimes, restore_costs
from meshllm.router.stream.legs import stream_request
from meshllm.router.sync import ReplicaSync
from meshllm.router.workers import AGGREGATED, DECODE, PREFILL, PoolWorker, WorkerPool, role_name
from meshllm.v1 import discovery_pb2, router_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["AttemptPlan", "Decision", "RouterCore"]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # hashing size for models whose engine does not page its cache
HOUSEKEEPING_S = 1.0


class RouterCore(AsyncCloseable):
    """Routes, disaggregates, proxies and migrates generation streams (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        discovery: Discovery,
        bus: EventBus,
        channels: ChannelCache,
        *,
        static_workers: Sequence[str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.id = config.router_id
        # Load charges, replica sync and in-flight entries are keyed by ids this router makes, never by a
        # caller's request id: two requests that share an id (two clients, a retry) stay two charges.
        self.leg_ids = itertools.count()
        self.channels = channels
        self.metrics = RouterMetrics(self.id)
        self.mode = config.mode
        if self.mode is RouterMode.KV and isinstance(bus, NullEventBus):
            log.warning("router mode kv without an event plane: using approximate routing")
            self.mode = RouterMode.APPROXIMATE
        self.policy = make_policy(self.mode, temperature=config.tuning.temperature, rng=rng or random.Random())
        self.index = KvIndex()
        self.load = LoadTracker()
        self.inflight = PredictedIndex()
        self.approx = RoutedCache(ttl_s=config.tuning.ttl_s)
        self.times = WorkerTimes()
        workers = tuple(static_workers) if static_workers is not None else config.static_workers
        self.pool = WorkerPool(
            discovery, channels, static_workers=workers, model_name=config.model_name,
            failure_cooldown_s=config.failure_cooldown_s, health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
        )  # fmt: skip
        self.feed = EventFeed(
            bus, config.plane.namespace, index=self.index, load=self.load, pool=self.pool, channels=channels,
            metrics=self.metrics, use_kv=self.mode is not RouterMode.APPROXIMATE,
            snapshot_timeout_s=config.snapshot_timeout_s, backoff_s=config.resync_backoff_s,
        )  # fmt: skip
        self.sync = ReplicaSync(bus, config.plane.namespace, config.component, self.id, self.load)
        self._known_models: set[str] = set(filter(None, [config.model_name]))
        self.candidates = Candidates(self)  # who is scored per decision (every slot, or at fleet scale those that can win)
        self._clients: dict[str, WorkerClient] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Subscribe to events, then watch workers (each new one is resynced), then housekeeping."""
        self.pool.on_added = self._worker_added
        self.pool.on_removed = self._worker_removed
        await self.feed.start()
        await self.sync.start()
        await self.pool.start()
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="router-housekeeping"))

    def _worker_added(self, worker: PoolWorker) -> None:
        self._known_models.add(worker.model)
        self.feed.worker_added(worker)
        self.metrics.workers.set(len(self.pool.all()))

    def _worker_removed(self, worker: PoolWorker) -> None:
        self.feed.worker_removed(worker)
        self.load.remove_worker(worker.id)
        self.inflight.remove_worker(worker.id)
        self.approx.remove_worker(worker.id)
        self.times.remove_worker(worker.id)
        self.metrics.workers.set(len(self.pool.all()))

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            self.load.expire(time.time())
            self.approx.expire(time.monotonic())

    async def _aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.aclose()
        await self.feed.aclose()
        await self.sync.aclose()

    # ------------------------------------------------------------ public API
    def generate(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]:
        """Route and stream one request (migrated when a worker breaks).

        With a `call.relay`, the non-terminal chunks that arrive over a worker
        session go to it as they arrive (`SessionClient.generate`'s relay),
        and the iterator yields the rest: the terminal, and every chunk the
        stream makes itself (a disaggregated request's first tokens, an
        in-process worker's chunks, an error terminal after migration).

        Worker streams arrive through sessions that merge the tokens of a
        caller who reads slower than the worker writes (plane/request/session.py), so
        the worker is never held up by this stream's caller. Returns the
        migration driver's generator itself (no generator layer of its own
        per chunk); with no live worker for the model it raises Unavailable
        at the call.
        """
        model = self.resolve_model(request.get("model", ""))
        if not self.pool.workers(model, include_cooling=True):
            raise Unavailable(f"no live worker serves model {model!r}")
        req = request.copy()
        req["model"] = model
        if not req.get("request_id"):
            req["request_id"] = f"{self.id}-{time.monotonic_ns():x}"
        card = self.pool.card(model)
        if not req.get("eos_token_ids") and card is not None and card.eos_token_ids:
            req["eos_token_ids"] = list(card.eos_token_ids)
        self.metrics.requests.inc()
        return stream_request(self, req, call)

    async def route(
        self, model: str, token_ids: Sequence[int], hints: RouteHints | None = None, role: int | None = None
    ) -> router_pb2.RouteDecision:
        """The decision alone (nothing is sent or charged), with every candidate's score."""
        model = self.resolve_model(model)
        tokens, hints = list(token_ids), hints or {}
        if role in (None, discovery_pb2.WORKER_ROLE_UNSPECIFIED):
            plan = self.plan(model, tokens, hints, set())
            return (plan.prefill or plan.main).to_proto()
        bs = self.block_size(model)
        hashes = block_hashes(tokens, bs)
        decision = self.decide(model, role, tokens, hashes, bs, hints, set())
        if role == PREFILL:
            decision.pull = self._peer_pull(model, decision, hashes, set())
        return decision.to_proto()

    def list_workers(self, model: str | None = None) -> router_pb2.ListWorkersResponse:
        """Every known worker with its load and indexed blocks."""
        out = router_pb2.ListWorkersResponse()
        for w in self.pool.all():
            if model and w.model != model:
                continue
            load = self.load.worker(w.id)
            rep = load.reported
            total = rep.total_blocks if rep is not None and rep.total_blocks else 0
            if not total and w.card is not None:
                total = w.card.runtime_limits.total_kv_blocks
            out.workers.add(
                worker_id=w.id, role=w.role, address=w.address, model=w.model,  # type: ignore[arg-type]
                active_blocks=load.active_blocks, total_blocks=total,
                waiting=rep.waiting if rep is not None else 0, running=rep.running if rep is not None else 0,
                indexed_blocks=self.index.worker_blocks(w.id), in_flight=load.in_flight,
                queued_prefill_tokens=load.queued_prefill_tokens,
                indexed_lower_tiers=[
                    router_pb2.IndexedTierBlocks(tier=t, blocks=n)  # type: ignore[arg-type]
                    for t in self.index.lower.sets if (n := self.index.lower_blocks(w.id, t))
                ],
            )  # fmt: skip
        return out

    def models(self) -> list[discovery_pb2.ModelCard]:
        """One ModelCard per model some live worker serves, by name."""
        return [card for _, card in sorted(self.pool.models().items())]

    # ------------------------------------------------------------ decisions
    def resolve_model(self, model: str) -> str:
        """`model`, or the only known model when empty; NotFound for a model nobody ever served."""
        if not model:
            known = sorted(self._known_models | set(self.pool.models()))
            if len(known) == 1:
                return known[0]
            raise NotFound("the request names no model and the router knows " + (", ".join(known) or "none"))
        if model not in self._known_models and model not in self.pool.models():
            raise NotFound(f"model {model!r} not found")
        return model

    def block_size(self, model: str) -> int:
        card = self.pool.card(model)
        return card.kv_block_size if card is not None and card.kv_block_size else DEFAULT_BLOCK_SIZE

    def migration_limit(self, model: str) -> int:
        card = self.pool.card(model)
        if card is None:
            return self.config.tuning.migration_limit
        return min(self.config.tuning.migration_limit, card.migration_limit)

    def plan(
        self, model: str, tokens: list[int], hints: RouteHints, excluded: set[str], *, max_tokens: int | None = None
    ) -> AttemptPlan:
        """Choose the worker(s) of one attempt: aggregated, or decode + remote prefill."""
        bs = self.block_size(model)
        hashes = block_hashes(tokens, bs)
        pools = {r: self._eligible(model, r, hints, excluded) for r in (AGGREGATED, PREFILL, DECODE)}
        pinned = hints.get("backend_instance_id")
        if pinned:
            w = self.pool.get(pinned)
            if w is None or w.model != model or pinned in excluded or w.role == PREFILL:
                raise Unavailable(f"worker {pinned!r} (backend_instance_id) cannot serve model {model!r} now")
            main_role = w.role
        elif pools[DECODE] and (pools[PREFILL] or not pools[AGGREGATED]):
            main_role = DECODE
        elif pools[AGGREGATED]:
            main_role = AGGREGATED
        else:
            raise Unavailable(f"no live aggregated or decode worker serves model {model!r}")
        main = self.decide(model, main_role, tokens, hashes, bs, hints, excluded)
        prefill = None
        if main_role == DECODE and pools[PREFILL] and self._remote_prefill(main, len(tokens), max_tokens):
            prefill = self.decide(model, PREFILL, tokens, hashes, bs, hints, excluded)
            prefill.pull = self._peer_pull(model, prefill, hashes, excluded)
        return AttemptPlan(main, prefill, hashes)

    def _peer_pull(self, model: str, prefill: Decision, hashes: list[int], excluded: set[str]) -> PullDecision | None:
        """The peer prefix pull for the chosen prefill worker (router/kv/pull.py; kv mode, --kv-pull-gbps > 0)."""
        gbps = self.config.tuning.kv_pull_gbps
        if gbps <= 0 or self.mode is not RouterMode.KV or not hashes:
            return None
        chosen = prefill.chosen
        peers = [
            (w, r) for role in (AGGREGATED, PREFILL, DECODE) for w in self.pool.workers(model, role)
            if w.id != chosen.worker_id and w.id not in excluded for r in range(w.dp_size)
        ]  # fmt: skip
        if not peers:
            return None
        slots = [(w.id, r) for w, r in peers]
        device = self.index.overlaps(hashes, slots)
        tiers = self.index.tier_overlaps(hashes, slots, device)
        held = []
        for w, r in peers:
            key = (w.id, r)
            ov, lower = device.get(key, 0), {}
            if (t := tiers.get(key)) is not None:
                ov, lower = ov + t.device, t.lower
            if ov + sum(lower.values()) <= chosen.served_blocks:
                continue
            rep = self.load.get(key).reported
            advertised = list(rep.tiers) if rep is not None else []
            block_bytes = max((int(u.block_bytes) for u in advertised), default=0)
            restore = tuple(restore_costs(lower, advertised, prefill.block_ms)) if lower else ()
            held.append(PeerPrefix(w.id, w.address, ov, lower, restore, block_bytes))
        return decide_pull(held, local_blocks=chosen.served_blocks, block_ms=prefill.block_ms, bytes_per_s=gbps * 1e9)

    def _remote_prefill(self, decode: Decision, prompt_tokens: int, max_tokens: int | None) -> bool:
        """Conditional disaggregation: is a remote prefill worth it for this decode choice?"""
        cfg = self.config.tuning
        if max_tokens is not None and max_tokens <= 1:
            return False  # the prefill leg alone would answer: no KV to hand over
        # Blocks the decode worker restores from its own lower tiers count as local hits: restoring them
        # there beats computing them on a prefill worker and moving them.
        served = decode.chosen.served_blocks
        hit = served * decode.block_size / max(prompt_tokens, 1)
        if prompt_tokens < cfg.disagg_min_prompt_tokens:
            return False
        return not (served and hit >= cfg.disagg_max_local_hit)

    def _eligible(self, model: str, role: int, hints: RouteHints, excluded: set[str]) -> list[PoolWorker]:
        workers = self.pool.workers(model, role)
        if excluded:
            workers = [w for w in workers if w.id not in excluded]
        allowed = hints.get("allowed_worker_ids")
        if allowed:
            workers = [w for w in workers if w.id in allowed]
        pins: dict[int, str | None] = {PREFILL: hints.get("prefill_worker_id"), DECODE: hints.get("decode_worker_id")}
        pin = pins.get(role)
        pinned = hints.get("backend_instance_id")
        if pinned and role != PREFILL:
            pin = pinned
        if pin:
            workers = [w for w in workers if w.id == pin]
        return workers

    def decide(
        self, model: str, role: int, tokens: list[int], hashes: list[int], bs: int, hints: RouteHints, excluded: set[str]
    ) -> Decision:
        """Score the eligible (worker, dp rank)s of one pool that can win and let the policy pick.

        A pool of `fleet.FLEET_MIN_SLOTS` slots or more in `kv` mode at
        temperature 0 scores only the candidates that can win
        (`meshllm.router.policy.candidates`: the same choice); otherwise every one.
        """
        workers = self._eligible(model, role, hints, excluded)
        if not workers:
            raise Unavailable(f"no live {role_name(role)} worker for model {model!r} (excluded: {sorted(excluded)})")
        ask = self.candidates.ask(model, tokens, hashes, bs)
        cands = self.candidates.build(model, role, workers, hints.get("dp_rank"), hashes, ask)
        cfg = self.config.tuning
        score(
            cands, block_size=bs, overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight,
            wait_weight=cfg.wait_weight,
        )  # fmt: skip
        chosen = self.policy.pick(cands, f"{model}/{role}")
        return Decision(
            chosen, cands, role, self.policy.name, bs, len(hashes), cfg.overlap_weight, cfg.capacity_weight,
            cfg.wait_weight, ask.block_ms, ask.fixed_ms,
        )  # fmt: skip

    def client(self, address: str) -> WorkerClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = WorkerClient(self.channels, address)
        return c
