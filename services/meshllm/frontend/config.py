"""The frontend's typed configuration (`FrontendConfig`) and the `meshllm frontend` flag parser.

Flags default to their `MESHLLM_*` variable. Three ways to reach workers:
`--router-address host:port[,...]` (router replicas over gRPC), the embedded
routing core (`--router-mode`, the default), or static mode
(`--static-endpoint ns.component.endpoint --static-workers host:port[,...]
--model-name NAME [--model-path PATH]`), which needs neither etcd nor NATS.
`--workers N` (`--frontend-workers`) runs N frontend processes on the same
ports (`meshllm.frontend.procs`). Every bad value is refused with one line
before anything starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from meshllm.config import (
    ConfigError,
    DiscoveryKind,
    EnvArgumentParser,
    EventsKind,
    PlaneConfig,
    ServerConfig,
    add_plane_args,
    add_tracing_args,
    parse_host_port,
)
from meshllm.router.config import RouterMode

__all__ = [
    "MAX_FRONTEND_WORKERS",
    "ROUTER_MODES",
    "FrontendConfig",
    "check_frontend_workers",
    "check_model_path",
    "frontend_arg_parser",
    "parse_static_endpoint",
]

ROUTER_MODES = tuple(m.value for m in RouterMode)  # the routing core owns the list
DEFAULT_MAX_BODY = 4 * 1024 * 1024
MAX_FRONTEND_WORKERS = 256  # a bound that catches typos (--workers 4000), far above any core count we serve on


def check_frontend_workers(n: int, *, flag: str = "--workers") -> None:
    """A one-line ConfigError unless 1 <= n <= MAX_FRONTEND_WORKERS."""
    if not 1 <= n <= MAX_FRONTEND_WORKERS:
        raise ConfigError(f"{flag} must be between 1 and {MAX_FRONTEND_WORKERS} frontend processes, got {n}")


def parse_static_endpoint(value: str) -> tuple[str, str, str]:
    """'ns.component.endpoint' → its three parts, or a one-line ConfigError."""
    parts = value.split(".")
    if len(parts) != 3 or not all(p and all(c.isalnum() or c in "-_" for c in p) for p in parts):
        raise ConfigError(f"--static-endpoint {value!r} is not namespace.component.endpoint (three dot-separated names)")
    return parts[0], parts[1], parts[2]


def check_model_path(path: str) -> None:
    """A one-line ConfigError unless `path` exists (or is builtin:NAME)."""
    if path.startswith("builtin:"):
        return
    if not Path(path).exists():
        raise ConfigError(f"--model-path {path!r} does not exist")


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontendConfig:
    """Everything a frontend needs, validated when built."""

    plane: PlaneConfig = field(default_factory=PlaneConfig)
    http_host: str = "127.0.0.1"
    http_port: int = 8000  # 0 = ephemeral
    grpc: ServerConfig | None = field(default_factory=ServerConfig)  # None = no Inference gRPC server
    router_addresses: tuple[str, ...] = ()
    router_mode: str = "kv"
    worker_component: str = "worker"
    max_inflight: int = 4096  # 0 = unlimited
    retry_after_s: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY
    model_name: str | None = None
    model_path: str | None = None
    static_endpoint: tuple[str, str, str] | None = None
    static_workers: tuple[str, ...] = ()
    tokenizer_cache_dir: Path | None = None
    metrics_enabled: bool = True
    otlp_endpoint: str | None = None
    # `--workers N`: N processes serve the same ports (meshllm.frontend.procs supervises them).
    workers: int = 1
    # Set only in the processes a `--workers N` supervisor starts: the process's index, and the
    # prometheus_client multiprocess directory its /metrics view sums over.
    process_index: int | None = None
    shared_metrics_dir: Path | None = None

    def __post_init__(self) -> None:
        check_frontend_workers(self.workers)
        if self.process_index is not None and self.shared_metrics_dir is None:
            raise ConfigError("a frontend process of a --workers group needs its shared metrics directory")
        if not 0 <= self.http_port < 65536:
            raise ConfigError(f"--http-port {self.http_port} is out of range 0..65535")
        if self.router_mode not in ROUTER_MODES:
            raise ConfigError(f"--router-mode {self.router_mode!r}: choose from {', '.join(ROUTER_MODES)}")
        for address in self.router_addresses:
            parse_host_port(address, what="--router-address entry")
        for address in self.static_workers:
            parse_host_port(address, what="--static-workers entry")
        if self.max_inflight < 0:
            raise ConfigError(f"--max-inflight must be >= 0, got {self.max_inflight}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.retry_after_s <= 0:
            raise ConfigError("--retry-after must be > 0 seconds")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("--model-name must not be empty")
        if self.model_path is not None:
            check_model_path(self.model_path)
        if self.static:
            if self.static_endpoint is None:
                raise ConfigError("static mode needs --static-endpoint namespace.component.endpoint")
            if not self.static_workers:
                raise ConfigError("static mode needs --static-workers host:port[,host:port...]")
            if not self.model_name:
                raise ConfigError("static mode needs --model-name")
            if self.router_addresses:
                raise ConfigError("--router-address and --static-workers exclude each other")

    @property
    def static(self) -> bool:
        return bool(self.static_workers) or self.static_endpoint is not None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> FrontendConfig:
        """Build from the flags of `frontend_arg_parser`."""
        endpoint = parse_static_endpoint(ns.static_endpoint) if ns.static_endpoint else None
        workers = tuple(w.strip() for w in (ns.static_workers or "").split(",") if w.strip())
        if ns.static_workers is not None and ns.static_workers.strip() and not workers:
            raise ConfigError(f"--static-workers {ns.static_workers!r} lists no host:port")
        plane = PlaneConfig.from_namespace(ns)
        if endpoint is not None or workers:
            events = plane.events if ns.events else EventsKind.NONE
            namespace = endpoint[0] if endpoint is not None else plane.namespace
            plane = PlaneConfig(namespace=namespace, discovery=DiscoveryKind.STATIC, events=events, nats_url=plane.nats_url)
        routers = tuple(a.strip() for a in (ns.router_address or "").split(",") if a.strip())
        return cls(
            plane=plane,
            http_host=ns.http_host,
            http_port=ns.http_port,
            grpc=None if ns.grpc_port < 0 else ServerConfig(host=ns.grpc_host, port=ns.grpc_port),
            router_addresses=routers,
            router_mode=ns.router_mode,
            worker_component=endpoint[1] if endpoint is not None else ns.worker_component,
            max_inflight=ns.max_inflight,
            retry_after_s=ns.retry_after,
            max_body_bytes=ns.max_body_bytes,
            model_name=ns.model_name,
            model_path=ns.model_path,
            static_endpoint=endpoint,
            static_workers=workers,
            tokenizer_cache_dir=Path(ns.tokenizer_cache_dir) if ns.tokenizer_cache_dir else None,
            otlp_endpoint=ns.otlp_endpoint or None,
            workers=ns.workers,
        )


def frontend_arg_parser(*, env: Mapping[str, str] | None = None, prog: str = "meshllm frontend") -> EnvArgumentParser:
    """Every `meshllm frontend` flag (defaults from `MESHLLM_*`, `os.environ` unless `env` is given)."""
    parser = EnvArgumentParser(
        prog=prog,
        env=os.environ if env is None else env,
        description="OpenAI-compatible HTTP API and text-level Inference gRPC API in front of the router",
    )
    g = parser.add_argument_group("frontend")
    g.add_argument("--http-host", default="0.0.0.0", help="HTTP listen host")
    g.add_argument("--http-port", type=int, default=8000, help="HTTP listen port (0 = ephemeral)")
    g.add_argument("--grpc-host", default="0.0.0.0", help="Inference gRPC listen host")
    g.add_argument("--grpc-port", type=int, default=0, help="Inference gRPC port (0 = ephemeral, -1 = off)")
    g.add_argument("--router-address", default="", help="router replicas host:port[,...] (default: embed the routing core)")
    g.add_argument("--router-mode", choices=ROUTER_MODES, default="kv", help="policy of the embedded routing core")
    g.add_argument("--worker-component", default="worker", help="discovery component of the workers (embedded core)")
    g.add_argument("--max-inflight", type=int, default=4096, help="requests in flight before 429 (0 = unlimited)")
    g.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds sent with 429")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="largest request body accepted")
    g.add_argument("--model-name", default=None, help="serve this model name (static mode: required)")
    g.add_argument("--model-path", default=None, help="HF directory or .gguf file: tokenizer and chat template")
    g.add_argument("--tokenizer-cache-dir", default="", help="where fetched/converted tokenizers are cached")
    g.add_argument(
        "--frontend-workers", "--workers", dest="workers", type=int, default=1,
        help="frontend processes serving the same HTTP and gRPC ports (SO_REUSEPORT), each with its own routing core",
    )  # fmt: skip
    s = parser.add_argument_group("static mode (no etcd, no NATS)")
    s.add_argument("--static-endpoint", default="", help="namespace.component.endpoint of the workers")
    s.add_argument("--static-workers", default=None, help="comma-separated worker host:port list")
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    add_tracing_args(parser)
    return parser
