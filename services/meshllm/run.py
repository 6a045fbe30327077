"""`meshllm run`: frontend + router + N workers in one process — the embedded default.

    meshllm run [--workers 2] [--engine mocker] [--router-mode kv] [--prefill-workers N]
                [--http-port 8000] [--grpc-port P] [--router-port P] [--model-path PATH] [--model-name NAME]
                [--frontend-workers 1] [-- ENGINE FLAGS...]

One in-memory discovery store and one in-memory event broker are shared by
every service; requests travel over real gRPC on 127.0.0.1. Flags after `--`
go to every worker's engine. With `--prefill-workers N` the layout is
disaggregated: N prefill workers and `--workers` decode workers. It prints one
line per server and a ready-to-paste curl command, and on Ctrl-C / SIGTERM
stops in order: the frontend stops admitting → the router → the workers.

`--frontend-workers` accepts only 1: the frontend processes of `meshllm
frontend --workers N` agree through discovery and an event bus shared between
processes (etcd, NATS), and `meshllm run` keeps both in memory in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshllm.config import (
    ConfigError,
    DiscoveryKind,
    EnvArgumentParser,
    EventsKind,
    PlaneConfig,
    ServerConfig,
    add_coalesce_arg,
    add_tracing_args,
    doc_default,
    from_flags,
)
from meshllm.engine import load_engine_class
from meshllm.engine.base import LLMEngine
from meshllm.flags import split_engine_args
from meshllm.frontend.config import (
    ROUTER_MODES,
    FrontendConfig,
    add_output_args,
    check_frontend_workers,
    check_model_path,
)
from meshllm.frontend.http.auth import add_api_key_args, api_keys_from_namespace
from meshllm.frontend.main import Frontend, setup_logging
from meshllm.lifecycle import AsyncCloseable, command_error, run_loop, serve_until_signal
from meshllm.plane.auth import MeshSecurity, add_security_args
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.plane.request.local import LocalPeers
from meshllm.plane.request.server import GrpcServer, start_server
from meshllm.ports import check_free_all
from meshllm.protocol.chunks import set_coalescing
from meshllm.router import RouterCore
from meshllm.router.config import RoutingTuning, add_tuning_args
from meshllm.router.service import router_binding
from meshllm.worker.runtime import Worker

__all__ = ["Mesh", "RunConfig", "main", "run_arg_parser"]

log = logging.getLogger("meshllm.run")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """What `meshllm run` starts, validated when built: its workers, and the frontend in front of them.

    `frontend` is the embedded frontend's own configuration (its HTTP and gRPC
    ports, routing, model, API keys, security, coalescing), not a copy of it:
    the run takes its model, security and coalescing for the workers from
    there, and only replaces its planes with the run's in-memory ones.
    """

    workers: int = 2
    prefill_workers: int = 0
    engine: str = "mocker"
    engine_args: tuple[str, ...] = ()
    router_port: int = 0
    namespace: str = "meshllm"
    frontend_workers: int = 1
    frontend: FrontendConfig = field(default_factory=FrontendConfig)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.prefill_workers < 0:
            raise ConfigError(f"--prefill-workers must be >= 0, got {self.prefill_workers}")
        if not 0 <= self.router_port < 65536:
            raise ConfigError(f"--router-port {self.router_port} is out of range 0..65535")
        check_frontend_workers(self.frontend_workers, flag="--frontend-workers")
        if self.frontend_workers > 1:
            raise ConfigError(
                f"--frontend-workers {self.frontend_workers}: meshllm run keeps discovery and events in memory in one "
                "process, which other frontend processes cannot share; run `meshllm frontend --workers N` with "
                "etcd + NATS instead"
            )

    def frontend_config(self) -> FrontendConfig:
        """The embedded frontend's configuration, on the run's in-memory planes."""
        return dataclasses.replace(self.frontend, plane=self.plane)

    @property
    def plane(self) -> PlaneConfig:
        return PlaneConfig(namespace=self.namespace, discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)

    @property
    def security(self) -> MeshSecurity:
        """TLS and mesh token of every server and client of the run (the frontend's flags)."""
        return self.frontend.security

    def worker_argv(self, role: str, *, simulate: Sequence[str] = ()) -> list[str]:
        """Flags for one worker: the embedded defaults first, so that the user's engine flags win."""
        argv = [*simulate, "--discovery", "memory", "--events", "memory", "--namespace", self.namespace]
        argv += ["--host", "127.0.0.1", "--port", "0", "--grace-period", "0", "--role", role]
        model_name, model_path = self.frontend.model_name, self.frontend.model_path
        if model_name:
            argv += ["--model-name", model_name]
        if model_path and self.engine not in ("mocker", "sample"):
            argv += ["--model-path", model_path]
        if (tls := self.security.tls) is not None:
            argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
            argv += ["--tls-ca", str(tls.ca)] if tls.ca is not None else []
        if self.security.token is not None:
            argv += ["--mesh-token", self.security.token]  # parsed in this process, never on a command line
        if not self.frontend.coalesce:
            argv += ["--no-coalesce"]
        return argv + list(self.engine_args)


def run_arg_parser(*, env: dict[str, str] | None = None) -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog="meshllm run",
        env=os.environ if env is None else env,
        description="frontend + router + workers in one process (flags after -- go to every worker's engine)",
    )
    g = parser.add_argument_group("run")
    g.add_argument("--workers", type=int, default=2, help="workers (decode workers when `--prefill-workers` > 0)")
    g.add_argument("--prefill-workers", type=int, default=0, help="prefill workers; > 0 makes the layout disaggregated")
    g.add_argument(
        "--engine", default="mocker", help="engine of every worker: `mocker`, `sample`, `llamacpp`, `trtllm`, or `module:Class`"
    )
    g.add_argument(
        "--router-mode",
        choices=ROUTER_MODES,
        default="kv",
        help="routing policy: `kv`, `approximate`, `round-robin`, `random`, `least-loaded`",
    )
    g.add_argument("--http-host", default="127.0.0.1", help="HTTP and Inference gRPC listen host")
    g.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0 = ephemeral)")
    g.add_argument("--grpc-port", type=int, default=0, help="Inference gRPC port (0 = ephemeral)")
    g.add_argument("--router-port", type=int, default=0, help="Router gRPC port, for grpcurl and clients (0 = ephemeral)")
    g.add_argument(
        "--model-path",
        default=None,
        help="Hugging Face directory or `.gguf` file: the model (for engines that load one), its tokenizer and chat template",
    )
    doc_default(g.add_argument("--model-name", default=None, help="public model name"), "the engine's")
    g.add_argument("--namespace", default="meshllm", help="namespace of the in-memory planes")
    g.add_argument("--max-inflight", type=int, default=4096, help="requests in flight before 429 (0 = unlimited)")
    g.add_argument(
        "--frontend-workers", type=int, default=1,
        help=(
            "only 1: the in-memory planes of `meshllm run` cannot be shared between processes; a larger value stops startup "
            "with one line naming `meshllm frontend --workers N` (etcd + NATS)"
        ),
    )  # fmt: skip
    add_tuning_args(parser)
    add_output_args(parser)
    add_coalesce_arg(g)
    add_api_key_args(parser)
    add_security_args(parser)
    add_tracing_args(parser)
    return parser


