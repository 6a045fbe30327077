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
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

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
from meshllm.router.kv.index import KvIndex, SlotCapacities, SlotKey
from meshllm.router.kv.predicted import PredictedIndex, RoutedCache
from meshllm.router.kv.pull import PeerPrefix, PullDecision, decide_pull
from meshllm.router.metrics import RouterMetrics
from meshllm.router.policy.choice import Candidate, KvPolicy, make_policy, score
from meshllm.router.policy.decision import AttemptPlan, Decision
from meshllm.router.policy.fleet import FLEET_MIN_SLOTS, FleetTable, bit_indices, lower_bounds, policy_order
from meshllm.router.policy.load import LoadTracker, SlotLoad
from meshllm.router.policy.timing import WorkerTimes, evict_ratio, restore_costs, wait_blocks
from meshllm.router.stream.legs import serve
from meshllm.router.sync import ReplicaSync
from meshllm.router.workers import AGGREGATED, DECODE, PREFILL, PoolWorker, WorkerPool, role_name
from meshllm.v1 import discovery_pb2, router_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["AttemptPlan", "Decision", "RouterCore"]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # hashing size for models whose engine does not page its cache
HOUSEKEEPING_S = 1.0


@dataclass(slots=True)
class _Ask:
    """What one decision asks of every candidate: the prompt's sizes and the model's measured times."""

    tokens: int
    hashes: int
    block_size: int
    request_blocks: int
    prompt: set[int]
    block_ms: float
    fixed_ms: float
    cache: SlotCapacities


