"""The `trtllm` engine: TensorRT-LLM's LLM API (PyTorch backend) behind the LLMEngine contract.

TensorRT-LLM is imported lazily (`import_tensorrt_llm`, called by `from_args`
and `start`), so `import meshllm` and every test run without it; a worker
started without it exits with one line naming the missing dependency.

The calls used, as NVIDIA/TensorRT-LLM defines them (`tensorrt_llm/llmapi/llm.py`,
`tensorrt_llm/executor/result.py`): `LLM(**kwargs)`; `llm.generate_async(token_ids,
sampling_params=, streaming=, disaggregated_params=)` returning a
`GenerationResult` that is async-iterable (each step updates the cumulative
`outputs[0]`), has `abort()`, `aresult()` and `finished`;
`llm.get_kv_cache_events_async(timeout)` / `llm.get_stats_async(timeout)`
returning async iterables of dicts that end after `timeout` without data;
`llm.shutdown()`. Polling cadence and the deferred abort of a
generation-only request (abort only after its first response, when the KV
transfer has finished) follow ai-dynamo/dynamo
`components/src/dynamo/trtllm/publisher.py` and `request_handlers/handler_base.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Self

from meshllm.engine.base import Context, EngineConfig, LLMEngine, LoadMetrics, TokenChunk, TokenRequest, terminal
from meshllm.engine.optional import first_line, import_engine_library
from meshllm.engine.trtllm import translate as tr
from meshllm.engine.trtllm.config import TrtllmConfig, add_trtllm_args, build_llm_kwargs
from meshllm.engine.trtllm.kv_events import KvEventConverter, block_size_from_stats, load_from_stats, total_blocks_from_stats
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.errors import EngineShutdown, FailedPrecondition, InvalidArgument, ResponseTimeout, Unknown
from meshllm.protocol.types import DisaggInfo

__all__ = ["INSTALL_HINT", "TrtllmEngine", "import_tensorrt_llm"]

log = logging.getLogger(__name__)

INSTALL_HINT = "in the meshllm clone: pip install '.[trtllm]' (wheels from NVIDIA's index, see docs/engines/trtllm.md)"
DEFAULT_BLOCK_SIZE = 32  # KvCacheConfig.tokens_per_block default (tensorrt_llm/llmapi/llm_args.py)
DEFAULT_MAX_TOKENS = 16
# (fetch timeout, min sleep, max sleep, backoff) from Dynamo's publisher.py
_KV_POLL = (0.0, 0.005, 0.02, 1.5)
_STATS_POLL = (0.01, 0.01, 0.1, 2.0)
_DEFERRED_ABORT_TIMEOUT_S = 60.0
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def import_tensorrt_llm() -> ModuleType:
    """`import tensorrt_llm`, or a one-line ConfigError saying what is missing."""
    return import_engine_library("tensorrt_llm", "TensorRT-LLM", "trtllm", INSTALL_HINT)


@dataclass(slots=True)
class _InFlight:
    result: Any
    deferred_abort: bool  # generation_only: abort only once the first response (KV transfer) arrived
    seen_first: bool = False
    aborted: bool = False


class TrtllmEngine(LLMEngine):
    """TensorRT-LLM for every role; KV events and load from the live engine."""

    supports_guided_decoding = True  # with guided_decoding_backend in --extra-engine-args (else a clear 400 per request)

    def __init__(self, config: TrtllmConfig, *, trt: ModuleType | None = None) -> None:
        self.config = config
        self.default_max_tokens = DEFAULT_MAX_TOKENS
        self.block_size = config.kv_block_size or DEFAULT_BLOCK_SIZE
        self.context_length = config.max_seq_len or 0
        self.kv: KvEventConverter | None = None
        self.last_load: LoadMetrics | None = None
        self._trt = trt
        self._llm: Any = None
        self._loading: asyncio.Future[Any] | None = None
        self._cleanup_task: asyncio.Task[None] | None = None
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._inflight: dict[str, _InFlight] = {}

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        parser = worker_arg_parser("trtllm")
        add_trtllm_args(parser)
        ns = parser.parse_args(list(argv))
        trt = import_tensorrt_llm()
        return cls(TrtllmConfig.from_namespace(ns), trt=trt), WorkerConfig.from_namespace(ns, engine="trtllm")

    # ------------------------------------------------------------ lifecycle

    async def start(self, worker_id: str) -> EngineConfig:
        if self._closing:
            raise EngineShutdown("the trtllm engine was cleaned up")
        trt = self._trt = self._trt or import_tensorrt_llm()
        kwargs = build_llm_kwargs(self.config)
        log.info("trtllm worker %s loading %s with %s", worker_id, self.config.model_path, kwargs)
        self._loading = asyncio.ensure_future(asyncio.to_thread(trt.LLM, **kwargs))
        try:
            llm = await asyncio.shield(self._loading)
        except Exception as exc:
            log.error("TensorRT-LLM failed to load %s", self.config.model_path, exc_info=True)
            raise FailedPrecondition(f"TensorRT-LLM could not load {self.config.model_path}: {first_line(exc)}") from exc
        if self._closing:
            raise EngineShutdown("the trtllm engine was cleaned up while loading")  # cleanup shuts it down
        self._llm = llm
        self.block_size = _live_block_size(llm, self.block_size)
        self.context_length = _live_int(llm, "max_seq_len") or self.context_length
        total = await self._probe_stats(llm)
        self.kv = KvEventConverter(self.sink, self.block_size)
        self._tasks = [
            asyncio.create_task(self._poll(llm.get_kv_cache_events_async, self.kv.handle, _KV_POLL), name="trtllm-kv"),
            asyncio.create_task(self._poll(llm.get_stats_async, self._on_stats, _STATS_POLL), name="trtllm-stats"),
        ]
        self.sink.load(LoadMetrics(active_blocks=0, total_blocks=total, waiting=0, running=0))
        tokenizer = getattr(llm, "tokenizer", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        bos = getattr(tokenizer, "bos_token_id", None)
        tp = self.config.tensor_parallel_size or _live_int(llm, "tensor_parallel_size") or 1
        return EngineConfig(
            model=self.config.model_name,
            kv_block_size=self.block_size,
            total_kv_blocks=total,
            max_num_seqs=self.config.max_batch_size or _live_int(llm, "max_batch_size"),
            max_num_batched_tokens=self.config.max_num_tokens or _live_int(llm, "max_num_tokens"),
            context_length=self.context_length,
            eos_token_ids=(eos,) if isinstance(eos, int) else (),
            bos_token_id=bos if isinstance(bos, int) else None,
            tokenizer_source=self.config.model_path,
            kv_layout=f"trtllm/{self.config.model_name}/tp{tp}/bs{self.block_size}",
        )

    async def _probe_stats(self, llm: Any) -> int:
        """Run a one-token request so iteration stats exist; return the KV block count (0 = unknown)."""
        samples: list[Any] = []
        try:
            bos = getattr(getattr(llm, "tokenizer", None), "bos_token_id", None)
            params = self._sampling_params({"max_tokens": 1, "detokenize": False})
            result = llm.generate_async([bos if isinstance(bos, int) else 0], sampling_params=params)
            await asyncio.wait_for(result.aresult(), 120)
            async for stat in llm.get_stats_async(timeout=2):
                samples.append(stat)
        except Exception as exc:
            log.warning("could not read TensorRT-LLM stats after a warm-up request: %s", first_line(exc))
        for stat in samples:
            self._check_block_size(stat)
        return total_blocks_from_stats(samples)

    async def _poll(self, fetch: Callable[..., Any], handle: Callable[[Any], None], cadence: tuple[float, ...]) -> None:
        """Drain `fetch(timeout)` repeatedly, backing off while it yields nothing."""
        timeout, low, high, factor = cadence
        sleep = low
        while True:
            had = False
            try:
                async for item in fetch(timeout=timeout):
                    had = True
                    handle(item)
            except (TimeoutError, asyncio.QueueEmpty):
                pass
            except Exception as exc:
                log.warning("TensorRT-LLM %s polling failed: %s", getattr(fetch, "__name__", "event"), first_line(exc))
            if had:
                sleep = low
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(sleep)
                sleep = min(high, sleep * factor)

    def _on_stats(self, stat: Any) -> None:
        self._check_block_size(stat)
        if (load := load_from_stats(stat)) is not None:
            self.last_load = load
            self.sink.load(load)

    def _check_block_size(self, stat: Any) -> None:
        live = block_size_from_stats(stat)
        if live and live != self.block_size:
            log.error(
                "TensorRT-LLM reports %d tokens per KV block but hashes use %d; set --kv-block-size %d",
                live,
                self.block_size,
                live,
            )

    async def cleanup(self) -> None:
        if self._cleanup_task is None:
            self._cleanup_task = asyncio.ensure_future(self._cleanup())
        await asyncio.shield(self._cleanup_task)

    async def _cleanup(self) -> None:
        self._closing = True
        tasks = [*self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        llm, self._llm = self._llm, None
        if llm is None and self._loading is not None:
            with contextlib.suppress(Exception):
                llm = await self._loading  # start() was cancelled or lost the race; the LLM still exists
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:
                log.exception("TensorRT-LLM shutdown failed")
        log.info("trtllm engine %s cleaned up", self.config.model_name)

    def model_files(self) -> Mapping[str, Path]:
        root = Path(self.config.model_path)
        return {name: root / name for name in _MODEL_FILES if (root / name).is_file()}

    # ------------------------------------------------------------ requests

    def _sampling_params(self, kw: Mapping[str, Any]) -> Any:
        assert self._trt is not None
        kw = dict(kw)
        if guided := kw.pop("guided_decoding", None):
            if not self.config.extra.get("guided_decoding_backend"):
                raise InvalidArgument(
                    "guided decoding needs guided_decoding_backend (xgrammar or llguidance) in --extra-engine-args",
                    param="guided",
                )
            module = importlib.import_module("tensorrt_llm.sampling_params")
            kw["guided_decoding"] = module.GuidedDecodingParams(**guided)
        return self._trt.SamplingParams(**kw)

    def _submit(self, request: TokenRequest) -> tuple[Any, dict[str, Any]]:
        """Build SamplingParams / DisaggregatedParams and submit; return the result and the kwargs used."""
        if self._closing:
            raise EngineShutdown("the trtllm engine is shut down")
        if self._llm is None or self._trt is None:
            raise FailedPrecondition("the trtllm engine is not started")
        disagg = request.get("disagg", {})
        role = disagg.get("request_type")
        kw = tr.sampling_kwargs(request, default_max_tokens=self.default_max_tokens, context_length=self.context_length)
        disagg_kw = tr.disagg_to_trtllm(disagg) if role == "generation_only" else {"request_type": role} if role else None
        try:
            params = self._sampling_params(kw)
            dparams = self._trt.DisaggregatedParams(**disagg_kw) if disagg_kw else None
            result = self._llm.generate_async(
                list(request["token_ids"]),
                sampling_params=params,
                streaming=role != "context_only",
                disaggregated_params=dparams,
            )
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"TensorRT-LLM refused the request: {first_line(exc)}") from exc
        return result, kw

    # size: an engine stream: admission, the per-step delivery loop and its cleanup in one generator whose finally aborts
    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        prompt = request["token_ids"]
        if not prompt:
            raise InvalidArgument("token_ids must not be empty", param="token_ids")
        disagg = request.get("disagg", {})
        role = disagg.get("request_type")
        result, kw = self._submit(request)
        flight = _InFlight(result, deferred_abort=role == "generation_only")
        self._inflight[context.id] = flight
        extra_eos = tr.extra_eos_ids(request)
        top_n = request.get("output", {}).get("logprobs", 0) or 0
        cursor = len(disagg.get("first_token_ids", ())) if role == "generation_only" else 0
        stop_wait = asyncio.ensure_future(context.stopped())
        steps = result.__aiter__()
        step: asyncio.Future[Any] | None = None
        finished = False
        try:
            while True:
                if context.is_stopped():
                    self._abort(flight)
                    yield terminal("cancelled", tr.usage(len(prompt), cursor, 0))
                    return
                step = asyncio.ensure_future(steps.__anext__())
                await asyncio.wait((step, stop_wait), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    await asyncio.wait((step,))  # let the cancelled fetch finish; raises nothing
                    continue  # the loop head emits "cancelled"
                try:
                    res = step.result()
                except StopAsyncIteration:
                    raise Unknown("TensorRT-LLM ended the stream without a final output") from None
                flight.seen_first = True
                output = res.outputs[0] if res.outputs else None
                if output is None:
                    continue
                start = cursor
                tokens, cursor = tr.token_delta(output.token_ids, cursor)
                chunk: TokenChunk = {"token_ids": tokens}
                if "logprobs" in kw and (lps := tr.logprob_delta(output.logprobs, output.token_ids, start, cursor, top_n)):
                    chunk["logprobs"] = lps
                if output.finish_reason is None and not res.finished:
                    if tokens:
                        yield chunk
                    continue
                finished = True
                yield self._final(request, res, output, chunk, cursor, extra_eos)
                return
        finally:
            stop_wait.cancel()
            if step is not None and not step.done():
                step.cancel()
            if self._inflight.get(context.id) is flight:
                del self._inflight[context.id]
            if not finished:
                self._abort(flight)

    def _final(
        self, request: TokenRequest, res: Any, output: Any, chunk: TokenChunk, cursor: int, extra_eos: frozenset[int]
    ) -> TokenChunk:
        """The terminal chunk for a finished output (the last delta, reason, usage, prefill answer)."""
        disagg = request.get("disagg", {})
        role = disagg.get("request_type")
        prompt_len = len(request["token_ids"])
        reason, stop_reason = tr.map_finish_reason(output.finish_reason, output.stop_reason, extra_eos=extra_eos)
        if reason == "error":
            if stop_reason == "timeout":
                raise ResponseTimeout("TensorRT-LLM timed out the request")
            raise Unknown(f"TensorRT-LLM finished the request with {stop_reason!r}")
        if role == "generation_only":
            cached = disagg.get("cached_tokens", 0)
        else:
            cached = tr.cached_tokens(res, output, block_size=self.block_size, prompt_len=prompt_len)
        answer: DisaggInfo | None = None
        if role == "context_only" and reason == "length":
            params = getattr(output, "disaggregated_params", None) or getattr(res, "disaggregated_params", None)
            if params is None:
                raise FailedPrecondition(
                    "TensorRT-LLM returned no disaggregated params for a context_only request (is cache_transceiver_config set?)"
                )
            answer = tr.disagg_from_trtllm(params, cached=cached)
        final = terminal(
            reason, tr.usage(prompt_len, cursor, cached), token_ids=chunk["token_ids"], stop_reason=stop_reason, disagg=answer
        )
        if "logprobs" in chunk:
            final["logprobs"] = chunk["logprobs"]
        return final

    def _abort(self, flight: _InFlight) -> None:
        """Abort once; a generation-only request waits for its first response (its KV transfer) first."""
        if flight.aborted or getattr(flight.result, "finished", False):
            return
        flight.aborted = True
        if flight.deferred_abort and not flight.seen_first:
            task = asyncio.ensure_future(self._abort_after_first(flight.result))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        try:
            flight.result.abort()
        except Exception as exc:
            log.warning("TensorRT-LLM abort failed: %s", first_line(exc))

    async def _abort_after_first(self, result: Any) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_DEFERRED_ABORT_TIMEOUT_S):
                await anext(aiter(result))
        with contextlib.suppress(Exception):
            result.abort()

    async def abort(self, context: Context) -> None:
        if (flight := self._inflight.get(context.id)) is not None:
            self._abort(flight)


def _live_int(llm: Any, name: str) -> int:
    value = getattr(getattr(llm, "args", None), name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _live_block_size(llm: Any, fallback: int) -> int:
    """`llm.args.kv_cache_config.tokens_per_block` of the live engine, else the configured size."""
    kv = getattr(getattr(llm, "args", None), "kv_cache_config", None)
    value = kv.get("tokens_per_block") if isinstance(kv, Mapping) else getattr(kv, "tokens_per_block", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback
