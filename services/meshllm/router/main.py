"""Entry point of `meshllm router`, and `RouterServer`: planes + RouterCore + gRPC server + shutdown order.

    async with await RouterServer.start(config) as server:   # server.address
        ...                                                  # close = the ordered shutdown

Shutdown order (each step bounded, each runs even if one before failed):
unregister → stop serving (health NOT_SERVING, in-flight streams get the
grace period) → close the core (watches, event feed, replica sync) → close
channels → close planes → stop the metrics server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm import __version__, logs
from meshllm.lifecycle import AsyncCloseable, Shutdown, run_command, serve_until_signal
from meshllm.plane.discovery.base import Discovery, MemoryStore, open_discovery
from meshllm.plane.events.base import EventBus, MemoryBroker, open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.server import GrpcServer, start_server
from meshllm.ports import bind_error, check_free_all
from meshllm.protocol.chunks import set_coalescing
from meshllm.router.config import RouterConfig, router_arg_parser
from meshllm.router.core import RouterCore
from meshllm.router.service import router_binding
from meshllm.v1 import discovery_pb2

__all__ = ["RouterServer", "main"]

log = logging.getLogger("meshllm.router")


class RouterServer(AsyncCloseable):
    """A started router process: planes, core, gRPC server, registration, metrics. Use `start`."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.discovery: Discovery | None = None
        self.bus: EventBus | None = None
        self.channels = ChannelCache(
            max_message_bytes=config.server.max_message_bytes, liveness=config.liveness, security=config.security
        )
        self.core: RouterCore | None = None
        self.server: GrpcServer | None = None
        self.shutdown = Shutdown()
        self._metrics_server: Any = None

    @classmethod
    async def start(
        cls, config: RouterConfig, *, memory_store: MemoryStore | None = None, memory_broker: MemoryBroker | None = None
    ) -> RouterServer:
        """Open planes, start the core, serve, register. Cleans up on failure.

        A taken --port or --metrics-port is PortInUse before anything starts."""
        host = config.server.host
        check_free_all([(host, config.server.port, "--port"), (host, config.metrics_port, "--metrics-port")])
        self = cls(config)
        self._plan_shutdown()
        return await self.started(self._start(memory_store, memory_broker))

    async def _start(self, memory_store: MemoryStore | None, memory_broker: MemoryBroker | None) -> None:
        cfg = self.config
        host = cfg.server.host
        self.discovery = await open_discovery(cfg.plane, memory_store=memory_store)
        self.bus = await open_events(cfg.plane, memory_broker=memory_broker, name=cfg.router_id)
        self.core = RouterCore(cfg, self.discovery, self.bus, self.channels)
        await self.core.start()
        binding = router_binding(self.core, stream_interval_s=cfg.server.stream_interval_ms / 1000.0)
        self.server = await start_server(cfg.server, [binding], security=cfg.security)
        if not cfg.static:
            await self.discovery.register_instance(
                discovery_pb2.Instance(
                    id=cfg.router_id, namespace=cfg.plane.namespace, component=cfg.component, endpoint="generate",
                    address=self.address, version=__version__, metadata={"mode": cfg.mode.value},
                    session_address=f"{host}:{self.server.session_port}" if self.server.session_port is not None else "",
                )
            )  # fmt: skip
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            registry = self.core.metrics.registry
            try:
                self._metrics_server, _ = start_http_server(cfg.metrics_port, addr=host, registry=registry)
            except OSError as exc:
                raise bind_error(host, cfg.metrics_port, "--metrics-port", exc) from None
        log.info("router %s (%s) serving on %s", cfg.router_id, cfg.mode.value, self.address)

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def _plan_shutdown(self) -> None:
        sd = self.shutdown
        sd.add("unregister", self._unregister, timeout_s=5)
        sd.add("stop server", self._stop_server, timeout_s=15)
        sd.add("close core", self._close_core, timeout_s=10)
        sd.add("close channels", self.channels.aclose, timeout_s=5)
        sd.add("close planes", self._close_planes, timeout_s=10)
        sd.add("stop metrics", self._stop_metrics, timeout_s=5)

    async def _unregister(self) -> None:
        if self.discovery is not None and not self.config.static:
            await self.discovery.unregister()

    async def _stop_server(self) -> None:
        if self.server is not None:
            await self.server.aclose()

    async def _close_core(self) -> None:
        if self.core is not None:
            await self.core.aclose()

    async def _close_planes(self) -> None:
        if self.bus is not None:
            await self.bus.aclose()
        if self.discovery is not None:
            await self.discovery.aclose()

    async def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)

    async def _aclose(self) -> None:
        await self.shutdown.run()
        log.info("router stopped (%s)", ", ".join(f"{k} {v:.2f}s" for k, v in self.shutdown.durations.items()))


async def serve(config: RouterConfig) -> int:
    """Start, serve until SIGTERM/SIGINT, shut down in order."""
    set_coalescing(config.coalesce)  # --no-coalesce: a property of the whole process
    return await serve_until_signal(
        "router",
        lambda: RouterServer.start(config),
        lambda server: [f"meshllm router {config.router_id} ({config.mode.value}) serving on {server.address}"],
        service_name="meshllm-router",
        otlp_endpoint=config.otlp_endpoint,
    )


def main(argv: Sequence[str]) -> int:
    """`meshllm router [flags]`."""
    logs.setup_logging()
    ns = router_arg_parser().parse_args(list(argv))
    return run_command("router", lambda: RouterConfig.from_namespace(ns), serve)
