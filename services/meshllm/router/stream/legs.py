"""One request's stream through the router: attempts, legs, disaggregation and migration.

    stream_request → one attempt after another until a terminal chunk (migration)
      attempt    → plan, then one aggregated leg, or a prefill leg then a decode leg
        leg      → charge load, WorkerClient.generate, release load (also on cancel)

Disaggregated attempt: the prefill leg is sent as "context_only"; its
terminal chunk carries the first token(s) and DisaggInfo. The first tokens
go to the caller once, as a plain chunk; the decode leg is sent as
"generation_only" with those params (plus the prefill worker's id and
address) and continues after them. A prefill terminal that already ends the
request (EOS, stop, max_tokens reached, no params) is passed on as the
stream's terminal.

Relay: a stream of the router's GenerateSession service (RouterServicer) has
a relay (`CallInfo.relay`). Its worker legs' non-terminal chunks then skip this generator chain:
the worker session's reader hands each one to the leg's relay, which does the
leg's bookkeeping and the migration state's and pushes it into the caller's
session, so a token wakes no task here. The chain still carries the
terminal, a disaggregated request's first tokens (the prefill leg has no
relay) and error terminals, after every chunk the relay was given.

Cancellation: the caller closing the stream (or cancelling the task that
iterates it) unwinds `stream_request` through whichever leg is running — prefill or
decode — and closes its `WorkerClient.generate`, which sends the stream's
cancel on the worker session, so that worker's engine frees the request's KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from itertools import count
from typing import Protocol

from meshllm.errors import MeshError
from meshllm.plane.request.transport import CallInfo, ChunkRelay
from meshllm.protocol.kv import prefix_handle
from meshllm.protocol.types import RouteHints, TokenChunk, TokenRequest
from meshllm.router.config import RouterMode
from meshllm.router.metrics import RouterMetrics
from meshllm.router.policy.candidates import RouterViews
from meshllm.router.policy.decision import AttemptPlan, Decision
from meshllm.router.recent import request_tag
from meshllm.router.stream.migration import MigrationState, migrating
from meshllm.router.sync import ReplicaSync
from meshllm.router.workers import DECODE, role_name
from meshllm.worker.client import WorkerClient

__all__ = ["RoutingCore", "stream_request"]


class RoutingCore(RouterViews, Protocol):
    """What a request's stream uses of its routing core (`RouterCore`, which calls `stream_request`): its views, and these."""

    id: str
    leg_ids: count[int]
    metrics: RouterMetrics
    sync: ReplicaSync

    def client(self, address: str) -> WorkerClient: ...

    def migration_limit(self, model: str) -> int: ...

    def plan(
        self, model: str, tokens: list[int], hints: RouteHints, excluded: set[str], *, max_tokens: int | None = None
    ) -> AttemptPlan: ...


log = logging.getLogger(__name__)


def stream_request(core: RoutingCore, request: TokenRequest, call: CallInfo | None) -> AsyncGenerator[TokenChunk, None]:
    """Run attempts until one ends with a terminal chunk; migrate broken ones (see migration.py).

    Returns `migrating`'s generator itself: no extra generator layer per chunk.
    With a `call.relay` (a GenerateSession stream's outbox), a worker leg's
    non-terminal chunks take the same bookkeeping (the leg's, then the
    migration state's) and go to it from the worker session's reader; the rest
    come through the generator.
    """
    state = MigrationState(request, limit=core.migration_limit(request["model"]))

    def failure(failed: str | None, exc: MeshError, resent: bool) -> None:
        if failed is not None:
            core.pool.mark_failed(failed)
        if not resent or failed is None:
            core.metrics.errors.inc()
            return
        core.metrics.migrations.inc()
        core.metrics.recent.event(
            "migration",
            f"request {request_tag(request['request_id'])}: worker {failed} failed after {len(state.generated)} tokens "
            f"({exc.code}); migrated", worker_id=failed,
        )  # fmt: skip

    legs = state.relaying(call)
    return migrating(state, lambda req: _attempt(core, req, state, legs), peer="worker", on_failure=failure)


