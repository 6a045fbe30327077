"""KV between mockers: prefill KV held for decode legs, prefix handles served to peers and pulled from them.

A prefill leg's finished sequence keeps its blocks under a *hold* until its
decode leg presents the handle (`accept_handle`, on this engine), the request
is cancelled, or `--kv-hold-timeout` passes. A peer prefix pull
(`disagg.kv_source`) fetches the handle's pieces through the worker's
`kv_pull`, waits the transfer's simulated time, and caches the blocks on the
device; `serve_prefix` answers such a pull from any tier, after the blocks'
simulated restore time. The mocker has no KV bytes: a piece carries the
blocks' hashes, which the puller checks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable

from meshllm.engine.base import Context, KvPull, KvTier, KvTransfer
from meshllm.engine.mocker.block_manager import BlockManager
from meshllm.engine.mocker.config import MockerConfig
from meshllm.engine.mocker.handle import KvHandle, decode_kv_handle, encode_kv_handle
from meshllm.engine.mocker.sequence import Sequence
from meshllm.engine.mocker.timing import restore_seconds, transfer_seconds
from meshllm.errors import FailedPrecondition, InvalidArgument, NotFound, Overloaded, Unimplemented
from meshllm.protocol.kv import PREFIX_MAGIC, block_hashes, kv_source_prefix, parse_prefix_handle
from meshllm.protocol.types import DisaggInfo, KvSourceInfo

__all__ = ["KV_LAYOUT", "KvTransfers"]

log = logging.getLogger("meshllm.engine.mocker.engine")

KV_LAYOUT = "mocker-v1"


class KvTransfers:
    """One mocker's holds and pulls (see the module docstring).

    `wake` restarts the step loop (blocks were freed or cached); `released`
    runs after a hold's blocks were freed (the engine reports its load).
    """

    def __init__(
        self, config: MockerConfig, blocks: BlockManager, *, wake: Callable[[], None], released: Callable[[], None]
    ) -> None:
        self.config = config
        self.blocks = blocks
        self._wake = wake
        self._released = released
        self.nonce = secrets.randbits(64)
        self._hold_ids = itertools.count(1)
        self.holds: dict[int, tuple[Sequence, asyncio.TimerHandle]] = {}
        #: Prompt tokens pulled from peers' prefixes (`disagg.kv_source`), and pulls that fell back to computing.
        self.pulled_tokens = 0
        self.pull_failures = 0

    # ------------------------------------------------------------ holds (prefill → decode on this engine)
    def hold(self, seq: Sequence, worker_id: str) -> DisaggInfo:
        """Hold `seq`'s blocks for its decode leg and name them in a handle."""
        cfg = self.config
        hold_id = next(self._hold_ids)
        loop = asyncio.get_running_loop()
        self.holds[hold_id] = (seq, loop.call_later(cfg.kv_hold_timeout_s, self.release, hold_id))
        seq.hold_id = hold_id
        full = seq.num_prompt // cfg.block_size
        if seq.hashing:
            hashes = [bh for bh, _ in seq.block_hashes[:full]]
        else:
            hashes = block_hashes(seq.tokens[: seq.num_prompt], cfg.block_size)
        handle = KvHandle(cfg.block_size, seq.num_prompt, self.nonce, hold_id, tuple(hashes))
        return {
            "kv_handle": encode_kv_handle(handle),
            "prefill_worker_id": worker_id,
            "first_token_ids": seq.tokens[seq.num_prompt :],
            "cached_tokens": max(seq.num_cached_tokens, 0),
            "kv_bytes": seq.num_prompt * cfg.kv_bytes_per_token,
        }

    def accept_handle(self, data: bytes, prompt: list[int]) -> None:
        """Check a decode leg's handle; one of this engine's own holds becomes plain cache."""
        handle = decode_kv_handle(data)
        if handle.block_size != self.config.block_size:
            raise FailedPrecondition(f"kv_handle has block size {handle.block_size}, this mocker uses {self.config.block_size}")
        if handle.prompt_tokens != len(prompt):
            raise InvalidArgument(
                f"kv_handle covers {handle.prompt_tokens} prompt tokens, the request has {len(prompt)}", param="disagg"
            )
        if handle.engine_nonce == self.nonce and handle.hold_id in self.holds:
            self.release(handle.hold_id)  # the decode leg runs here: its prefix is now plain cache

    def release(self, hold_id: int) -> None:
        entry = self.holds.pop(hold_id, None)
        if entry is None:
            return
        seq, timer = entry
        timer.cancel()
        seq.hold_id = 0
        if seq.block_table:
            self.blocks.deallocate(seq)
        self._wake()
        self._released()

    def release_all(self) -> None:
        for hold_id in list(self.holds):
            self.release(hold_id)

    def transfer_time(self, tokens: int) -> float:
        """Seconds the KV of `tokens` takes to arrive (a decode leg's simulated transfer)."""
        cfg = self.config
        return transfer_seconds(tokens, cfg.kv_bytes_per_token, cfg.kv_transfer_bandwidth, cfg.speedup_ratio)

    # ------------------------------------------------------------ peer prefix pulls
    async def serve_prefix(self, kv_handle: bytes, layout: str) -> AsyncIterator[KvTransfer]:
        """Serve a prefix handle (`meshllm.protocol.kv.prefix_handle`) from any tier of this mocker.

        NOT_FOUND when some block of it is in no tier any more; the blocks'
        lower-tier restore time (per tier, `--speedup-ratio` applied) passes
        before the one piece, whose data is the blocks' hashes (the mocker has
        no KV to send: the puller checks them and simulates the transfer).
        Prefill legs' own handles are not served (decode legs simulate them).
        """
        parsed = parse_prefix_handle(kv_handle)
        if parsed is None:
            raise Unimplemented("the mocker serves prefix handles only (its decode legs simulate the prefill KV transfer)")
        block_size, hashes = parsed
        if layout and layout != KV_LAYOUT:
            raise FailedPrecondition(f"KV layout mismatch: the puller has {layout!r}, this mocker {KV_LAYOUT!r}")
        if block_size != self.config.block_size:
            raise FailedPrecondition(f"prefix handle has block size {block_size}, this mocker uses {self.config.block_size}")
        per_tier: dict[KvTier, int] = {}
        for i, bh in enumerate(hashes):
            tier = self.blocks.holder(bh)
            if tier is None:
                raise NotFound(f"prefix block {i} ({bh:016x}) is no longer held here")
            per_tier[tier] = per_tier.get(tier, 0) + 1
        delay = sum(
            restore_seconds(per_tier.get(t.tier, 0), t.block_bytes, t.restore_bytes_per_s, self.config.speedup_ratio)
            for t in self.blocks.tiers
        )
        if delay > 0:
            await asyncio.sleep(delay)
        data = kv_handle[len(PREFIX_MAGIC) + 4 :]
        yield KvTransfer(data, len(data), KV_LAYOUT, len(hashes) * block_size)

    async def pull_prefix(self, seq: Sequence, source: KvSourceInfo, context: Context, kv_pull: KvPull) -> bool:
        """Pull `source`'s prefix from the peer into the device cache, or leave the prompt to be computed.

        False only when the request was cancelled meanwhile. Any failure of
        the pull (peer gone, blocks evicted there, layout or block mismatch,
        no room here) is logged and the prompt is computed as usual.
        """
        pull = await context.unless_stopped(self._fetch(seq, source, kv_pull))
        if pull is None:
            return False
        exc = pull.exception()
        if exc is not None:
            self.pull_failures += 1
            log.warning(
                "request %s: pulling %s prefix blocks from %s failed (%s: %s); computing them",
                seq.request_id, source.get("blocks", 0), source.get("address", "?"), type(exc).__name__, exc,
            )  # fmt: skip
        return True

    async def _fetch(self, seq: Sequence, source: KvSourceInfo, kv_pull: KvPull) -> None:
        cfg = self.config
        address, handle, block_size, hashes = kv_source_prefix(source)
        prefix = seq.block_hashes[: len(hashes)] if seq.hashing else []
        if block_size != cfg.block_size or [bh for bh, _ in prefix] != hashes:
            raise FailedPrecondition("disagg.kv_source names blocks that are not this prompt's")
        data = bytearray()
        n_tokens = 0
        async for piece in kv_pull(address, handle, KV_LAYOUT):
            if not data and piece.layout and piece.layout != KV_LAYOUT:
                raise FailedPrecondition(f"peer KV layout {piece.layout!r} is not {KV_LAYOUT!r}")
            n_tokens = n_tokens or piece.n_tokens
            data += piece.data
        if bytes(data) != handle[len(PREFIX_MAGIC) + 4 :] or n_tokens != len(hashes) * block_size:
            raise FailedPrecondition("the peer served other blocks than the prefix asked for")
        delay = self.transfer_time(n_tokens)
        if delay > 0:
            await asyncio.sleep(delay)
        if not self.blocks.insert_pulled(prefix):
            raise Overloaded(f"no room for {len(prefix)} pulled blocks")
        self.pulled_tokens += n_tokens
        self._wake()
