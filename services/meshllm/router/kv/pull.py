"""Peer prefix pulls: should a disaggregated prefill leg pull a prompt prefix from another worker?

The prefill worker the policy chose serves `local_blocks` of the prompt
(its device cache, then its own lower tiers). Another worker of the model,
of any role, may hold more: `blocks` leading prompt blocks, `device_blocks`
of them in its device cache and the rest in its lower tiers (host memory,
disk). Pulling that prefix through the peer's `Worker.PullKv` costs

    pull_ms = restore_ms + transfer_ms
    restore_ms  = Σ over the peer's lower tiers of blocks × restore_ms_per_block
    transfer_ms = blocks × block_bytes / (--kv-pull-gbps × 1e9) × 1000

where `restore_ms_per_block` is the peer's advertised `block_bytes /
restore_bytes_per_s` of that tier (or its restore ratio × the prefill time
per block while not advertised) and `block_bytes` the peer's advertised
block size in bytes. Computing instead costs

    recompute_ms = (blocks − local_blocks) × prefill_ms_per_block

(the blocks the pull brings beyond what the chosen worker already serves,
at the model's measured prefill time per block). The pull is taken when
`pull_ms < recompute_ms`; of several peers the one saving most wins. No pull
while the prefill time per block or the peer's block bytes are unknown: the
rule never guesses a saving it cannot price. The decision, taken or not,
is shown by `Router.Route` (`RouteDecision.kv_pull`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshllm.router.policy.timing import RestoreCost
from meshllm.v1 import events_pb2, router_pb2

__all__ = ["PeerPrefix", "PullDecision", "decide_pull"]


@dataclass(frozen=True, slots=True)
class PeerPrefix:
    """What one peer holds of a prompt: leading blocks on its device, then per lower tier."""

    worker_id: str
    address: str
    device_blocks: int
    lower_blocks: dict[int, int] = field(default_factory=dict)  # tier -> blocks
    restore: tuple[RestoreCost, ...] = ()  # the cost of each tier of `lower_blocks`
    block_bytes: int = 0  # advertised bytes of one KV block (0 = unknown)

    @property
    def blocks(self) -> int:
        return self.device_blocks + sum(self.lower_blocks.values())

    @property
    def tier(self) -> int:
        """The farthest tier holding part of the prefix (DEVICE when none)."""
        return max(self.lower_blocks, default=events_pb2.KV_TIER_DEVICE)


@dataclass(frozen=True, slots=True)
class PullDecision:
    """One peer's pull priced against recomputing (see the module docstring)."""

    peer: PeerPrefix
    local_blocks: int
    restore_ms: float
    transfer_ms: float
    recompute_ms: float
    chosen: bool
    reason: str = ""

    @property
    def pull_ms(self) -> float:
        return self.restore_ms + self.transfer_ms

    def to_proto(self) -> router_pb2.KvPullDecision:
        p = self.peer
        by_tier = {r.tier: r for r in p.restore}
        return router_pb2.KvPullDecision(
            worker_id=p.worker_id, address=p.address, blocks=p.blocks, device_blocks=p.device_blocks,
            lower_tiers=[
                router_pb2.TierOverlap(
                    tier=t, blocks=n,  # type: ignore[arg-type]
                    restore_ms_per_block=by_tier[t].ms_per_block if t in by_tier else 0.0,
                    restore_ratio=by_tier[t].ratio if t in by_tier else 0.0,
                )
                for t, n in sorted(p.lower_blocks.items())
            ],
            local_blocks=self.local_blocks, restore_ms=self.restore_ms, transfer_ms=self.transfer_ms,
            recompute_ms=self.recompute_ms, pull_ms=self.pull_ms, chosen=self.chosen, reason=self.reason,
            block_bytes=p.block_bytes,
        )  # fmt: skip


def _price(peer: PeerPrefix, local_blocks: int, block_ms: float, bytes_per_s: float) -> PullDecision:
    by_tier = {r.tier: r for r in peer.restore}
    restore_ms = 0.0
    for tier, n in peer.lower_blocks.items():
        r = by_tier.get(tier)
        per_block = r.ms_per_block if r is not None and r.ms_per_block > 0 else (r.ratio if r is not None else 1.0) * block_ms
        restore_ms += n * per_block
    transfer_ms = peer.blocks * peer.block_bytes / bytes_per_s * 1000.0 if bytes_per_s > 0 else 0.0
    recompute_ms = (peer.blocks - local_blocks) * block_ms
    if block_ms <= 0:
        reason = "prefill time per block not measured yet"
    elif peer.block_bytes <= 0:
        reason = "peer advertises no KV block size"
    elif restore_ms + transfer_ms >= recompute_ms:
        reason = "recompute is cheaper"
    else:
        reason = ""
    return PullDecision(peer, local_blocks, restore_ms, transfer_ms, recompute_ms, not reason, reason)


def decide_pull(peers: Sequence[PeerPrefix], *, local_blocks: int, block_ms: float, bytes_per_s: float) -> PullDecision | None:
    """The pull to take (largest saving), else the deepest peer's refused pull; None when no peer holds more."""
    priced = [_price(p, local_blocks, block_ms, bytes_per_s) for p in peers if p.blocks > local_blocks]
    if not priced:
        return None
    taken = [d for d in priced if d.chosen]
    if taken:
        return max(taken, key=lambda d: (d.recompute_ms - d.pull_ms, d.peer.blocks, d.peer.worker_id))
    return max(priced, key=lambda d: (d.peer.blocks, d.peer.worker_id))