def _attempt(core: RoutingCore, req: TokenRequest, state: MigrationState, call: CallInfo) -> AsyncGenerator[TokenChunk, None]:
    """Plan, then the attempt's stream: one aggregated leg itself (no generator layer around it), or prefill then decode."""
    state.current_worker = None
    max_tokens = req.get("stop", {}).get("max_tokens")
    plan = core.plan(req["model"], req["token_ids"], req.get("routing", {}), state.excluded, max_tokens=max_tokens)
    if plan.prefill is None:
        if plan.main.role == DECODE:
            core.metrics.local_prefills.inc()
        return _leg(core, req, plan.main, plan.hashes, state, call, "agg")
    return _disaggregated(core, req, plan, state, call)


def _prefill_request(core: RoutingCore, req: TokenRequest, plan: AttemptPlan) -> TokenRequest:
    """The prefill leg's request: context only, with the peer prefix pull the plan chose (shown on the dashboard)."""
    assert plan.prefill is not None
    prefill_req = req.copy()
    prefill_req["disagg"] = {"request_type": "context_only"}
    pull = plan.prefill.pull
    if pull is not None and pull.chosen:
        n = pull.peer.blocks
        prefill_req["disagg"]["kv_source"] = {
            "worker_id": pull.peer.worker_id, "address": pull.peer.address, "blocks": n, "block_size": plan.prefill.block_size,
            "kv_handle": prefix_handle(plan.prefill.block_size, plan.hashes[:n]), "tier": pull.peer.tier,
        }  # fmt: skip
        core.metrics.recent.event(
            "kv_pull",
            f"request {request_tag(req['request_id'])}: prefill on {plan.prefill.chosen.worker_id} pulls {n} blocks from "
            f"{pull.peer.worker_id} ({pull.pull_ms:.1f} ms vs {pull.recompute_ms:.1f} ms recompute)",
            worker_id=pull.peer.worker_id,
        )  # fmt: skip
    return prefill_req


async def _disaggregated(
    core: RoutingCore, req: TokenRequest, plan: AttemptPlan, state: MigrationState, call: CallInfo
) -> AsyncGenerator[TokenChunk, None]:
    assert plan.prefill is not None
    prefill_req = _prefill_request(core, req, plan)
    first: list[int] = []
    terminal: TokenChunk = {}
    # The prefill leg's tokens are collected here, not relayed: the decode leg decides what the caller sees.
    async with aclosing(_leg(core, prefill_req, plan.prefill, plan.hashes, state, call.relaying(None), "prefill")) as leg:
        async for chunk in leg:
            first.extend(chunk.get("token_ids", ()))
            if "finish_reason" in chunk:
                terminal = chunk
    params = terminal.get("disagg")
    remaining = state.remaining()
    if terminal.get("finish_reason") != "length" or not params or (remaining is not None and len(first) >= remaining):
        final = terminal.copy()
        final["token_ids"] = first
        final.pop("disagg", None)
        yield final
        return
    state.cached_tokens = params.get("cached_tokens", terminal.get("usage", {}).get("cached_tokens", 0))
    first_chunk: TokenChunk = {"token_ids": first}
    if "logprobs" in terminal:  # computed by the prefill leg only
        first_chunk["logprobs"] = terminal["logprobs"]
    if "prompt_logprobs" in terminal:
        first_chunk["prompt_logprobs"] = terminal["prompt_logprobs"]
    yield first_chunk

    p = plan.prefill.chosen
    decode_req = req.copy()
    decode_req["disagg"] = {
        **params, "request_type": "generation_only", "first_token_ids": list(params.get("first_token_ids") or first),
        "prefill_worker_id": p.worker_id, "prefill_address": p.address,
    }  # fmt: skip
    async with aclosing(_leg(core, decode_req, plan.main, plan.hashes, state, call, "decode")) as leg:
        async for chunk in leg:
            yield chunk


