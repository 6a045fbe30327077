"""What a router did lately, for the live mesh page (`/dashboard`): bounded rings, no I/O.

`RecentActivity` keeps the last `DECISIONS` routing decisions (each leg of a
request is one: aggregated, prefill or decode) with every candidate's cost
terms — the same terms `Router.Route` explains — and the last `EVENTS`
notable events (migrations, KV index resyncs, event gaps, request errors).
Recording is an append to a deque (the hot path pays nothing else); the
decisions are turned into plain dicts only when a page asks.

Nothing here shows a request's id: the page may be seen by others than the
request's sender, and an id can be a handle (an abort, a stored response).
Decisions and events name a request by `request_tag`, a short one-way
digest of its id that an operator can compute from a log line to match
the two.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshllm.router.policy.choice import REUSED_EVICT_COST
from meshllm.v1 import events_pb2

if TYPE_CHECKING:
    from meshllm.router.policy.decision import Decision

__all__ = ["DECISIONS", "EVENTS", "RecentActivity", "decision_dict", "request_tag"]

_TIER_NAMES: dict[int, str] = {events_pb2.KV_TIER_HOST: "host", events_pb2.KV_TIER_DISK: "disk"}

DECISIONS = 64
EVENTS = 128


def request_tag(request_id: str) -> str:
    """A request's name on the dashboard: `r-` + 10 hex digits of a BLAKE2b digest of its id (not usable as the id)."""
    return "r-" + hashlib.blake2b(request_id.encode(), digest_size=5).hexdigest()


@dataclass(frozen=True, slots=True)
class _Routed:
    at: float  # wall-clock seconds
    request_id: str
    model: str
    leg: str  # agg, prefill, decode
    decision: Decision


def decision_dict(d: Decision) -> dict[str, Any]:
    """A decision as JSON-ready data: the chosen worker and every candidate's cost terms."""
    return {
        "worker_id": d.chosen.worker_id,
        "dp_rank": d.chosen.dp_rank,
        "policy": d.policy,
        "block_size": d.block_size,
        "prompt_blocks": d.prompt_blocks,
        "overlap_weight": d.overlap_weight,
        "capacity_weight": d.capacity_weight,
        "wait_weight": d.wait_weight,
        "prefill_ms_per_block": round(d.block_ms, 4),
        "prefill_fixed_ms": round(d.fixed_ms, 3),
        "reused_evict_cost": REUSED_EVICT_COST,
        "candidates": [
            {
                "worker_id": c.worker_id,
                "dp_rank": c.dp_rank,
                "overlap_blocks": c.overlap_blocks,
                "prefill_tokens": c.prefill_tokens,
                "queued_prefill_tokens": c.queued_prefill_tokens,
                "decode_blocks": c.decode_blocks,
                "in_flight": c.in_flight,
                "prefilling": c.prefilling,
                "resident_blocks": c.cached_blocks,
                "total_blocks": c.total_blocks,
                "new_blocks": c.new_blocks,
                "evicted_hot_blocks": c.evicted_hot_blocks,
                "pressure": round(c.pressure, 3),
                "step_ms": round(c.step_ms, 3),
                "wait_blocks": round(c.wait_blocks, 3),
                "lower_tiers": [
                    {
                        "tier": _TIER_NAMES.get(r.tier, str(r.tier)),
                        "blocks": c.lower_blocks.get(r.tier, 0),
                        "restore_ms_per_block": round(r.ms_per_block, 4),
                        "restore_ratio": round(r.ratio, 4),
                    }
                    for r in c.restore
                ],
                "restore_blocks": round(c.restore_blocks, 3),
                "evict_ratio": round(c.evict_ratio, 4),
                "no_room": c.no_room,
                "cost": round(c.cost, 3),
                "chosen": c is d.chosen,
            }
            for c in d.candidates
        ],
    }


class RecentActivity:
    """Rings of recent decisions and events (newest last)."""

    def __init__(self, *, decisions: int = DECISIONS, events: int = EVENTS) -> None:
        self._decisions: deque[_Routed] = deque(maxlen=decisions)
        self._events: deque[dict[str, Any]] = deque(maxlen=events)
        self.seq = 0  # events recorded so far (a page asks for those after the last it saw)

    def routed(self, request_id: str, model: str, leg: str, decision: Decision) -> None:
        """One leg of a request for `model` was sent to `decision.chosen`."""
        self._decisions.append(_Routed(time.time(), request_id, model, leg, decision))

    def event(self, kind: str, text: str, *, worker_id: str = "") -> None:
        """A notable event: `kind` is migration, resync, gap, error, worker-joined, worker-left."""
        self.seq += 1
        self._events.append({"seq": self.seq, "at": time.time(), "kind": kind, "text": text, "worker_id": worker_id})

    def decisions(self, limit: int = DECISIONS) -> list[dict[str, Any]]:
        """The newest `limit` decisions, newest first."""
        out = []
        for r in list(self._decisions)[-limit:][::-1]:
            tag = request_tag(r.request_id)
            out.append({"at": r.at, "request": tag, "model": r.model, "leg": r.leg, **decision_dict(r.decision)})
        return out

    def events(self, limit: int = EVENTS) -> list[dict[str, Any]]:
        """The newest `limit` events, newest first."""
        return list(self._events)[-limit:][::-1]
