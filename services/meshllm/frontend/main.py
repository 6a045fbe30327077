"""`meshllm frontend`: wiring (planes, router, models, HTTP and gRPC servers) and the ordered shutdown.

    async with await Frontend.start(config) as fe:      # serving when start() returns
        print(fe.url, fe.grpc_address)
                                                        # close = the ordered shutdown:
    stop admitting (503, gRPC NOT_SERVING) → drain (open streams run on until
    DRAIN_TIMEOUT_S, then each ends with an error: an OpenAI error event on HTTP,
    UNAVAILABLE on gRPC) → HTTP server stops → gRPC server stops → model registry
    → router → channels → planes.

Upstream: `--router-address` → router replicas over gRPC (`RouterClient`s);
otherwise the routing core is embedded (`meshllm.router.RouterCore`,
`--router-mode`; in static mode it probes the `--static-workers` itself).
Static mode builds its discovery from the flags: one Instance per
`--static-workers` address and a ModelCard for `--model-name` (context
length, eos ids and tokenizer source taken from the workers' GetInfo when
they answer, `--model-path` overriding the tokenizer).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm import logs
from meshllm.config import ConfigError, DiscoveryKind
from meshllm.errors import MeshError, Unavailable
from meshllm.frontend.config import FrontendConfig, frontend_arg_parser
from meshllm.frontend.http.app import OpenAIApp
from meshllm.frontend.http.auth import exposure_warning
from meshllm.frontend.http.dashboard import Dashboard
from meshllm.frontend.http.planner_panel import PlannerReader, etcd_planner_reader
from meshllm.frontend.http.server import HttpServer
from meshllm.frontend.metrics import FrontendMetrics
from meshllm.frontend.models import ModelRegistry
from meshllm.frontend.openai.grpc_api import inference_binding
from meshllm.frontend.openai.inference import InferenceCore
from meshllm.frontend.procs import INDEX_ENV, METRICS_DIR_ENV, PARENT_ENV, supervise
from meshllm.frontend.shared_metrics import SharedMetricsRegistry
from meshllm.frontend.upstream import DEFAULT_MIGRATION_LIMIT, RouterReplicas, Upstream, follow_router_sessions
from meshllm.lifecycle import AsyncCloseable, Shutdown, command_error, run_loop, serve_until_signal
from meshllm.plane.discovery.base import Discovery, MemoryStore, open_discovery
from meshllm.plane.events.base import EventBus, MemoryBroker, open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.local import LocalPeers
from meshllm.plane.request.server import GrpcServer, start_server
from meshllm.ports import check_free_all
from meshllm.protocol.chunks import set_coalescing
from meshllm.router import RouterClient, RouterConfig, RouterCore, RouterMode
from meshllm.router.config import StaticEndpoint
from meshllm.tracing import FRONTEND_SERVICE
from meshllm.v1 import discovery_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["Frontend", "die_with_parent", "group_member", "main", "serve", "static_records"]

log = logging.getLogger("meshllm.frontend")
T = TypeVar("T")
# How long a shutdown lets open streams run on (the HTTP server's own grace period is as long),
# and how long the streams cut at that deadline get to send their error events.
DRAIN_TIMEOUT_S = 10.0
CUT_WAIT_S = 2.0


async def static_records(
    config: FrontendConfig, channels: ChannelCache, *, probe_timeout_s: float = 3.0
) -> tuple[list[discovery_pb2.Instance], list[discovery_pb2.ModelCard]]:
    """Instances and ModelCards of static mode, enriched by the workers' GetInfo when they answer."""
    assert config.static_endpoint is not None and config.model_name
    ns, component, endpoint = config.static_endpoint

    async def probe(address: str) -> discovery_pb2.ModelCard | None:
        with contextlib.suppress(MeshError, TimeoutError):
            info = await WorkerClient(channels, address).get_info(timeout_s=probe_timeout_s)
            return info.model_card
        return None

    cards = await asyncio.gather(*(probe(a) for a in config.static_workers))
    instances, models = [], []
    for i, (address, found) in enumerate(zip(config.static_workers, cards, strict=True)):
        iid = f"static-{i}"
        instances.append(
            discovery_pb2.Instance(
                id=iid, namespace=ns, component=component, endpoint=endpoint, address=address,
                role=discovery_pb2.WORKER_ROLE_AGGREGATED, model=config.model_name, dp_size=1,
            )
        )  # fmt: skip
        card = discovery_pb2.ModelCard()
        if found is not None:
            card.CopyFrom(found)
            if card.tokenizer_source.startswith("worker:"):
                card.tokenizer_source = f"worker:{iid}"
        card.name, card.instance_id = config.model_name, iid
        if config.model_path:
            card.tokenizer_source = config.model_path
        models.append(card)
    return instances, models


