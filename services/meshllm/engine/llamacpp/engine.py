"""`LlamaCppEngine`: real CPU inference on GGUF models behind the `LLMEngine` contract.

The event-loop side validates requests, hands sequences to the engine thread
(`runner.Runner`: backend + slot table + scheduler), and turns what each step
delivers into chunks; tokens that piled up while a consumer was busy leave as
one chunk. Cancellation (`context.stop()`, `abort`, or a dropped iterator)
frees the sequence's slot on the thread's next turn; the "cancelled" terminal
waits (≤ 1 s) for that acknowledgement, so once it arrives the slot is free.

Roles. A "context_only" leg evaluates the prompt, samples the first token and
ends with one terminal chunk whose `disagg` holds a kv handle; the prompt's
sequence state stays held on this engine until a decode worker pulls it once
through `pull_kv` (~1 MiB pieces) or `--kv-hold-timeout` passes. A
"generation_only" leg pulls that state from `disagg.prefill_address` (or
takes it locally when the handle is this engine's), loads it into a free slot
and continues after `disagg.first_token_ids`; its usage counts those first
tokens as completion tokens and reports the prefill's cached tokens.

Prompt logprobs (`output.prompt_logprobs`): the prompt is evaluated whole
with logits at every position (no prefix-cache reuse for that request) and
its tokens' logprobs ride on the first chunk. llama.cpp's output buffer grows
to `n_batch x n_vocab` floats for such a batch (SmolLM2: 512 x 49152 x 4 B ≈
100 MB) and keeps that size. A decode leg leaves them to its prefill leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import logging
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, Self

from meshllm.config import ConfigError
from meshllm.engine.base import Context, EngineConfig, KvTransfer, LLMEngine, LoadMetrics, terminal
from meshllm.engine.llamacpp import openmp
from meshllm.engine.llamacpp.config import LlamaCppConfig, add_llamacpp_args, per_worker_disk_dir
from meshllm.engine.llamacpp.files import write_model_files
from meshllm.engine.llamacpp.requests import Stream, add_command, cancel_command, new_sequence
from meshllm.engine.llamacpp.runner import Runner
from meshllm.engine.llamacpp.scheduler import Scheduler
from meshllm.engine.llamacpp.sequence import Finish, Output, Sequence
from meshllm.engine.llamacpp.slots import BlocksStored, KvEvent
from meshllm.engine.llamacpp.tiers import TierStats
from meshllm.engine.llamacpp.transfer import KvHandle, KvHolds, check_layout, pieces, pull_remote
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.errors import ContextLengthExceeded, EngineShutdown, FailedPrecondition, InvalidArgument, NotFound
from meshllm.protocol.kv import kv_source_prefix, parse_prefix_handle, stored_blocks
from meshllm.protocol.types import DisaggInfo, KvSourceInfo, TokenChunk, TokenRequest

__all__ = ["LlamaCppEngine"]

log = logging.getLogger("meshllm.engine.llamacpp")

CANCEL_ACK_S = 1.0
INSTALL_HINT = (
    "the llamacpp engine needs llama-cpp-python: in the meshllm clone, "
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF' pip install '.[llamacpp]'"
)


class LlamaCppEngine(LLMEngine):
    """llama.cpp with continuous batching, prefix caching, KV events and real KV transfer."""

    supports_prompt_logprobs = True  # the prompt is evaluated with logits on (see the module docstring)
    supports_embeddings = True  # a second, pooling context (backend.embed)
    supports_guided_decoding = True  # GBNF grammars (sampling.guided_grammar)

    def __init__(self, config: LlamaCppConfig) -> None:
        self.config = config
        self.worker_id = ""
        self.layout = ""
        self._nonce = secrets.randbits(64)
        #: Prefill results waiting for their decode leg (served once by `pull_kv`).
        self.holds = KvHolds(self._nonce, config.kv_hold_timeout_s)
        #: Prompt tokens pulled from peers' tier prefixes (`disagg.kv_source`), and pulls that fell back to computing.
        self.pulled_tokens = 0
        self.pull_failures = 0
        self._runner: Runner | None = None
        self._info: Any = None
        self._live: dict[Context, tuple[Sequence, Stream]] = {}
        self._files: dict[str, Path] = {}
        self._files_dir: Path | None = None
        self._closing: asyncio.Future[None] | None = None
        #: How llama.cpp's threads wait, once started ("spin" or "passive"; openmp.py).
        self.omp_wait = ""
        openmp.register(self, max(config.n_threads, config.n_threads_batch))

    # ------------------------------------------------------------ lifecycle
    @classmethod
    async def from_args(cls, argv: Seq[str]) -> tuple[Self, WorkerConfig]:
        parser = worker_arg_parser("llamacpp")
        add_llamacpp_args(parser)
        ns = parser.parse_args(list(argv))
        if importlib.util.find_spec("llama_cpp") is None:
            raise ConfigError(INSTALL_HINT)
        return cls(LlamaCppConfig.from_namespace(ns)), WorkerConfig.from_namespace(ns, engine="llamacpp")

    @classmethod
    def instance_args(cls, argv: Seq[str], index: int, count: int) -> list[str]:
        """Each of several workers built from the same flags gets `--kv-disk-dir D/worker-<index>` (one lock each)."""
        return per_worker_disk_dir(argv, index) if count > 1 else list(argv)

    async def start(self, worker_id: str) -> EngineConfig:
        if self._closing is not None:
            raise EngineShutdown("the llamacpp engine was cleaned up")
        self.omp_wait = openmp.decide(self.config.omp_wait)  # before llama.cpp (and OpenMP) loads
        from meshllm.engine.llamacpp.backend import LlamaBackend  # imports llama_cpp

        self.worker_id = worker_id
        cfg = self.config
        t0 = time.monotonic()
        self._runner = Runner(cfg, LlamaBackend, self._deliver)
        info = self._info = await self._runner.start()
        self.layout = info.kv_layout
        self._files_dir = Path(tempfile.mkdtemp(prefix="meshllm-llamacpp-files-"))
        self._files = await asyncio.to_thread(
            write_model_files, cfg.model_path, self._files_dir, context_length=cfg.n_ctx, eos_token_ids=info.eos_token_ids
        )
        log.info(
            "llamacpp %s loaded in %.1f s: %d slots x %d tokens, %d decode / %d prompt threads (OpenMP %s), layout %s",
            cfg.served_model_name, time.monotonic() - t0, cfg.n_seq_max, cfg.n_ctx, cfg.n_threads, cfg.n_threads_batch,
            self.omp_wait, self.layout,
        )  # fmt: skip
        return EngineConfig(
            model=cfg.served_model_name,
            kv_block_size=cfg.block_size,
            total_kv_blocks=cfg.n_seq_max * (cfg.n_ctx // cfg.block_size),
            max_num_seqs=cfg.n_seq_max,
            max_num_batched_tokens=cfg.n_batch,
            context_length=cfg.n_ctx,
            vocab_size=info.n_vocab,
            eos_token_ids=info.eos_token_ids,
            bos_token_id=info.bos_token_id,
            tokenizer_source="",
            chat_template=info.chat_template,
            kv_layout=self.layout,
            kv_tiers=self._runner.tiers.kinds if self._runner.tiers is not None else (),
        )

    async def cleanup(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._cleanup())
        await asyncio.shield(self._closing)

    async def _cleanup(self) -> None:
        openmp.unregister(self)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.stop()
        self.holds.clear()
        if self._files_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._files_dir, True)

    async def abort(self, context: Context) -> None:
        live = self._live.get(context)
        if live is not None and self._runner is not None:
            self._runner.submit(cancel_command(live[0]))

    async def clear_kv_blocks(self) -> int:
        runner = self._require_runner()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def settle(n: int) -> None:
            if not done.done():
                done.set_result(n)

        def clear(sched: Scheduler) -> None:
            loop.call_soon_threadsafe(settle, sched.clear_cache())

        runner.submit(clear)
        return await done

    def tier_stats(self) -> TierStats | None:
        """The lower tiers' counters (hits, restored tokens and bytes per tier, saves); None without tiers.

        A copy of counters the engine thread keeps writing: exact once the engine is idle.
        """
        tiers = self._runner.tiers if self._runner is not None else None
        return copy.deepcopy(tiers.stats) if tiers is not None else None

    def model_files(self) -> Mapping[str, Path]:
        return dict(self._files)

    def _require_runner(self) -> Runner:
        if self._runner is None or not self._runner.alive:
            failure = self._runner.failure if self._runner is not None else ""
            raise EngineShutdown(failure or "the llamacpp engine is not running")
        return self._runner

    # ------------------------------------------------------------ events from the engine thread
    def _deliver(self, events: list[KvEvent], outputs: list[Output], load: LoadMetrics | None) -> None:
        for ev in events:
            if isinstance(ev, BlocksStored):
                self.sink.blocks_stored(ev.blocks, ev.parent_hash, tier=ev.tier)
            else:
                self.sink.blocks_removed(ev.block_hashes, tier=ev.tier)
        for out in outputs:
            if out.seq.stream is not None:
                out.seq.stream.push(out.tokens, out.logprobs, out.finish, out.prompt_logprobs)
        if load is not None:
            self.sink.load(load)

    # ------------------------------------------------------------ streams
    # size: an engine stream: admission, the per-step delivery loop and its cleanup in one generator whose finally frees the slot
    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        runner = self._require_runner()
        if (request.get("output") or {}).get("embedding"):
            yield await self._embed(runner, request)
            return
        seq = new_sequence(request, self.config, self._info)
        prompt = seq.tokens[: seq.num_prompt]
        emitted = seq.num_output  # a decode leg's first tokens were sent by the prefill leg
        if seq.num_output >= seq.max_tokens:  # a decode leg whose first tokens already reached max_tokens
            yield terminal("length", seq.usage())
            return
        source = (request.get("disagg") or {}).get("kv_source")
        if seq.context_only and source and self.kv_pull is not None and seq.prompt_logprobs is None:
            seq.pulled_prefix = await self._prefix_or_cancel(source, prompt, context)
            if context.is_stopped():
                yield terminal("cancelled", seq.usage())
                return
        if seq.remote_kv:
            data = await self._pull_or_cancel(request.get("disagg") or {}, prompt, context)
            if data is None:
                yield terminal("cancelled", seq.usage())
                return
            seq.kv_state = data
        stream = Stream()
        seq.stream = stream
        self._live[context] = (seq, stream)
        runner.submit(add_command(seq))
        watcher = asyncio.ensure_future(context.stopped())
        watcher.add_done_callback(lambda _: stream.wake())
        try:
            while True:
                if context.is_stopped():
                    runner.submit(cancel_command(seq))
                    if stream.finish is None:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(CANCEL_ACK_S):
                                while stream.finish is None:
                                    await stream.wait()
                    usage = stream.finish.usage if stream.finish is not None else seq.usage()
                    yield terminal("cancelled", {**usage, "completion_tokens": emitted})
                    return
                finish = stream.finish
                if finish is not None:
                    if finish.error is not None:
                        raise finish.error
                    last = stream.take()
                    if finish.kv_state is not None:
                        last["disagg"] = self._hold(finish, prompt, last["token_ids"])
                    last["finish_reason"], last["usage"] = finish.reason, finish.usage
                    if finish.stop_reason:
                        last["stop_reason"] = finish.stop_reason
                    yield last
                    return
                if stream.tokens:
                    chunk = stream.take()
                    emitted += len(chunk["token_ids"])
                    yield chunk
                    continue
                await stream.wait()
        finally:
            watcher.cancel()
            self._live.pop(context, None)
            if stream.finish is None and self._runner is not None:
                self._runner.submit(cancel_command(seq))  # the consumer went away: free the slot now

    async def _embed(self, runner: Runner, request: TokenRequest) -> TokenChunk:
        """An `output.embedding` request: one terminal chunk with the prompt's embedding (the engine thread computes it)."""
        prompt = list(request.get("token_ids") or ())
        if not prompt:
            raise InvalidArgument("token_ids must not be empty", param="token_ids")
        if any(not 0 <= t < self._info.n_vocab for t in prompt):
            raise InvalidArgument(f"token ids must be in [0, {self._info.n_vocab})", param="token_ids")
        if len(prompt) > self.config.n_ctx:
            raise ContextLengthExceeded(f"the input has {len(prompt)} tokens; at most {self.config.n_ctx} can be embedded")
        vector = await runner.call(lambda sched: sched.backend.embed(prompt))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 0, "cached_tokens": 0}
        chunk = terminal("stop", usage)  # type: ignore[arg-type]
        chunk["embedding"] = vector
        return chunk

    # ------------------------------------------------------------ disaggregation
    def _hold(self, finish: Finish, prompt: list[int], first: list[int]) -> DisaggInfo:
        """Hold a prefill leg's KV for its decode leg; the DisaggInfo naming it."""
        assert finish.kv_state is not None
        handle = self.holds.hold(finish.kv_state, prompt)
        return {
            "kv_handle": handle.encode(),
            "prefill_worker_id": self.worker_id,
            "first_token_ids": list(first),
            "kv_bytes": len(finish.kv_state),
            "cached_tokens": finish.usage["cached_tokens"],
        }

    async def pull_kv(self, kv_handle: bytes, layout: str) -> AsyncIterator[KvTransfer]:
        """A finished prefill leg's held KV (once), or a prefix handle's state from the lower tiers (host, disk).

        A prefix handle (`meshllm.protocol.kv.prefix_handle`) is served from a
        saved tier blob whose first blocks are exactly the handle's; the state
        may cover more tokens (the puller trims it). NOT_FOUND when no tier
        holds such a blob (device-only prefixes are not exported).
        """
        prefix = parse_prefix_handle(kv_handle)
        if prefix is not None:
            if layout:
                check_layout(layout, self.layout, who="the pulling worker")
            state, n_tokens = await self._tier_prefix(*prefix)
            for piece in pieces(state, layout=self.layout, n_tokens=n_tokens):
                yield piece
            return
        handle = KvHandle.decode(kv_handle)
        if layout:
            check_layout(layout, self.layout, who="the pulling worker")
        data = self.holds.take(handle)
        if data is None:
            raise NotFound("the kv handle is unknown, expired or already pulled")
        for piece in pieces(data, layout=self.layout, n_tokens=handle.n_tokens):
            yield piece

    async def _tier_prefix(self, block_size: int, hashes: list[int]) -> tuple[bytes, int]:
        """The state of a tier blob starting with exactly `hashes` and the tokens they cover (engine thread lookup)."""
        if block_size != self.config.block_size:
            raise FailedPrecondition(f"prefix handle has block size {block_size}, this worker uses {self.config.block_size}")

        def lookup(sched: Scheduler) -> bytes | None:
            found = sched.tiers.prefix(hashes) if sched.tiers is not None else None
            return found[1] if found is not None else None

        state = await self._require_runner().call(lookup)
        if state is None:
            raise NotFound(f"no lower tier here holds the prefix of {len(hashes)} blocks any more")
        return state, len(hashes) * block_size

    async def _prefix_or_cancel(self, source: KvSourceInfo, prompt: list[int], context: Context) -> tuple[bytes, int] | None:
        """A peer's prefix of `prompt` (`disagg.kv_source`), or None: the request stopped, or the pull failed
        (logged; the prompt is then computed)."""
        pull = await context.unless_stopped(self._pull_prefix(source, prompt))
        if pull is None:
            return None
        exc = pull.exception()
        if exc is None:
            return pull.result()
        self.pull_failures += 1
        log.warning(
            "pulling %s prefix blocks from %s failed (%s: %s); computing them",
            source.get("blocks", 0), source.get("address", "?"), type(exc).__name__, exc,
        )  # fmt: skip
        return None

    async def _pull_prefix(self, source: KvSourceInfo, prompt: list[int]) -> tuple[bytes, int]:
        assert self.kv_pull is not None
        address, handle, bs, hashes = kv_source_prefix(source)
        if bs != self.config.block_size or [bh for bh, _ in stored_blocks(prompt, bs)][: len(hashes)] != hashes:
            raise FailedPrecondition("disagg.kv_source names blocks that are not this prompt's")
        data = await pull_remote(self.kv_pull, address, handle, layout=self.layout, n_tokens=len(hashes) * bs)
        n = min(len(hashes) * bs, (len(prompt) - 1) // bs * bs)  # the prompt's last token is always computed
        self.pulled_tokens += n
        return data, n

    async def _pull_or_cancel(self, disagg: DisaggInfo, prompt: list[int], context: Context) -> bytes | None:
        """The prompt's KV from the prefill worker; None if the request was stopped meanwhile."""
        pull = await context.unless_stopped(self._pull(disagg, prompt))
        return None if pull is None else pull.result()

    async def _pull(self, disagg: DisaggInfo, prompt: list[int]) -> bytes:
        raw = disagg.get("kv_handle") or b""
        handle = KvHandle.decode(raw)
        handle.check_prompt(prompt)
        if handle.nonce == self._nonce:  # the prefill leg ran on this engine
            local = self.holds.take(handle)
            if local is None:
                raise NotFound("the kv handle is unknown, expired or already pulled")
            return local
        address = disagg.get("prefill_address")
        if not address:
            raise InvalidArgument("a generation_only request needs disagg.prefill_address to pull its KV from", param="disagg")
        if self.kv_pull is None:
            raise FailedPrecondition("this engine cannot pull KV from another worker: it runs outside a worker")
        return await pull_remote(self.kv_pull, address, raw, layout=self.layout, n_tokens=len(prompt))
