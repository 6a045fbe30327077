"""The Worker gRPC servicer: one engine behind `meshllm.v1.Worker`.

Per request: proto → internal once, `engine.generate`, internal → proto once.
A gRPC cancel (or `Abort`) stops the request's `Context` and calls
`engine.abort(context)` exactly once. The stream always ends with exactly one
terminal chunk or a gRPC error; engine errors of the typed family cross the
wire intact (the transport's error mapping), others become `Unknown`.

Request ids are scoped to their caller (`meshllm.plane.auth.caller_identity`,
also for the streams of a Generate session): `Abort` finds a request only for
the caller that started it. Ids stay unique per worker (engines key
their state by id), so a second request with an id in flight is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from meshllm.engine.base import Context, EngineConfig, LLMEngine
from meshllm.errors import EngineShutdown, InvalidArgument, NotFound, StreamIncomplete, log_unexpected
from meshllm.lifecycle import Admission, Admits
from meshllm.plane.auth import caller_identity, session_scope
from meshllm.plane.request.session import DEFAULT_INTERVAL_S, SessionServer
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.convert import chunk_to_proto, request_from_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.protocol.validate import Limits, validate_generate
from meshllm.tracing import tracer
from meshllm.v1 import generate_pb2, session_pb2, worker_pb2, worker_pb2_grpc
from meshllm.worker.metrics import WorkerMetrics
from meshllm.worker.sink import WorkerSink
from meshllm.worker.validator import validate_stream

__all__ = ["WorkerServicer"]

log = logging.getLogger(__name__)
FILE_CHUNK = 1 << 20


class WorkerServicer(Admits, worker_pb2_grpc.WorkerServicer):
    """Serves one started engine. `admitting` gates new Generate calls."""

    def __init__(
        self,
        engine: LLMEngine,
        sink: WorkerSink,
        metrics: WorkerMetrics,
        *,
        info: Callable[[], worker_pb2.WorkerInfo],
        validate_streams: bool = False,
        stream_interval_s: float = DEFAULT_INTERVAL_S,
        limits: Limits = Limits(),
    ) -> None:
        self.engine = engine
        self.limits = limits  # the engine's context length and vocabulary, checked before it sees a request
        self.sink = sink
        self.metrics = metrics
        self._info = info
        self.validate_streams = validate_streams
        # Chunks go to a session's relay from the engine's step loop only where nothing must see them on the way.
        self._takes_relay = engine.takes_relay() and not validate_streams
        self.admission = Admission(on_change=metrics.inflight.inc)
        self.inflight: dict[str, Context] = {}
        self._owner: dict[str, str] = {}  # request id -> the caller scope that started it
        self._aborted: set[str] = set()
        self._cut: set[str] = set()  # stopped by the drain deadline: they end with EngineShutdown
        self._aborts: set[asyncio.Task[None]] = set()  # engine.abort calls under way (close_aborts ends them)
        self.requests_served = 0
        self.on_drain_request: Callable[[], Any] | None = None
        self.trace_service: str | None = None  # the service.name of its spans (set by the runtime)
        self.sessions = SessionServer(
            self._session_stream, "/meshllm.v1.Worker/Generate", min_interval_s=stream_interval_s, relays=True
        )

    # ------------------------------------------------------------ generate
    def _session_stream(self, req: TokenRequest, call: CallInfo) -> AsyncGenerator[TokenChunk, None]:
        """A GenerateSession stream (or an in-process caller's, without a relay), scoped to the session's caller."""
        return self.run_request(req, call, scope=session_scope.get() or "local")

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        gen = self.run_request(request_from_proto(request), CallInfo.from_context(context), scope=caller_identity(context))
        try:
            async for chunk in gen:
                yield chunk_to_proto(chunk)
        finally:
            await gen.aclose()  # a cancel reaches run_request at once, not at garbage collection

    async def GenerateSession(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        # grpc runs each call in a task of its own, whose context the session's tasks
        # inherit: the session's streams are scoped to the session's caller.
        session_scope.set(caller_identity(context))
        async for down in self.sessions.serve(request_iterator, context):
            yield down

    # size: the stream's per-chunk loop, cancellation and release in one generator whose finally must see every exit
    async def run_request(
        self,
        req: TokenRequest,
        call: CallInfo | None = None,
        *,
        scope: str = "internal",
    ) -> AsyncGenerator[TokenChunk, None]:
        """Run one request through the engine for the caller `scope` (also used by the health canary).

        Steps: admission (`_admit`), tracing and metrics (`_RequestTrace`), the
        engine's stream up to its terminal, cancellation (`_cancel`), release
        (`_release`). With a `call.relay` (a GenerateSession stream), the engine
        may hand it non-terminal chunks from its step loop (`Context.relay`, for
        an engine whose `takes_relay()` is true) after the same tracing, instead
        of yielding them; not while streams are validated (`validate_streams`),
        where every chunk is checked on its way.
        """
        call = call or CallInfo()
        outbox = call.relay
        ctx = self._admit(req, call.traceparent, scope)
        trace = _RequestTrace(self.trace_service, req, ctx.id)
        if outbox is not None and self._takes_relay:

            def relay(chunk: TokenChunk) -> None:
                trace.chunk(chunk)
                outbox(chunk)

            ctx.relay = relay
        stream = self._engine_stream(req, ctx)
        finished = False
        try:
            async for chunk in stream:
                trace.chunk(chunk)
                if "finish_reason" in chunk:
                    self._check_cut(chunk, ctx.id)
                    trace.finish(chunk["finish_reason"])
                yield chunk
                if "finish_reason" in chunk:
                    finished = True
                    break
            if not finished:
                raise StreamIncomplete(f"engine stream for {ctx.id} ended without a terminal chunk")
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # the caller went away (gRPC cancel)
                self._cancel(ctx)
                trace.finish("cancelled")
            raise
        except Exception as exc:
            trace.failed(exc)
            raise
        finally:
            trace.end()
            with contextlib.suppress(Exception):
                await _aclose(stream)
            self._release(ctx.id)

    def _admit(self, req: TokenRequest, traceparent: str | None, scope: str) -> Context:
        """Admission: refuse while draining, validate, register the request's Context under its id."""
        if not self.admitting:
            raise EngineShutdown("worker is draining and admits no new requests")
        validate_generate(req, self.limits)
        if not req.get("request_id"):
            req["request_id"] = uuid.uuid4().hex
        rid = req["request_id"]
        if rid in self.inflight:
            raise InvalidArgument(f"request_id {rid!r} is already in flight", param="request_id")
        ctx = Context(rid, traceparent=traceparent)
        self.inflight[rid] = ctx
        self._owner[rid] = scope
        self.admission.enter()
        self.metrics.requests.inc()
        return ctx

    def _engine_stream(self, req: TokenRequest, ctx: Context) -> AsyncIterator[TokenChunk]:
        stream = self.engine.generate(req, ctx)
        return validate_stream(stream, req, ctx) if self.validate_streams else stream

    def _check_cut(self, terminal: TokenChunk, rid: str) -> None:
        """A "cancelled" terminal of a request stopped at the drain deadline is an error the caller can retry."""
        if terminal.get("finish_reason") == "cancelled" and rid in self._cut:
            raise EngineShutdown(f"the worker stopped request {rid} at its drain deadline; retry it elsewhere")

    def _cancel(self, ctx: Context) -> None:
        """Cancellation: stop the request and tell the engine (once)."""
        ctx.stop()
        self._schedule_abort(ctx)

    def _release(self, rid: str) -> None:
        self.inflight.pop(rid, None)
        self._owner.pop(rid, None)
        self._aborted.discard(rid)
        self._cut.discard(rid)
        self.requests_served += 1
        self.admission.exit()

    def _schedule_abort(self, ctx: Context) -> None:
        if ctx.id in self._aborted:
            return
        self._aborted.add(ctx.id)
        self.metrics.aborts.inc()
        self._aborts.add(task := asyncio.ensure_future(self._abort(ctx)))
        task.add_done_callback(self._aborts.discard)

    async def close_aborts(self, timeout_s: float = 5.0) -> None:
        """Let the engine.abort calls under way finish (before the engine is cleaned up); cancel any past `timeout_s`."""
        if not self._aborts:
            return
        pending = list(self._aborts)
        _done, late = await asyncio.wait(pending, timeout=timeout_s)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _abort(self, ctx: Context) -> None:
        try:
            await self.engine.abort(ctx)
        except Exception as exc:
            log_unexpected(log, f"engine.abort failed for {ctx.id}", exc)

    # ------------------------------------------------------------ control
    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        ctx = self.inflight.get(request.request_id)
        if ctx is None or self._owner.get(request.request_id) != caller_identity(context):
            return worker_pb2.AbortResponse(found=False)  # another caller's request is not there for this one
        ctx.stop()
        self._schedule_abort(ctx)
        return worker_pb2.AbortResponse(found=True)

    async def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return self._info()

    async def GetKvSnapshot(
        self, request: worker_pb2.GetKvSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvSnapshot:
        return self.sink.snapshot()

    async def Drain(self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:
        if self.on_drain_request is not None:
            self.on_drain_request()
        else:
            self.admitting = False
        return worker_pb2.DrainResponse(in_flight=len(self.inflight))

    async def ClearKvBlocks(
        self, request: worker_pb2.ClearKvBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ClearKvBlocksResponse:
        return worker_pb2.ClearKvBlocksResponse(cleared_blocks=await self.engine.clear_kv_blocks())

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvChunk]:
        offset = 0
        first = True
        async for piece in self.engine.pull_kv(request.kv_handle, request.layout):
            chunk = worker_pb2.KvChunk(data=piece.data, offset=offset, total_bytes=piece.total_bytes)
            if first:
                chunk.layout, chunk.n_tokens, first = piece.layout, piece.n_tokens, False
            offset += len(piece.data)
            self.metrics.kv_transfer_bytes.inc(len(piece.data))
            yield chunk

    async def GetModelFiles(
        self, request: worker_pb2.GetModelFilesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.ModelFileChunk]:
        files = self.engine.model_files()
        if not files:
            from meshllm.errors import Unimplemented

            raise Unimplemented(f"{type(self.engine).__name__} serves no model files")
        names = list(request.names) or sorted(files)
        missing = [n for n in names if n not in files]
        if missing:
            raise NotFound(f"model files not served: {', '.join(missing)}")
        for name in names:
            data = await asyncio.to_thread(files[name].read_bytes)
            for off in range(0, max(len(data), 1), FILE_CHUNK):
                yield worker_pb2.ModelFileChunk(name=name, data=data[off : off + FILE_CHUNK], offset=off, total_bytes=len(data))

    # ------------------------------------------------------------ lifecycle helpers
    def stop_all(self) -> None:
        """Stop every in-flight request (drain timeout passed): each ends with EngineShutdown (UNAVAILABLE).

        Not a "cancelled" terminal, which reads as a normal end: the caller sees the
        error (a router migrates the stream to another worker, a client gets an error event).
        """
        for ctx in list(self.inflight.values()):
            self._cut.add(ctx.id)
            ctx.stop()
            self._schedule_abort(ctx)


class _RequestTrace:
    """Tracing and per-request metrics of one request: the `engine.generate` span, its TTFT and token count."""

    def __init__(self, service: str | None, req: TokenRequest, rid: str) -> None:
        self.span = tracer(service).start_span(
            "engine.generate",
            attributes={
                "model": req.get("model", ""),
                "input_tokens": len(req["token_ids"]),
                "disagg_role": req.get("disagg", {}).get("request_type", "aggregated"),
                "request_id": rid,
            },
        )
        self.t0 = time.monotonic()
        self.output_tokens = 0

    def chunk(self, chunk: TokenChunk) -> None:
        n = len(chunk.get("token_ids", ()))
        if n and not self.output_tokens:
            self.span.set_attribute("ttft_ms", (time.monotonic() - self.t0) * 1000.0)
        self.output_tokens += n

    def finish(self, reason: str) -> None:
        self.span.set_attribute("finish_reason", reason)

    def failed(self, exc: BaseException) -> None:
        self.span.record_exception(exc)
        self.finish("error")

    def end(self) -> None:
        self.span.set_attribute("output_tokens", self.output_tokens)
        self.span.end()


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def engine_config_proto(cfg: EngineConfig) -> worker_pb2.EngineConfig:
    """EngineConfig dataclass → proto (used by GetInfo)."""
    return worker_pb2.EngineConfig(
        model=cfg.model,
        kv_block_size=cfg.kv_block_size,
        total_kv_blocks=cfg.total_kv_blocks,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        context_length=cfg.context_length,
        data_parallel_size=cfg.data_parallel_size,
    )