class Frontend(AsyncCloseable):
    """A started frontend. Use `Frontend.start`."""

    def __init__(self, config: FrontendConfig, *, local: LocalPeers | None = None) -> None:
        self.config = config
        shared = config.shared_metrics_dir
        self.metrics = FrontendMetrics(registry=SharedMetricsRegistry(shared)) if shared is not None else FrontendMetrics()
        self.channels = ChannelCache(local=local, liveness=config.liveness, security=config.security)
        self.discovery: Discovery | None = None
        self.bus: EventBus | None = None
        self.router: RouterCore | None = None
        self.upstream: Upstream | None = None
        self.registry: ModelRegistry | None = None
        self.core: InferenceCore | None = None
        self.dashboard: Dashboard | None = None
        self.http: HttpServer | None = None
        self.grpc: GrpcServer | None = None
        self.shutdown = Shutdown()
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self._follow: asyncio.Task[None] | None = None  # follow_router_sessions

    @classmethod
    async def start(
        cls,
        config: FrontendConfig,
        *,
        memory_store: MemoryStore | None = None,
        memory_broker: MemoryBroker | None = None,
        upstream: Upstream | None = None,
        local: LocalPeers | None = None,
    ) -> Frontend:
        """Open planes and the upstream, follow models, serve HTTP and gRPC. Cleans up on failure.

        `local` (meshllm run): workers of this process, called directly by the routing core (plane/request/local.py).
        """
        self = cls(config, local=local)
        self._plan_shutdown()
        return await self.started(self._start(memory_store, memory_broker, upstream))

    async def _start(self, store: MemoryStore | None, broker: MemoryBroker | None, upstream: Upstream | None) -> None:
        cfg = self.config
        if cfg.process_index is None:  # the processes of `--workers N` share ports their supervisor checked
            grpc = (cfg.grpc.host, cfg.grpc.port) if cfg.grpc is not None else ("", None)
            check_free_all([(cfg.http_host, cfg.http_port, "--http-port"), (*grpc, "--grpc-port")])
        instances: list[discovery_pb2.Instance] = []
        cards: list[discovery_pb2.ModelCard] = []
        if cfg.static:
            instances, cards = await static_records(cfg, self.channels)
        self.discovery = await open_discovery(cfg.plane, memory_store=store, static_instances=instances, static_models=cards)
        self.bus = await open_events(cfg.plane, memory_broker=broker, name="meshllm-frontend")
        self.upstream = upstream if upstream is not None else await self._open_upstream()
        if cfg.router_addresses and not cfg.static:  # routers serving sessions on TCP say so in discovery
            self._follow = asyncio.create_task(
                follow_router_sessions(self.discovery, self.channels, cfg.router_addresses), name="router-sessions"
            )
        self.registry = await ModelRegistry(
            self.discovery,
            self.channels,
            model_path=cfg.model_path,
            model_name=cfg.model_name,
            cache_dir=cfg.tokenizer_cache_dir,
        ).start()
        self.core = InferenceCore(
            self.registry,
            self.upstream,
            self.metrics,
            max_inflight=cfg.max_inflight,
            retry_after_s=cfg.retry_after_s,
            parsers=cfg.parsers,
        )
        await self._serve(self.core)

    async def _serve(self, core: InferenceCore) -> None:
        """The dashboard, the HTTP app and server, and the Inference gRPC server over `core`."""
        cfg = self.config
        routers = [RouterClient(self.channels, a) for a in cfg.router_addresses] if self.router is None else []
        self.dashboard = await Dashboard(core, router=self.router, routers=routers, planner=self._planner_reader()).start()
        self.app = app = OpenAIApp(
            core,
            max_body_bytes=cfg.max_body_bytes,
            api_keys=cfg.api_keys,
            open_metrics=cfg.open_metrics,
            body_timeout_s=cfg.body_timeout_s,
            dashboard=self.dashboard,
            strict_params=cfg.strict_params,
        )
        # One of `--workers N` shares its ports with its group; any other frontend binds them exclusively.
        shared = cfg.process_index is not None
        self.http = await HttpServer.start(
            app, cfg.http_host, cfg.http_port, reuse_port=shared, tls=cfg.api_security.tls, header_timeout_s=cfg.header_timeout_s
        )
        if cfg.grpc is not None:
            self.grpc = await start_server(
                cfg.grpc,
                [inference_binding(core, cfg.api_keys)],
                port_flag="--grpc-port",
                reuse_port=shared,
                security=cfg.api_security,
            )
        log.info("frontend serving HTTP on %s, Inference gRPC on %s", self.url, self.grpc_address or "(off)")
        listeners = [("the OpenAI HTTP API", self.http.host, self.http.port)]
        if self.grpc is not None:
            listeners.append(("Inference gRPC", self.grpc.host, self.grpc.port))
        warning = exposure_warning(listeners, cfg.api_keys)
        if warning is not None and not cfg.process_index:  # one line for a `--workers N` group
            log.warning("%s", warning)

    def _planner_reader(self) -> PlannerReader | None:
        """The dashboard's reader of the SLA planner's keys: only over etcd, where a planner keeps them."""
        if self.config.plane.discovery is not DiscoveryKind.ETCD:
            return None  # and a frontend on other planes never loads aetcd
        from meshllm.plane.discovery.etcd import EtcdDiscovery

        return etcd_planner_reader(self.discovery) if isinstance(self.discovery, EtcdDiscovery) else None

    async def _open_upstream(self) -> Upstream:
        cfg = self.config
        assert self.discovery is not None and self.bus is not None
        if cfg.router_addresses:
            return RouterReplicas.connect(
                self.channels, cfg.router_addresses, RouterClient, wait_s=cfg.router_wait_s, migration_limit=self._migration_limit
            )
        endpoint = StaticEndpoint(*cfg.static_endpoint) if cfg.static_endpoint else None
        rc = RouterConfig(
            plane=cfg.plane,
            mode=RouterMode(cfg.router_mode),
            tuning=cfg.routing,
            static_endpoint=endpoint,
            static_workers=cfg.static_workers,
            model_name=cfg.model_name if cfg.static else None,
            stall_timeout_s=cfg.stall_timeout_s,
            stream_stall_timeout_s=cfg.stream_stall_timeout_s,
            health_interval_s=cfg.health_interval_s,
            health_timeout_s=cfg.health_timeout_s,
        )
        core = RouterCore(rc, self.discovery, self.bus, self.channels)
        self.router = core
        if cfg.shared_metrics_dir is None:  # under --workers N each process routes on its own: not one group's view
            self.metrics.include(core.metrics.registry)
        await core.start()
        return core

    def _migration_limit(self, model: str) -> int:
        """How often a request may resume on another router replica: its model card's migration limit."""
        if self.registry is not None:
            with contextlib.suppress(MeshError):
                return int(self.registry.lookup(model).card.migration_limit)
        return DEFAULT_MIGRATION_LIMIT

    @property
    def url(self) -> str:
        assert self.http is not None
        return self.http.url

    @property
    def grpc_address(self) -> str | None:
        if self.grpc is None:
            return None
        host = "127.0.0.1" if self.grpc.host in ("0.0.0.0", "") else self.grpc.host
        return f"{host}:{self.grpc.port}"

    # ------------------------------------------------------------ shutdown
    def _plan_shutdown(self) -> None:
        sd = self.shutdown
        sd.add("stop admitting", self._stop_admitting)
        sd.add("drain", self._drain)
        sd.add("stop http", self._close(lambda: self.http), timeout_s=15)
        sd.add("stop grpc", self._close(lambda: self.grpc), timeout_s=10)
        sd.add("stop dashboard", self._close(lambda: self.dashboard), timeout_s=5)
        sd.add("close models", self._close(lambda: self.registry), timeout_s=5)
        sd.add("close router", self._close(lambda: self.router), timeout_s=10)
        sd.add("stop following routers", self._stop_following, timeout_s=5)
        sd.add("close channels", self.channels.aclose, timeout_s=5)
        sd.add("close events", self._close(lambda: self.bus), timeout_s=5)
        sd.add("close discovery", self._close(lambda: self.discovery), timeout_s=5)

    async def _stop_following(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)

    async def _stop_admitting(self) -> None:
        if self.core is not None:
            self.core.admitting = False
        if self.grpc is not None:
            await self.grpc.set_serving(False)

    async def _drain(self) -> None:
        """Let open streams finish until the drain deadline; then end each with an error the client sees."""
        core = self.core
        if core is None:
            return
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                await core.wait_idle()
            return
        except TimeoutError:
            pass
        err = Unavailable(f"the frontend is shutting down and its drain deadline ({self.drain_timeout_s:g}s) passed; retry")
        log.warning("drain deadline: ending %d open streams with an error", core.cut_all(err))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CUT_WAIT_S):
                await core.wait_idle()

    @staticmethod
    def _close(get: Any) -> Any:
        async def close() -> None:
            thing = get()
            if thing is not None:
                await thing.aclose()

        return close

    async def _aclose(self) -> None:
        await self.shutdown.run()


