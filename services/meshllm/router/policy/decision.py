"""What a routing core decides: a `Decision` (a worker and what led to it) and where an attempt runs (`AttemptPlan`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.router.kv.pull import PullDecision
from meshllm.router.policy.choice import REUSED_EVICT_COST, Candidate
from meshllm.v1 import router_pb2

__all__ = ["AttemptPlan", "Decision"]


@dataclass(slots=True)
class Decision:
    """A routing decision with everything that led to it."""

    chosen: Candidate
    candidates: list[Candidate]  # those scored: every eligible one, or at fleet scale those that could win (fleet.py)
    role: int
    policy: str
    block_size: int
    prompt_blocks: int
    overlap_weight: float = 0.0
    capacity_weight: float = 0.0
    wait_weight: float = 0.0
    block_ms: float = 0.0  # the model's measured prefill time per block (0 = unknown)
    fixed_ms: float = 0.0  # the model's measured fixed time of a prefill step (0 = unknown)
    pull: PullDecision | None = None  # prefill pool: the peer prefix pull considered (router/kv/pull.py)

    def to_proto(self) -> router_pb2.RouteDecision:
        c = self.chosen
        return router_pb2.RouteDecision(
            worker_id=c.worker_id, dp_rank=c.dp_rank, address=c.address, role=self.role,  # type: ignore[arg-type]
            policy=self.policy, prompt_blocks=self.prompt_blocks, block_size=self.block_size,
            overlap_weight=self.overlap_weight, capacity_weight=self.capacity_weight,
            wait_weight=self.wait_weight, prefill_ms_per_block=self.block_ms, reused_evict_cost=REUSED_EVICT_COST,
            prefill_fixed_ms=self.fixed_ms,
            candidates=[
                router_pb2.CandidateScore(
                    worker_id=k.worker_id, dp_rank=k.dp_rank, overlap_blocks=k.overlap_blocks,
                    prefill_tokens=k.prefill_tokens, decode_blocks=k.decode_blocks, cost=k.cost, address=k.address,
                    queued_prefill_tokens=k.queued_prefill_tokens, in_flight=k.in_flight, prefilling=k.prefilling,
                    total_blocks=k.total_blocks,
                    resident_blocks=k.cached_blocks, new_blocks=k.new_blocks, evicted_hot_blocks=k.evicted_hot_blocks,
                    pressure=k.pressure, step_ms=k.step_ms, wait_blocks=k.wait_blocks,
                    restore_blocks=k.restore_blocks, evict_ratio=k.evict_ratio, no_room=k.no_room,
                    lower_tiers=[
                        router_pb2.TierOverlap(
                            tier=r.tier, blocks=k.lower_blocks.get(r.tier, 0),  # type: ignore[arg-type]
                            restore_ms_per_block=r.ms_per_block, restore_ratio=r.ratio,
                        )
                        for r in k.restore
                    ],
                )
                for k in self.candidates
            ],
            kv_pull=self.pull.to_proto() if self.pull is not None else None,
        )  # fmt: skip


@dataclass(slots=True)
class AttemptPlan:
    """Where one attempt runs: `main` (aggregated or decode) and, when disaggregated, `prefill`."""

    main: Decision
    prefill: Decision | None
    hashes: list[int]