def parse_run_args(argv: Sequence[str]) -> RunConfig:
    """`meshllm run` argv (flags before `--`, engine flags after) → RunConfig; ConfigError on a bad value."""
    args, engine_args = split_engine_args(argv)
    return run_config(run_arg_parser().parse_args(args), engine_args)


def run_config(ns: argparse.Namespace, engine_args: Sequence[str] = ()) -> RunConfig:
    """RunConfig from `run_arg_parser`'s flags and the engine's own (after `--`); ConfigError on a bad value."""
    if ns.model_path is not None:
        check_model_path(ns.model_path)
    if not 0 <= ns.grpc_port < 65536:
        raise ConfigError(f"--grpc-port {ns.grpc_port} is out of range 0..65535")
    frontend = from_flags(
        FrontendConfig, ns, grpc=ServerConfig(host=ns.http_host, port=ns.grpc_port),
        routing=RoutingTuning.from_namespace(ns), api_keys=api_keys_from_namespace(ns), coalesce=not ns.no_coalesce,
        security=MeshSecurity.from_namespace(ns), otlp_endpoint=ns.otlp_endpoint or None,
        workers=1,  # `meshllm run --workers` counts engine workers; its HTTP API is one process
    )  # fmt: skip
    return from_flags(RunConfig, ns, engine_args=tuple(engine_args), frontend=frontend)