def _order(c: Candidate) -> tuple[bool, float, int, int, int, str, int]:
    """`KvPolicy`'s order at temperature 0: candidates with room first, then its tie key."""
    return (c.no_room, c.cost, c.decode_blocks, c.in_flight, c.cached_blocks, c.worker_id, c.dp_rank)


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
        # Fleet decisions (meshllm.router.policy.fleet): off, every decision scores every candidate (the reference).
        self.fleet = True
        self.fleet_min_slots = FLEET_MIN_SLOTS
        self._fleet_tables: dict[tuple[str, int], FleetTable] = {}
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
        session go to it as they arrive (`SessionClient.generate`'s sink),
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
        return serve(self, req, call)

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
        (`meshllm.router.policy.fleet`: the same choice); otherwise every one.
        """
        workers = self._eligible(model, role, hints, excluded)
        if not workers:
            raise Unavailable(f"no live {role_name(role)} worker for model {model!r} (excluded: {sorted(excluded)})")
        pin_rank = hints.get("dp_rank")
        cfg = self.config.tuning
        ask = _Ask(
            tokens=len(tokens), hashes=len(hashes), block_size=bs, request_blocks=-(-len(tokens) // bs),
            prompt=set(hashes), block_ms=self.times.block_ms(model, bs), fixed_ms=self.times.fixed_ms(model),
            cache=self.approx if self.mode is RouterMode.APPROXIMATE else self.index,
        )  # fmt: skip
        cands = self._fleet_candidates(model, role, workers, pin_rank, hashes, ask) if self.fleet else None
        if cands is None:
            cands = self.exhaustive_candidates(role, workers, pin_rank, hashes, ask)
        score(
            cands, block_size=bs, overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight,
            wait_weight=cfg.wait_weight,
        )  # fmt: skip
        chosen = self.policy.pick(cands, f"{model}/{role}")
        return Decision(
            chosen, cands, role, self.policy.name, bs, len(hashes), cfg.overlap_weight, cfg.capacity_weight,
            cfg.wait_weight, ask.block_ms, ask.fixed_ms,
        )  # fmt: skip

    def exhaustive_candidates(
        self, role: int, workers: list[PoolWorker], pin_rank: int | None, hashes: list[int], ask: _Ask
    ) -> list[Candidate]:
        """Every eligible (worker, dp rank) as a candidate (unscored): the reference the fleet path agrees with."""
        keys: list[tuple[PoolWorker, int]] = [
            (w, r) for w in workers for r in range(w.dp_size) if pin_rank is None or r == pin_rank
        ]
        if not keys:
            raise Unavailable(f"no {role_name(role)} worker of model {workers[0].model!r} has dp rank {pin_rank}")
        slots = [(w.id, r) for w, r in keys]
        overlaps, pending = self._overlaps(hashes, slots)
        # Where the device prefix ends, lower tiers (host, disk) may continue it (kv mode: events tell).
        tiers = self.index.tier_overlaps(hashes, slots, overlaps) if self.mode is RouterMode.KV and hashes else {}
        cands = []
        for w, r in keys:
            key = (w.id, r)
            ov = overlaps.get(key, 0)
            lower: dict[int, int] = {}
            if (t := tiers.get(key)) is not None:
                ov, lower = ov + t.device, t.lower
            cands.append(self._candidate(w, r, ov, lower, pending.get(key, 0), ask))
        return cands

    def _candidate(self, w: PoolWorker, r: int, ov: int, lower: dict[int, int], shared: int, ask: _Ask) -> Candidate:
        """One (worker, dp rank) with `ov` device prefix blocks, `lower` restored ones, `shared` with its in-flight requests."""
        key = (w.id, r)
        bs = ask.block_size
        served = ov + sum(lower.values())
        load = self.load.get(key)
        advertised = load.reported.tiers if load.reported is not None else ()
        # Queued prefill of in-flight requests that share this prompt's prefix is work this
        # request shares (the prefix is being computed for both), not a backlog it waits behind.
        queued = max(0, load.queued_prefill_tokens - shared * bs)
        cache = ask.cache
        cache.set_total(key, self._total_blocks(w, load))
        new = max(0, ask.hashes - ov)  # restored blocks take device room as computed ones do
        room = cache.capacity(key, ask.prompt, new, pending=-(-load.queued_prefill_tokens // bs))
        step_ms = self.times.step_ms(key)
        # Decode load once this request runs there: the engine shares blocks only between running
        # sequences, so every prompt block but those its in-flight requests share becomes active
        # (a block cached there but idle is made active again, not saved).
        decode = load.active_blocks + ask.request_blocks - shared
        total = room.total if self.config.tuning.capacity_weight > 0 else 0
        no_room = total > 0 and decode > total
        wait = wait_blocks(load.in_flight, step_ms, ask.block_ms, prefilling=load.prefilling, fixed_ms=ask.fixed_ms)
        return Candidate(
            worker_id=w.id, dp_rank=r, address=w.address, overlap_blocks=ov,
            prefill_tokens=max(0, ask.tokens - served * bs), decode_blocks=decode,
            queued_prefill_tokens=queued, in_flight=load.in_flight, prefilling=load.prefilling,
            cached_blocks=room.resident, total_blocks=room.total, new_blocks=new, evicted_hot_blocks=room.evicted_hot,
            evict_ratio=evict_ratio(advertised, ask.block_ms), step_ms=step_ms, wait_blocks=wait, no_room=no_room,
            lower_blocks=lower, restore=restore_costs(lower, advertised, ask.block_ms) if lower else [],
        )  # fmt: skip

    # ------------------------------------------------------------ fleet decisions (meshllm.router.policy.fleet)
    def _fleet_table(self, model: str, role: int) -> FleetTable | None:
        """The pool's table, rebuilt when the pool or the slot numbering changed; None below FLEET_MIN_SLOTS."""
        base = self.pool.workers(model, role, include_cooling=True)
        t = self._fleet_tables.get((model, role))
        bmap = self.index.map
        if t is None or t.base is not base or t.generation != bmap.generation:
            if sum(w.dp_size for w in base) < self.fleet_min_slots:
                self._fleet_tables.pop((model, role), None)
                return None
            for w in base:
                for r in range(w.dp_size):
                    bmap.slot((w.id, r))
            t = self._fleet_tables[(model, role)] = FleetTable.build(base, bmap.slot_of, bmap.generation)
        changed = self.load.changed | self.times.changed
        if changed:
            self.load.changed.clear()
            self.times.changed.clear()
            for other in self._fleet_tables.values():
                other.mark(changed)
        if t.dirty:
            for i in t.dirty:
                w, r = t.keys[i]
                key = (w.id, r)
                load = self.load.get(key)
                total = self._total_blocks(w, load)
                self.index.set_total(key, total)
                t.set(
                    i, active=load.active_blocks, queued=load.queued_prefill_tokens, in_flight=load.in_flight,
                    prefilling=load.prefilling, total=total if total > 0 else 0, step=self.times.step_ms(key),
                )  # fmt: skip
            t.dirty.clear()
        return t

    def _fleet_candidates(
        self, model: str, role: int, workers: list[PoolWorker], pin_rank: int | None, hashes: list[int], ask: _Ask
    ) -> list[Candidate] | None:
        """The candidates that can win (meshllm.router.policy.fleet), or None to score every one."""
        if self.mode is not RouterMode.KV or not isinstance(self.policy, KvPolicy) or self.policy.temperature > 0:
            return None
        t = self._fleet_table(model, role)
        if t is None:
            return None
        n = len(t.keys)
        eligible: npt.NDArray[np.bool_] | None = None
        if workers is not t.base or pin_rank is not None:
            eligible = np.zeros(n, dtype=np.bool_)
            for w in workers:
                eligible[t.wpos.get(w.id, [])] = True
            if pin_rank is not None:
                eligible &= t.dp == pin_rank
            if not eligible.any():
                return None  # the exhaustive path says why
        bmap = self.index.map
        counts = np.array(bmap.sizes, dtype=np.int64)[t.slots]
        hot = np.array(bmap.hot, dtype=np.int64)[t.slots]
        ov = np.zeros(n, dtype=np.int64)
        if hashes:
            for depth, bits in bmap.overlap_groups(hashes, t.mask):
                ov[t.pos_of_slot[bit_indices(bits)]] = depth
        # Exactly scored, as by the exhaustive path: slots with in-flight requests sharing the prefix, or lower tiers.
        pmap = self.inflight.map
        pending = pmap.overlaps(hashes, [k for k in pmap.slot_of if k in t.pos]) if hashes and pmap.slot_of else {}
        tiers = {}
        if hashes and self.index.lower:
            starts = {t.skeys[i]: int(ov[i]) for i in np.flatnonzero(ov)}
            for k, d in pending.items():
                starts[k] = max(starts.get(k, 0), d)
            tiers = self.index.tier_overlaps(hashes, t.skeys, starts)
        cands: list[Candidate] = []
        special = np.zeros(n, dtype=np.bool_)
        for key in pending.keys() | tiers.keys():
            i = t.pos[key]
            special[i] = True
            if eligible is not None and not eligible[i]:
                continue
            w, r = t.keys[i]
            dev, shared, lower = max(int(ov[i]), pending.get(key, 0)), pending.get(key, 0), {}
            if (tov := tiers.get(key)) is not None:
                dev, lower = dev + tov.device, tov.lower
            cands.append(self._candidate(w, r, dev, lower, shared, ask))
        cfg = self.config.tuning

        def scored(cs: list[Candidate]) -> None:
            score(
                cs, block_size=ask.block_size, overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight,
                wait_weight=cfg.wait_weight,
            )  # fmt: skip

        scored(cands)
        best = min((_order(c) for c in cands), default=None)
        b = lower_bounds(
            t, ov, counts, hot, tokens=ask.tokens, hashes=ask.hashes, block_size=ask.block_size,
            request_blocks=ask.request_blocks, block_ms=ask.block_ms, fixed_ms=ask.fixed_ms,
            overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight, wait_weight=cfg.wait_weight,
        )  # fmt: skip
        rest = ~special if eligible is None else eligible & ~special
        for i in policy_order(b, t, rest):
            w, r = t.keys[i]
            if best is not None:
                bound = (bool(b.no_room[i]), float(b.cost[i]), int(b.decode[i]), int(t.in_flight[i]), int(b.cached[i]), w.id, r)
                if bound > best:
                    break
            c = self._candidate(w, r, int(ov[i]), {}, 0, ask)
            scored([c])
            cands.append(c)
            ordered = _order(c)
            if best is None or ordered < best:
                best = ordered
        return cands

    @staticmethod
    def _total_blocks(w: PoolWorker, load: SlotLoad) -> int:
        """A slot's capacity: its last LoadSnapshot's, else its model card's (per dp rank)."""
        if load.reported is not None and load.reported.total_blocks:
            return int(load.reported.total_blocks)
        return int(w.card.runtime_limits.total_kv_blocks) if w.card is not None else 0

    def _overlaps(self, hashes: list[int], keys: list[SlotKey]) -> tuple[dict[SlotKey, int], dict[SlotKey, int]]:
        """Cached leading blocks per candidate, and how many leading blocks in-flight requests on it share.

        In `kv` mode the shared ones count as cached (they are being computed there); in both
        modes they are work this request shares, not backlog, and take no room of their own.
        """
        pending: dict[SlotKey, int] = {}
        if not hashes:
            return {}, pending
        if self.mode is RouterMode.APPROXIMATE:
            self.approx.expire(time.monotonic())
            return self.approx.overlaps(hashes, keys), self.inflight.overlaps(hashes, keys)
        seen = self.index.overlaps(hashes, keys)
        if self.mode is RouterMode.KV:
            pending = self.inflight.overlaps(hashes, keys)
            for k, n in pending.items():
                if n > seen.get(k, 0):
                    seen[k] = n
        return seen, pending

    def client(self, address: str) -> WorkerClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = WorkerClient(self.channels, address)
        return c