# size: a worker leg's per-chunk loop, relay and migration bookkeeping inline: a call per chunk costs on every token
async def _leg(
    core: RoutingCore,
    req: TokenRequest,
    decision: Decision,
    hashes: list[int],
    state: MigrationState,
    call: CallInfo,
    kind: str,
) -> AsyncGenerator[TokenChunk, None]:
    """One worker call: charge its load (and tell the replicas), stream, release — whatever happens.

    Every chunk, yielded or passed to `call.relay` (the worker session's reader calls it), takes the leg's
    bookkeeping first: the end of its prefill, and the timing of its first token and later steps.
    """
    cand = decision.chosen
    key = cand.key
    leg_id = f"{next(core.leg_ids):x}/{kind}"  # the router's own key of this leg (RouterCore.leg_ids)
    prefill_tokens = 0 if kind == "decode" else cand.prefill_tokens
    source = req.get("disagg", {}).get("kv_source")
    if source:  # the pulled prefix is not computed there
        prefill_tokens = min(
            prefill_tokens, max(0, len(req["token_ids"]) - source.get("blocks", 0) * source.get("block_size", 0))
        )
    blocks = max(1, decision.prompt_blocks - cand.overlap_blocks) + (0 if kind == "prefill" else 1)
    now = time.monotonic()
    # Nothing to wait for there: its time to first token is prefill (a leg that restores blocks from a
    # lower tier also spends restore time, which would bias the prefill slope: not fitted).
    # A leg pulling a peer's prefix (disagg.kv_source) spends transfer time likewise: not fitted either.
    idle = core.load.get(key).in_flight == 0 and not cand.lower_blocks and "kv_source" not in req.get("disagg", {})
    at_ms = int(time.time() * 1000)  # the charge's time, as the other replicas will see it (RouterSyncEvent)
    core.load.route(core.id, leg_id, key, prefill_tokens=prefill_tokens, blocks=blocks, now=at_ms / 1000.0)
    core.sync.routed(leg_id, key, prefill_tokens=prefill_tokens, blocks=blocks, at_ms=at_ms)
    entry = None
    if core.mode is RouterMode.KV:
        entry = core.inflight.add(key, hashes, entry_id=leg_id)
        core.index.touch(key, hashes[: cand.overlap_blocks], reused=True)  # the eviction order the router knows
    elif core.mode is RouterMode.APPROXIMATE:
        entry = core.inflight.add(key, hashes, entry_id=leg_id)  # what running requests share (no_room)
        core.approx.add(key, hashes, now=now)
    core.metrics.decided(decision.policy, role_name(decision.role), cand.overlap_blocks)
    core.metrics.recent.routed(req["request_id"], req["model"], kind, decision)
    worker = core.pool.get(cand.worker_id)
    if worker is not None and worker.dp_size > 1:
        req = req.copy()
        req["routing"] = {**req.get("routing", {}), "dp_rank": cand.dp_rank}
    state.current_worker = cand.worker_id
    prefilled = prefill_tokens == 0
    first = last = 0.0
    later_tokens = 0  # tokens after the first chunk: one per step of the worker

    def seen(chunk: TokenChunk) -> None:
        nonlocal prefilled, first, last, later_tokens
        if not prefilled:
            prefilled = True
            core.load.prefill_done(core.id, leg_id)
            core.sync.prefill_done(leg_id, key)
        if chunk.get("token_ids"):
            last = time.monotonic()
            if not first:
                first = last
                if idle and kind != "decode":
                    core.times.prefill(req["model"], cand.prefill_tokens, (first - now) * 1000)
            else:
                later_tokens += len(chunk["token_ids"])

    relay: ChunkRelay | None = None
    if (outbox := call.relay) is not None:

        def relay(chunk: TokenChunk) -> None:
            seen(chunk)
            outbox(chunk)

    try:
        async with aclosing(core.client(cand.address).generate(req, call=call.relaying(relay))) as stream:  # type: ignore[type-var]
            async for chunk in stream:
                seen(chunk)
                yield chunk
    finally:
        if later_tokens:
            core.times.step(key, (last - first) * 1000 / later_tokens)
        ended_ms = int(time.time() * 1000)  # as the other replicas will see it, like at_ms
        core.load.complete(core.id, leg_id, now=ended_ms / 1000.0)
        core.sync.completed(leg_id, key, at_ms=ended_ms)
        if entry is not None:
            core.inflight.remove(entry)
            if core.mode is RouterMode.KV:
                core.index.touch(key, hashes, reused=False)  # released now: the engine's most recently used