class Mesh(AsyncCloseable):
    """Everything `meshllm run` starts. Use `Mesh.start`; close = frontend stops admitting → router → workers."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.store = MemoryStore()
        self.broker = MemoryBroker()
        self.local = LocalPeers()  # the request plane in memory too: workers called directly
        self.workers: list[Worker] = []
        self.frontend: Frontend | None = None
        self.router_server: GrpcServer | None = None

    @classmethod
    async def start(cls, config: RunConfig, *, ready_timeout_s: float = 120.0) -> Mesh:
        self = cls(config)
        return await self.started(self._start(ready_timeout_s))

    async def _start(self, ready_timeout_s: float) -> None:
        cfg = self.config
        front = cfg.frontend
        check_free_all(
            [
                (front.http_host, front.http_port, "--http-port"),
                (front.grpc.host, front.grpc.port, "--grpc-port") if front.grpc is not None else ("", None, ""),
                ("127.0.0.1", cfg.router_port, "--router-port"),
            ]
        )
        engine_cls = load_engine_class(cfg.engine)
        roles = ["prefill"] * cfg.prefill_workers + ["decode" if cfg.prefill_workers else "agg"] * cfg.workers
        simulate = await _simulated_model_flags(cfg)
        # Construct every engine first: a bad engine flag stops everything before anything starts.
        built: list[tuple[LLMEngine, Any]] = [
            await engine_cls.from_args(engine_cls.instance_args(cfg.worker_argv(role, simulate=simulate), i, len(roles)))
            for i, role in enumerate(roles)
        ]
        # The in-process plane and the Router service pace streams as the workers' flags say (--stream-interval-ms
        # after --; all workers of a run get the same flags).
        interval_s = built[0][1].server.stream_interval_ms / 1000.0
        self.local.set_interval(interval_s)
        for engine, wcfg in built:
            self.workers.append(
                await Worker.start(engine, wcfg, memory_store=self.store, memory_broker=self.broker, local=self.local)
            )
        self.frontend = await Frontend.start(
            cfg.frontend_config(), memory_store=self.store, memory_broker=self.broker, local=self.local
        )
        self.router_server = await _serve_router(self.frontend.router, cfg.router_port, cfg.security, interval_s)
        # One /metrics for the whole process: the frontend's, its routing core's (Frontend does that) and every worker's.
        for w in self.workers:
            self.frontend.metrics.include(w.metrics.registry)
        assert self.frontend.registry is not None
        for name in {w.model_card.name for w in self.workers if w.model_card is not None}:
            await self.frontend.registry.wait_for(name, timeout_s=ready_timeout_s)

    @property
    def model(self) -> str:
        card = self.workers[0].model_card if self.workers else None
        return card.name if card is not None else "model"

    @property
    def router_address(self) -> str | None:
        return self.router_server.address if self.router_server is not None else None

    def lines(self) -> list[str]:
        """One line per server and a curl command to paste."""
        assert self.frontend is not None
        url = self.frontend.url
        out = [f"OpenAI HTTP API    {url}/v1   (health {url}/health, metrics {url}/metrics)"]
        out.append(f"Live mesh page     {url}/dashboard")
        if self.frontend.grpc_address:
            out.append(f"Inference gRPC     {self.frontend.grpc_address}")
        if self.router_address:
            out.append(f"Router gRPC        {self.router_address}   (mode {self.config.frontend.router_mode})")
        for w in self.workers:
            out.append(f"worker {w.config.role.value:<8}   {w.address}   ({w.id}, engine {w.config.engine})")
        body = f'{{"model": "{self.model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
        out.append(
            f"try: curl {self.frontend.url}/v1/chat/completions -H 'content-type: application/json'"
            + (" -H 'authorization: Bearer YOUR_API_KEY'" if self.config.frontend.api_keys else "")
            + _curl_tls(self.config.security)
            + f" -d {shlex.quote(body)}"
        )
        return out

    async def _aclose(self) -> None:
        if self.frontend is not None and self.frontend.core is not None:
            self.frontend.core.admitting = False
        if self.router_server is not None:
            await self.router_server.aclose()
        if self.frontend is not None:
            await self.frontend.aclose()
        results = await asyncio.gather(*(w.aclose() for w in self.workers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.warning("worker shutdown failed: %s", r)


def _curl_tls(security: MeshSecurity) -> str:
    """curl's TLS flags for the HTTPS API: the CA, and a client certificate under mTLS."""
    tls = security.tls
    if tls is None or tls.ca is None:
        return ""
    return f" --cacert {shlex.quote(str(tls.ca))} --cert YOUR_CLIENT_CERT --key YOUR_CLIENT_KEY"


async def _simulated_model_flags(cfg: RunConfig) -> list[str]:
    """With --model-path, the mocker simulates that model: its vocabulary size and EOS id."""
    if cfg.engine != "mocker" or not cfg.frontend.model_path:
        return []
    from meshllm.frontend.text.tokenizer import load_tokenizer

    tok = await asyncio.to_thread(load_tokenizer, cfg.frontend.model_path)
    flags = ["--vocab-size", str(tok.vocab_size)]
    if tok.eos_token_ids:
        flags += ["--eos-token-id", str(tok.eos_token_ids[0])]
    return flags


async def _serve_router(router: RouterCore | None, port: int, security: MeshSecurity, interval_s: float) -> GrpcServer | None:
    """Serve the frontend's embedded routing core as the Router gRPC service too (grpcurl's view of routing)."""
    if router is None:
        return None
    binding = router_binding(router, stream_interval_s=interval_s)
    return await start_server(ServerConfig(host="127.0.0.1", port=port), [binding], port_flag="--router-port", security=security)


async def serve(config: RunConfig) -> int:
    set_coalescing(config.frontend.coalesce)  # --no-coalesce: a property of the whole process
    return await serve_until_signal(
        "run",
        lambda: Mesh.start(config),
        Mesh.lines,
        service_name="meshllm",
        otlp_endpoint=config.frontend.otlp_endpoint,
    )


def main(argv: Sequence[str]) -> int:
    """`meshllm run`: exit 2 with one line on a bad flag, before anything starts."""
    try:
        config = parse_run_args(argv)
        load_engine_class(config.engine)
    except ConfigError as exc:
        return command_error("run", exc.message)
    setup_logging()
    return run_loop(serve(config))
