"""A running worker: engine + gRPC server + registration + events + health, with its shutdown order.

    async with await Worker.start(engine, config) as worker:   # start() loads and registers
        ...                                                    # close = the ordered shutdown

Shutdown order (each step bounded, each runs even if one before failed):
unregister → grace period → stop admitting (new Generate → UNAVAILABLE,
health → NOT_SERVING) → wait for in-flight (≤ drain timeout, then stop them)
→ engine.drain() → engine.cleanup() → stop the gRPC server → close planes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm import __version__
from meshllm.engine.base import DisaggregationMode, EngineConfig, KvPull, KvTransfer, LLMEngine, LoadMetrics
from meshllm.engine.worker_config import WorkerConfig
from meshllm.lifecycle import AsyncCloseable, Shutdown
from meshllm.plane.discovery.base import Discovery, MemoryStore, open_discovery
from meshllm.plane.events.base import EventBus, MemoryBroker, open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.local import LocalPeers
from meshllm.plane.request.server import GrpcServer, ServiceBinding, start_server
from meshllm.protocol.types import TokenRequest
from meshllm.protocol.validate import Limits
from meshllm.tracing import untraced, worker_service_name
from meshllm.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from meshllm.worker.client import WorkerClient
from meshllm.worker.metrics import WorkerMetrics
from meshllm.worker.service import WorkerServicer, engine_config_proto
from meshllm.worker.sink import WorkerSink

__all__ = ["ROLE_TO_PB", "Worker", "peer_kv_pull"]

log = logging.getLogger(__name__)

ROLE_TO_PB = {
    DisaggregationMode.AGGREGATED: discovery_pb2.WORKER_ROLE_AGGREGATED,
    DisaggregationMode.PREFILL: discovery_pb2.WORKER_ROLE_PREFILL,
    DisaggregationMode.DECODE: discovery_pb2.WORKER_ROLE_DECODE,
}
DEFAULT_CANARY: TokenRequest = {"request_id": "", "token_ids": [1, 2, 3, 4], "stop": {"max_tokens": 1}}


class Worker(AsyncCloseable):
    """One started engine, served, registered and publishing. Use `Worker.start`."""

    def __init__(self, engine: LLMEngine, config: WorkerConfig, worker_id: str) -> None:
        self.engine = engine
        self.config = config
        self.id = worker_id
        self.metrics = WorkerMetrics(worker_id)
        self._local: LocalPeers | None = None
        self.engine_config: EngineConfig | None = None
        self.server: GrpcServer | None = None
        self.servicer: WorkerServicer | None = None
        self.discovery: Discovery | None = None
        self.bus: EventBus | None = None
        self.sink: WorkerSink | None = None
        self.instance: discovery_pb2.Instance | None = None
        self.model_card: discovery_pb2.ModelCard | None = None
        self.shutdown = Shutdown()
        self._tasks: list[asyncio.Task[Any]] = []
        self._metrics_server: Any = None
        self._planned = False
        self._closing = asyncio.Event()
        self._peers: ChannelCache | None = None  # the engine's KV pulls from peer workers

    # ------------------------------------------------------------ start
    @classmethod
    async def start(
        cls,
        engine: LLMEngine,
        config: WorkerConfig,
        *,
        memory_store: MemoryStore | None = None,
        memory_broker: MemoryBroker | None = None,
        local: LocalPeers | None = None,
    ) -> Worker:
        """Open planes, start the engine, serve, register. Cleans up on failure.

        `local` (meshllm run): also serve Generate to clients of this process directly (plane/request/local.py).
        """
        worker_id = config.instance_id or f"{config.engine}-{uuid.uuid4().hex[:12]}"
        self = cls(engine, config, worker_id)
        self._local = local
        return await self.started(self._start(memory_store, memory_broker))

    async def _start(self, memory_store: MemoryStore | None, memory_broker: MemoryBroker | None) -> None:
        cfg = self.config
        self.discovery = await open_discovery(cfg.plane, memory_store=memory_store)
        self.bus = await open_events(cfg.plane, memory_broker=memory_broker)
        self.sink = sink = WorkerSink(
            self.id,
            self.bus,
            namespace=cfg.plane.namespace,
            component=cfg.component,
            on_load=self._on_load,
            on_published=self.metrics.kv_events.inc,
        )
        self.engine.sink = self.sink
        self._peers = ChannelCache(security=cfg.security)
        self.engine.kv_pull = peer_kv_pull(self._peers)
        servicer, engine_config = await self._start_engine(sink)
        binding = ServiceBinding(
            "meshllm.v1.Worker",
            servicer,
            worker_pb2_grpc.add_WorkerServicer_to_server,
            servicer.sessions.close,
            sessions=servicer.sessions,
        )
        self.server = await start_server(cfg.server, [binding], security=cfg.security)
        self.instance = self._instance(self.server.port, self.server.session_port)
        self.model_card = await self._model_card(engine_config)
        self.metrics.label(model=self.model_card.name, role=cfg.role.value)
        if self._local is not None:
            self._local.register(
                self.address,
                servicer.sessions.handler,
                servicer.sessions.method,
                service=worker_service_name(cfg.role.value),
            )
        if not cfg.static:
            await self.discovery.register_instance(self.instance)
            await self.discovery.register_model(self.model_card)
        self._tasks.append(asyncio.create_task(self._health_loop(), name=f"health-{self.id}"))
        if cfg.metrics_port is not None:
            self._serve_metrics(cfg.metrics_port)
        self._plan_shutdown()
        log.info("worker %s serving %s at %s (role %s)", self.id, self.model_card.name, self.address, cfg.role.value)

    async def _start_engine(self, sink: WorkerSink) -> tuple[WorkerServicer, EngineConfig]:
        """Start the engine and the Worker servicer around it (not served yet)."""
        cfg = self.config
        t0 = time.monotonic()
        self.engine_config = engine_config = await self.engine.start(self.id)
        self.metrics.model_load_time.set(time.monotonic() - t0)
        self.metrics.kv_total_blocks.set(engine_config.total_kv_blocks)
        self.servicer = servicer = WorkerServicer(
            self.engine,
            sink,
            self.metrics,
            info=self.info,
            validate_streams=cfg.validate_streams,
            stream_interval_s=cfg.server.stream_interval_ms / 1000.0,
            limits=Limits(engine_config.context_length, engine_config.vocab_size),
        )
        servicer.on_drain_request = self.close_soon  # the Drain RPC: this worker keeps and awaits its close
        servicer.trace_service = worker_service_name(cfg.role.value)
        return servicer, engine_config

    def _serve_metrics(self, port: int) -> None:
        """Prometheus metrics on their own port (`--metrics-port`)."""
        from prometheus_client import start_http_server

        from meshllm.ports import bind_error

        host = self.config.server.host
        try:
            self._metrics_server, _ = start_http_server(port, addr=host, registry=self.metrics.registry)
        except OSError as exc:
            raise bind_error(host, port, "--metrics-port", exc) from None

    @property
    def address(self) -> str:
        assert self.instance is not None
        return self.instance.address

    def _instance(self, port: int, session_port: int | None = None) -> discovery_pb2.Instance:
        host = self.config.advertise_host or self.config.server.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        assert self.engine_config is not None
        return discovery_pb2.Instance(
            id=self.id,
            namespace=self.config.plane.namespace,
            component=self.config.component,
            endpoint=self.config.endpoint,
            address=f"{host}:{port}",
            session_address=f"{host}:{session_port}" if session_port is not None else "",
            role=ROLE_TO_PB[self.config.role],
            model=self.config.model_name or self.engine_config.model,
            dp_size=self.engine_config.data_parallel_size,
            version=__version__,
            metadata={"engine": self.config.engine},
        )

    async def _model_card(self, ec: EngineConfig) -> discovery_pb2.ModelCard:
        files = self.engine.model_files()
        checksum = ""
        if files:

            def digest() -> str:
                h = hashlib.sha256()
                for name in sorted(files):
                    h.update(name.encode() + b"\0" + files[name].read_bytes())
                return h.hexdigest()

            checksum = await asyncio.to_thread(digest)
        card = discovery_pb2.ModelCard(
            name=self.config.model_name or ec.model,
            model_type=discovery_pb2.MODEL_TYPE_CHAT_AND_COMPLETION
            if ec.chat_template or ec.tokenizer_source
            else discovery_pb2.MODEL_TYPE_COMPLETION,
            tokenizer_source=ec.tokenizer_source or (f"worker:{self.id}" if files else ""),
            chat_template=ec.chat_template,
            context_length=ec.context_length,
            kv_block_size=ec.kv_block_size,
            eos_token_ids=ec.eos_token_ids,
            migration_limit=self.config.migration_limit,
            runtime_limits=discovery_pb2.RuntimeLimits(
                total_kv_blocks=ec.total_kv_blocks, max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens
            ),
            checksum=checksum,
            instance_id=self.id,
        )
        engine = type(self.engine)
        card.capabilities.prompt_logprobs = engine.supports_prompt_logprobs
        card.capabilities.embeddings = engine.supports_embeddings
        card.capabilities.guided_decoding = engine.supports_guided_decoding
        card.capabilities.SetInParent()  # present even when all False: "cannot", not "not said"
        if ec.bos_token_id is not None:
            card.bos_token_id = ec.bos_token_id
        return card

    def info(self) -> worker_pb2.WorkerInfo:
        """GetInfo's answer."""
        assert self.instance is not None and self.model_card is not None and self.engine_config is not None
        state = worker_pb2.WORKER_STATE_SERVING
        if self.servicer is None or not self.servicer.admitting or self.shutdown.started:
            state = worker_pb2.WORKER_STATE_DRAINING
        return worker_pb2.WorkerInfo(
            instance=self.instance,
            role=ROLE_TO_PB[self.config.role],
            engine=engine_config_proto(self.engine_config),
            model_card=self.model_card,
            state=state,
            in_flight=len(self.servicer.inflight) if self.servicer else 0,
            engine_name=self.config.engine,
        )

    def _on_load(self, m: LoadMetrics) -> None:
        self.metrics.kv_active_blocks.set(m.active_blocks)
        self.metrics.kv_total_blocks.set(m.total_blocks)
        self.metrics.kv_usage.set(m.active_blocks / m.total_blocks if m.total_blocks else 0.0)
        self.metrics.waiting.set(m.waiting)
        self.metrics.running.set(m.running)
        for t in m.tiers:
            name = t.tier.name.lower()
            self.metrics.tier_usage(name, blocks=t.blocks, bytes_used=t.bytes_used, bytes_capacity=t.bytes_capacity)

    # ------------------------------------------------------------ health
    async def _health_loop(self) -> None:
        assert self.servicer is not None and self.server is not None
        payload: TokenRequest = dict(self.config.health_check_payload or DEFAULT_CANARY)  # type: ignore[assignment]
        served = self.servicer.requests_served
        n = 0
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            if not self.servicer.admitting:
                return
            if self.servicer.requests_served != served or self.servicer.inflight:
                served = self.servicer.requests_served  # live traffic proves health
                continue
            n += 1
            ok = await self.canary({**payload, "request_id": f"health-{self.id}-{n}"})
            served = self.servicer.requests_served
            if self.servicer.admitting:
                await self.server.set_serving(ok)

    async def canary(self, request: TokenRequest, timeout_s: float = 10.0) -> bool:
        """Run one canary request; True when it ends with a non-error terminal."""
        assert self.servicer is not None
        try:
            with untraced():  # a health check, not a request: no trace
                async with asyncio.timeout(timeout_s):
                    async for chunk in self.servicer.run_request(request):
                        if "finish_reason" in chunk:
                            return chunk["finish_reason"] != "error"
        except Exception as exc:
            log.warning("health canary of %s failed: %s", self.id, exc)
        self.metrics.health_failures.inc()
        return False

    # ------------------------------------------------------------ shutdown
    def _plan_shutdown(self) -> None:
        sd, cfg = self.shutdown, self.config
        sd.add("unregister", self._unregister, timeout_s=5)
        sd.add("grace period", lambda: asyncio.sleep(cfg.grace_period_s))
        sd.add("stop admitting", self._stop_admitting)
        sd.add("wait for in-flight", self._wait_inflight)
        sd.add("engine.drain", self.engine.drain, timeout_s=max(cfg.drain_timeout_s, 1.0))
        sd.add("engine.cleanup", self._cleanup)
        sd.add("stop server", self._stop_server, timeout_s=10)
        sd.add("close planes", self._close_planes, timeout_s=10)
        self._planned = True

    async def _unregister(self) -> None:
        if self.discovery is not None and not self.config.static:
            await self.discovery.unregister()

    async def _stop_admitting(self) -> None:
        assert self.servicer is not None and self.server is not None
        self.servicer.admitting = False
        await self.server.set_serving(False)

    async def _wait_inflight(self) -> None:
        assert self.servicer is not None
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                await self.servicer.wait_idle()
        except TimeoutError:
            log.warning("drain timeout: stopping %d in-flight requests", len(self.servicer.inflight))
            self.servicer.stop_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self.servicer.wait_idle()
        self.metrics.drain_time.set(time.monotonic() - t0)

    async def _cleanup(self) -> None:
        t0 = time.monotonic()
        if self.servicer is not None:
            await self.servicer.close_aborts()  # the engine hears every abort before it is cleaned up
        await self.engine.cleanup()
        self.metrics.cleanup_time.set(time.monotonic() - t0)

    async def _stop_server(self) -> None:
        if self._local is not None and self.instance is not None:
            self._local.unregister(self.address)
        if self.server is not None:
            await self.server.aclose()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)

    async def _close_planes(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._peers is not None:
            await self._peers.aclose()
        if self.sink is not None:
            self.sink.close()
        if self.bus is not None:
            await self.bus.aclose()
        if self.discovery is not None:
            await self.discovery.aclose()

    async def wait_closing(self) -> None:
        """Return once shutdown has begun (signal, Drain RPC or aclose)."""
        await self._closing.wait()

    async def _aclose(self) -> None:
        self._closing.set()
        if not self._planned:
            # start() failed before the shutdown was planned: release what exists.
            with contextlib.suppress(Exception):
                await self.engine.cleanup()
            if self.server is not None:
                await self.server.aclose()
            await self._close_planes()
            return
        await self.shutdown.run()
        log.info("worker %s stopped (%s)", self.id, ", ".join(f"{k} {v:.2f}s" for k, v in self.shutdown.durations.items()))


def peer_kv_pull(channels: ChannelCache) -> KvPull:
    """The `KvPull` a worker gives its engine: a peer's held KV through its `Worker.PullKv`, over `channels`."""

    async def pull(address: str, kv_handle: bytes, layout: str) -> AsyncIterator[KvTransfer]:
        async for chunk in WorkerClient(channels, address).pull_kv(kv_handle, layout=layout):
            yield KvTransfer(chunk.data, chunk.total_bytes, chunk.layout, chunk.n_tokens)

    return pull
