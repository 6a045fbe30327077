"""`MockerEngine`: the simulated vLLM-like engine behind the `LLMEngine` contract.

One asyncio task runs the step loop: `schedule()` picks the batch and
allocates KV, the step's simulated duration passes (`timing`, divided by
`--speedup-ratio`; at 0 the loop only yields; a step already due on the
model's timeline passes at once, see `timing`), and `postprocess()` appends
one token to every sequence that finished computing and wakes its stream.
A stream (`generate`) only reads its sequence: tokens that piled up while the
consumer was busy leave as one chunk.

Roles. A "context_only" request computes its prompt, samples the first token
and ends with one terminal chunk whose `disagg.kv_handle` names the prompt's
blocks; those blocks stay referenced until `--kv-hold-timeout` passes (the
mocker's `pull_kv` serves prefix handles only, so nobody fetches them), the
request is cancelled, or a decode leg on this same engine presents the handle.
A "context_only" request with `disagg.kv_source` first pulls that peer's
prefix (`KvTransfers.pull_prefix`, mocker/transfer.py: the transfer's simulated time, then the blocks are
cached on the device) so that its admission finds them; a failed pull
computes the prompt. A
"generation_only" request allocates the prompt's blocks as if transferred
(reported with BlocksStored like computed ones), waits the simulated
transfer of the tokens it does not already cache, then continues after
`disagg.first_token_ids`; its usage counts those first tokens.

Lower KV tiers (--kv-host-bytes, --kv-disk-bytes): device evictions move to
host memory, host evictions to disk (`tiers`); a prompt whose cached prefix
reaches into them has those blocks restored (the step that prefills the
rest of it also takes `timing.restore_seconds`) instead of prefilled, and its usage counts them as cached. `start()`
declares the tiers in `EngineConfig.kv_tiers`, load samples carry their
usage (`LoadMetrics.tiers`), and `stats` counts hits per tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Self

from meshllm.engine.base import Context, EngineConfig, KvTier, KvTransfer, LLMEngine, LoadMetrics, terminal
from meshllm.engine.mocker.admission import new_sequence
from meshllm.engine.mocker.block_manager import BlockManager, PrefixHit
from meshllm.engine.mocker.config import MockerConfig, add_mocker_args
from meshllm.engine.mocker.scheduler import CacheStats, Scheduler
from meshllm.engine.mocker.sequence import Sequence, SequenceStatus
from meshllm.engine.mocker.tiers import LowerTier
from meshllm.engine.mocker.timing import StepPacer, restore_seconds, step_ms
from meshllm.engine.mocker.transfer import KV_LAYOUT, KvTransfers
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.errors import (
    EngineShutdown,
    Unknown,
)
from meshllm.protocol.chunks import coalescing
from meshllm.protocol.types import TokenChunk, TokenRequest, TokenUsage

__all__ = ["KV_LAYOUT", "MockerEngine", "StepReport"]

log = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.1
# The longest the step loop runs steps that are already due without letting the rest of its process run.
MAX_BURST_S = 0.001


@dataclass(frozen=True, slots=True)
class StepReport:
    """One finished step, for `MockerEngine.on_step` observers (tests, benchmarks)."""

    prefill_tokens: int
    decode_seqs: int
    num_seqs: int
    kv_usage: float
    model_ms: float  # the timing model's step time, before --speedup-ratio (restores included)
    waiting: int
    running: int
    restore_ms: float = 0.0  # of model_ms, the lower-tier restores of the sequences admitted this step


class MockerEngine(LLMEngine):
    """A vLLM-like engine with no model: real scheduling, paged KV and KV events; simulated time."""

    def __init__(self, config: MockerConfig | None = None) -> None:
        self.config = cfg = config or MockerConfig()
        tiers = [
            LowerTier(tier, budget, cfg.block_bytes, gbps * 1e9)
            for tier, budget, gbps in (
                (KvTier.HOST, cfg.kv_host_bytes, cfg.kv_host_bandwidth),
                (KvTier.DISK, cfg.kv_disk_bytes, cfg.kv_disk_bandwidth),
            )
            if budget > 0
        ]
        self.blocks = BlockManager(
            cfg.num_gpu_blocks,
            cfg.block_size,
            self.sink,
            prefix_caching=cfg.enable_prefix_caching,
            watermark_blocks=cfg.watermark_blocks,
            tiers=tiers,
        )
        self._wake = asyncio.Event()
        #: Prefill KV held for decode legs, prefix handles served to peers and pulled from them.
        self.transfers = KvTransfers(cfg, self.blocks, wake=self._wake.set, released=self._report_load)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            transfer_time=self.transfers.transfer_time,
            restore_ms=self._restore_ms,
        )
        #: Called after every step with what it did (tests and benchmarks observe through it).
        self.on_step: Callable[[StepReport], None] | None = None
        self.worker_id = ""
        self._by_ctx: dict[Context, Sequence] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._failure = ""
        self._load_key: tuple[int, ...] | None = None
        self._load_at = -LOAD_INTERVAL_S
        self._load_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ lifecycle
    @classmethod
    async def from_args(cls, argv: Seq[str]) -> tuple[Self, WorkerConfig]:
        parser = worker_arg_parser("mocker")
        add_mocker_args(parser)
        ns = parser.parse_args(list(argv))
        return cls(MockerConfig.from_namespace(ns)), WorkerConfig.from_namespace(ns, engine="mocker")

    async def start(self, worker_id: str) -> EngineConfig:
        if self._closing is not None:
            raise EngineShutdown("the mocker engine was cleaned up")
        self.worker_id = worker_id
        self.blocks.sink = self.sink
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mocker-steps-{worker_id}")
        cfg = self.config
        return EngineConfig(
            model=cfg.model_name,
            kv_block_size=cfg.block_size,
            total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            context_length=cfg.context_length,
            vocab_size=cfg.vocab_size,
            eos_token_ids=(cfg.eos_token_id,),
            tokenizer_source="builtin:mocker",
            kv_layout=KV_LAYOUT,
            kv_tiers=tuple(t.tier for t in self.blocks.tiers),
        )

    async def cleanup(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._cleanup())
        await asyncio.shield(self._closing)

    async def _cleanup(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.transfers.release_all()
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            sched.abort(seq)
        if self._load_timer is not None:
            self._load_timer.cancel()

    async def abort(self, context: Context) -> None:
        seq = self._by_ctx.get(context)
        if seq is not None:
            self._drop(seq)

    async def clear_kv_blocks(self) -> int:
        return self.blocks.clear()

    @property
    def stats(self) -> CacheStats:
        """Prompt tokens, cached tokens per tier (device, host, disk) and prefill tokens computed so far."""
        return self.scheduler.stats

    @property
    def pulled_tokens(self) -> int:
        """Prompt tokens pulled from peers' prefixes (`disagg.kv_source`)."""
        return self.transfers.pulled_tokens

    @property
    def pull_failures(self) -> int:
        """Peer prefix pulls that failed, whose prompts were computed instead."""
        return self.transfers.pull_failures

    @property
    def num_holds(self) -> int:
        """Finished prefill legs whose KV is still held for a decode leg."""
        return len(self.transfers.holds)

    # ------------------------------------------------------------ streams
    def takes_relay(self) -> bool:
        # A subclass that overrides generate (to look at or change the chunks) gets every chunk through it.
        return type(self).generate is MockerEngine.generate

    # size: an engine stream: admission, the per-step delivery loop and its cleanup in one generator whose finally frees the KV
    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        if self._task is None or self._task.done():
            raise EngineShutdown(self._failure or "the mocker engine is not running")
        seq = new_sequence(request, self.config, self.transfers.accept_handle)
        if seq.num_output >= seq.max_tokens:  # a decode leg whose first tokens already reached max_tokens
            yield terminal("length", self._usage(seq))
            return
        source = (request.get("disagg") or {}).get("kv_source")
        if seq.context_only and source and self.kv_pull is not None:
            if not await self.transfers.pull_prefix(seq, source, context, self.kv_pull):
                yield terminal("cancelled", self._usage(seq))
                return
        loop = asyncio.get_running_loop()
        self._by_ctx[context] = seq
        seq.relay = context.relay  # the step loop hands it each step's tokens (Context.relay); the terminal is yielded
        self.scheduler.add(seq)
        self._wake.set()
        watcher = asyncio.ensure_future(context.stopped())
        watcher.add_done_callback(lambda _: seq.wake())
        delivered = False
        try:
            while True:
                if context.is_stopped():
                    self._drop(seq)
                    delivered = True
                    yield terminal("cancelled", self._usage(seq))
                    return
                if seq.relay_error is not None:
                    err = seq.relay_error
                    raise Unknown(f"the stream's chunk relay failed: {type(err).__name__}: {err}")
                # Without coalescing (--no-coalesce) a consumer that lags still gets one chunk per step (one token).
                step = None if coalescing() else 1
                reason = seq.finish_reason
                if reason is not None and seq.status is SequenceStatus.FINISHED:
                    if reason == "error":
                        raise Unknown(self._failure)
                    if step is not None and seq.unsent > step:
                        yield {"token_ids": seq.take_output(step)}
                        continue
                    disagg = self.transfers.hold(seq, self.worker_id) if seq.context_only and reason == "length" else None
                    delivered = True
                    yield terminal(reason, self._usage(seq), token_ids=seq.take_output(), disagg=disagg)
                    return
                fresh = seq.take_output(step)
                if fresh:
                    yield {"token_ids": fresh}
                    continue
                waiter = seq.waiter = loop.create_future()
                await waiter
        finally:
            seq.relay = None  # nothing reaches the consumer after its iterator is closed
            watcher.cancel()
            self._by_ctx.pop(context, None)
            if not delivered or seq.status is not SequenceStatus.FINISHED:
                self._drop(seq)  # the consumer went away: free the KV now, held or not

    # ------------------------------------------------------------ peer prefix pulls
    def pull_kv(self, kv_handle: bytes, layout: str) -> AsyncIterator[KvTransfer]:
        """Serve a prefix handle from any tier of this mocker (`KvTransfers.serve_prefix`)."""
        return self.transfers.serve_prefix(kv_handle, layout)

    def _usage(self, seq: Sequence) -> TokenUsage:
        return {
            "prompt_tokens": seq.num_prompt,
            "completion_tokens": seq.num_output,
            "cached_tokens": max(seq.num_cached_tokens, 0),
        }

    def _drop(self, seq: Sequence) -> None:
        """Free `seq` now, wherever it is (waiting, running, finished holding KV)."""
        if seq.hold_id:
            self.transfers.release(seq.hold_id)
        self.scheduler.abort(seq)
        self._wake.set()

    def _restore_ms(self, hit: PrefixHit) -> float:
        """Model milliseconds (before --speedup-ratio) to restore a hit's lower-tier blocks, one tier after the other."""
        per_tier = {KvTier.HOST: hit.host, KvTier.DISK: hit.disk}
        return 1000 * sum(restore_seconds(per_tier[t.tier], t.block_bytes, t.restore_bytes_per_s, 1.0) for t in self.blocks.tiers)

    # ------------------------------------------------------------ step loop
    async def _run(self) -> None:
        try:
            await self._steps()
        except Exception as exc:  # a simulator bug must fail the streams, not leave them hanging
            log.exception("mocker step loop failed")
            self._failure = f"mocker step loop failed: {exc!r}"
            sched = self.scheduler
            for seq in [*sched.running, *sched.waiting]:
                seq.finish_reason = "error"
                sched.abort(seq)

    # size: the step loop: schedule, timing, postprocess and load per step, inline (it runs once per simulated step)
    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        sched, blocks, speedup = self.scheduler, self.blocks, self.config.speedup_ratio
        pacer = StepPacer()
        yielded_at = loop.time()  # when the step loop last let the rest of the process run
        while True:
            if not sched.has_work():
                pacer.idle()
                self._report_load()
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = loop.time()
            plan = sched.schedule(t0)
            if not plan.seqs:  # only transfers in flight, or nothing fits until KV is released
                pacer.idle()
                self._report_load()
                self._wake.clear()
                ready = sched.next_ready_at()
                timeout = None if ready is None else max(0.0, ready - loop.time())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            usage = blocks.usage
            model_ms = step_ms(plan.prefill_tokens, plan.decode_seqs > 0, usage) + plan.restore_ms
            behind = False
            if speedup > 0:  # the step's own compute counts towards its simulated duration
                wait = pacer.step_end(t0, model_ms / 1000.0 / speedup) - loop.time()
                # A step already over on the model's timeline (the loop ran others meanwhile) ends now, without
                # a yield: a GPU would have run it while this process was busy, so its tokens join the others
                # its streams have not taken yet. The pacer bounds how far behind that may go (MAX_LAG_S).
                behind = wait <= 0 and loop.time() - yielded_at < MAX_BURST_S
                if not behind:
                    await asyncio.sleep(max(0.0, wait))
                    yielded_at = loop.time()
            else:
                await asyncio.sleep(0)
            sched.postprocess(plan)  # a finished prefill leg's hold starts when its stream ends
            if speedup > 0 and not behind:
                # The step's tokens are in their streams' relays and queues: let the writers send them before
                # this step's bookkeeping (load report, step hook) and the next step's scheduling delay them.
                await asyncio.sleep(0)
                yielded_at = loop.time()
            if self.on_step is not None:
                n_wait, n_run = len(sched.waiting), len(sched.running)
                self.on_step(
                    StepReport(
                        plan.prefill_tokens, plan.decode_seqs, len(plan.seqs), usage, model_ms, n_wait, n_run, plan.restore_ms
                    )
                )
            self._report_load()

    # ------------------------------------------------------------ load
    def _load_now(self) -> tuple[int, ...]:
        blocks, sched = self.blocks, self.scheduler
        return (blocks.num_used, len(sched.waiting), len(sched.running), *(len(t) for t in blocks.tiers))

    def _report_load(self) -> None:
        key = self._load_now()
        if key == self._load_key or self._load_timer is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._load_at + LOAD_INTERVAL_S - loop.time()
        if wait > 0:
            self._load_timer = loop.call_later(wait, self._flush_load)
            return
        self._emit_load(key, loop.time())

    def _flush_load(self) -> None:
        self._load_timer = None
        key = self._load_now()
        if key != self._load_key:
            self._emit_load(key, asyncio.get_running_loop().time())

    def _emit_load(self, key: tuple[int, ...], now: float) -> None:
        sched = self.scheduler
        queued = sum(s.num_tokens for s in sched.waiting if not s.remote_kv)
        queued += sum(s.num_tokens - s.num_computed for s in sched.running if not s.prefilled and s.ready_at < 0)
        self._load_key, self._load_at = key, now
        tiers = self.blocks.tier_usage()
        self.sink.load(LoadMetrics(key[0], self.blocks.num_blocks, key[1], key[2], queued_prefill_tokens=queued, tiers=tiers))