# ---------------------------------------------------------------- entry point


def setup_logging(process_index: int | None = None) -> None:
    logs.setup_logging("%(name)s" if process_index is None else f"%(name)s[{process_index}]")


async def serve(config: FrontendConfig) -> int:
    """Start, print where it serves, run until SIGTERM/SIGINT, shut down in order."""

    def ready(frontend: Frontend) -> list[str]:
        lines = [f"meshllm frontend: OpenAI HTTP API on {frontend.url}/v1"]
        if frontend.grpc_address:
            lines.append(f"meshllm frontend: Inference gRPC on {frontend.grpc_address}")
        return lines

    set_coalescing(config.coalesce)  # --no-coalesce: a property of the whole process
    return await serve_until_signal(
        "frontend",
        lambda: Frontend.start(config),
        ready,
        service_name=FRONTEND_SERVICE,
        otlp_endpoint=config.otlp_endpoint,
    )


def group_member(config: FrontendConfig, env: dict[str, str] | os._Environ[str]) -> FrontendConfig:
    """`config` as process i of a `--workers N` group when the supervisor's variables say so (else unchanged)."""
    index = env.get(INDEX_ENV)
    if index is None:
        return config
    if not index.isdigit() or not env.get(METRICS_DIR_ENV):
        raise ConfigError(f"{INDEX_ENV}={index!r} is set by `meshllm frontend --workers N` for its processes only")
    return dataclasses.replace(config, process_index=int(index), shared_metrics_dir=Path(env[METRICS_DIR_ENV]))


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the supervisor goes away, even by SIGKILL (Linux); no orphaned frontends."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str]) -> int:
    """`meshllm frontend [flags]`: exit 2 with one line on a bad flag, before anything starts.

    `--workers N` (N > 1) makes this process the supervisor of N frontend processes (`meshllm.frontend.procs`).
    """
    ns = frontend_arg_parser().parse_args(list(argv))
    try:
        config = group_member(FrontendConfig.from_namespace(ns), os.environ)
    except ConfigError as exc:
        return command_error("frontend", exc.message)
    setup_logging(config.process_index)
    if config.workers > 1:
        return run_loop(supervise(argv, config))
    if config.process_index is not None and os.environ.get(PARENT_ENV, "").isdigit():
        die_with_parent(int(os.environ[PARENT_ENV]))
    return run_loop(serve(config))
