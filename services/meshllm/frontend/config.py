"""The frontend's typed configuration (`FrontendConfig`) and the `meshllm frontend` flag parser.

Flags default to their `MESHLLM_*` variable. Three ways to reach workers:
`--router-address host:port[,...]` (router replicas over gRPC; a request
waits up to `--router-wait-s` while none can be reached), the embedded
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
from typing import ClassVar

from meshllm.config import (
    ConfigError,
    DiscoveryKind,
    EnvArgumentParser,
    PlaneConfig,
    ServerConfig,
    add_coalesce_arg,
    add_plane_args,
    add_tracing_args,
    doc_default,
    from_flags,
    parse_host_port,
)
from meshllm.frontend.http.auth import ApiKeys, add_api_key_args, api_keys_from_namespace
from meshllm.frontend.text.output_parsers import ParserChoice, parse_parser_flag
from meshllm.frontend.text.reasoning import REASONING_PARSERS
from meshllm.frontend.tools import TOOL_PARSERS
from meshllm.frontend.upstream import DEFAULT_ROUTER_WAIT_S
from meshllm.plane.auth import MeshSecurity, add_security_args
from meshllm.plane.request.liveness import SessionLiveness
from meshllm.plane.tls import TlsConfig
from meshllm.router.config import (
    RouterMode,
    RoutingTuning,
    add_liveness_args,
    add_tuning_args,
    check_health_flags,
    check_model_and_static,
)

__all__ = [
    "MAX_FRONTEND_WORKERS",
    "ROUTER_MODES",
    "FrontendConfig",
    "add_output_args",
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

    FLAG_DESTS: ClassVar[Mapping[str, str]] = {
        "health_interval_s": "worker_health_interval",
        "health_timeout_s": "worker_health_timeout",
        "header_timeout_s": "http_header_timeout",
        "body_timeout_s": "http_body_timeout",
    }

    plane: PlaneConfig = field(default_factory=PlaneConfig)
    http_host: str = "127.0.0.1"
    http_port: int = 8000  # 0 = ephemeral
    grpc: ServerConfig | None = field(default_factory=ServerConfig)  # None = no Inference gRPC server
    router_addresses: tuple[str, ...] = ()
    router_wait_s: float = DEFAULT_ROUTER_WAIT_S  # how long a request waits while no router replica can be reached
    router_mode: str = "kv"
    routing: RoutingTuning = field(default_factory=RoutingTuning)  # the embedded core's tuning (no --router-address)
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
    coalesce: bool = True  # False: --no-coalesce (meshllm.protocol.chunks)
    # `--workers N`: N processes serve the same ports (meshllm.frontend.procs supervises them).
    workers: int = 1
    # Set only in the processes a `--workers N` supervisor starts: the process's index, and the
    # prometheus_client multiprocess directory its /metrics view sums over.
    process_index: int | None = None
    shared_metrics_dir: Path | None = None
    # Stall detection of the sessions to routers or workers (plane/request/channels.py SessionLiveness), and
    # the embedded routing core's worker health checks (router/workers.py; interval 0 = none).
    stall_timeout_s: float = 3.0
    stream_stall_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    # API keys of the HTTP and Inference gRPC APIs (frontend/http/auth.py; empty = open), and slow-client limits.
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    open_metrics: bool = False  # with API keys: /metrics and /dashboard* are served without one
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # TLS on the Inference gRPC API, the HTTP API (HTTPS) and the calls to routers and workers;
    # the mesh token for those calls (plane/auth.py).
    security: MeshSecurity = field(default_factory=MeshSecurity)
    # With --tls-ca: whether the HTTP and Inference APIs require client certificates too
    # (False: public clients use API keys while the calls into the mesh stay mTLS).
    api_client_certs: bool = True
    # Output parsers (frontend/text/output_parsers.py): NAME, MODEL=NAME,..., "auto" (card, then template) or "none";
    # and whether unknown request fields are a 400 (else named in the x-meshllm-ignored-params header).
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    strict_params: bool = False

    def __post_init__(self) -> None:
        _ = self.parsers  # validates the parser flags
        _ = self.liveness  # validates the stall flags
        check_health_flags(self.health_interval_s, self.health_timeout_s)
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
        if not 0 <= self.router_wait_s <= 3600:  # also refuses NaN
            raise ConfigError(f"--router-wait-s must be between 0 and 3600 seconds, got {self.router_wait_s}")
        if self.max_inflight < 0:
            raise ConfigError(f"--max-inflight must be >= 0, got {self.max_inflight}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        for flag, value in (("--http-header-timeout", self.header_timeout_s), ("--http-body-timeout", self.body_timeout_s)):
            if not 0 < value <= 3600:  # also refuses NaN
                raise ConfigError(f"{flag} must be between 0 and 3600 seconds (> 0), got {value}")
        if self.retry_after_s <= 0:
            raise ConfigError("--retry-after must be > 0 seconds")
        if self.model_path is not None:
            check_model_path(self.model_path)
        check_model_and_static(self.model_name, self.static, self.static_endpoint, self.static_workers)
        if self.static and self.router_addresses:
            raise ConfigError("--router-address and --static-workers exclude each other")

    @property
    def static(self) -> bool:
        return bool(self.static_workers) or self.static_endpoint is not None

    @property
    def api_security(self) -> MeshSecurity:
        """The TLS of the frontend's own APIs: `security`, without client certificates when not `api_client_certs`."""
        tls = self.security.tls
        if tls is None or tls.ca is None or self.api_client_certs:
            return self.security
        return MeshSecurity(tls=TlsConfig(cert=tls.cert, key=tls.key), token=self.security.token)

    @property
    def parsers(self) -> ParserChoice:
        """The reasoning and tool-call parsers per model (a one-line ConfigError for an unknown name)."""
        return ParserChoice(
            tool=parse_parser_flag(self.tool_call_parser, tuple(TOOL_PARSERS), "--tool-call-parser"),
            reasoning=parse_parser_flag(self.reasoning_parser, REASONING_PARSERS, "--reasoning-parser"),
        )

    @property
    def liveness(self) -> SessionLiveness:
        """How long the frontend's sessions (to routers, or the embedded core's to workers) may stall."""
        return SessionLiveness(stall_timeout_s=self.stall_timeout_s, stream_stall_timeout_s=self.stream_stall_timeout_s)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> FrontendConfig:
        """Build from the flags of `frontend_arg_parser`."""
        endpoint = parse_static_endpoint(ns.static_endpoint) if ns.static_endpoint else None
        workers = tuple(w.strip() for w in (ns.static_workers or "").split(",") if w.strip())
        if ns.static_workers is not None and ns.static_workers.strip() and not workers:
            raise ConfigError(f"--static-workers {ns.static_workers!r} lists no host:port")
        plane = PlaneConfig.from_namespace(ns)
        if endpoint is not None or workers:
            plane = plane.static(namespace=endpoint[0] if endpoint is not None else None, events_flag=ns.events)
        routers = tuple(a.strip() for a in (ns.router_address or "").split(",") if a.strip())
        return from_flags(
            cls, ns, plane=plane, grpc=None if ns.grpc_port < 0 else ServerConfig(host=ns.grpc_host, port=ns.grpc_port),
            router_addresses=routers, routing=RoutingTuning.from_namespace(ns), static_endpoint=endpoint,
            static_workers=workers, otlp_endpoint=ns.otlp_endpoint or None, coalesce=not ns.no_coalesce,
            tokenizer_cache_dir=Path(ns.tokenizer_cache_dir) if ns.tokenizer_cache_dir else None,
            api_keys=api_keys_from_namespace(ns), security=MeshSecurity.from_namespace(ns),
            api_client_certs=ns.api_client_certs == "required",
        )  # fmt: skip


def add_output_args(parser: EnvArgumentParser) -> None:
    """--tool-call-parser, --reasoning-parser, --strict-params (frontend and `meshllm run`)."""
    g = parser.add_argument_group("OpenAI output parsing and strictness")
    g.add_argument(
        "--tool-call-parser", default="auto",
        help=(
            "tool-call format of the models' output: `hermes`, `qwen`, `llama3_json`, `mistral`, `pythonic`, `json`, `auto` "
            "(the worker's model card, then the chat template) or `none`; one name for every model or `MODEL=NAME,...` ([tool "
            "calls](frontend.md#tool-calls))"
        ),
    )  # fmt: skip
    g.add_argument(
        "--reasoning-parser", default="auto",
        help=(
            "`<think>` text into `reasoning_content`: `qwen3`, `deepseek_r1`, `auto` (card, then a template that mentions "
            "`<think>`) or `none`; one or `MODEL=NAME,...` ([reasoning](frontend.md#reasoning))"
        ),
    )  # fmt: skip
    g.add_argument(
        "--strict-params", action="store_true",
        help=(
            "refuse unknown request fields with OpenAI's 400 `Unrecognized request argument supplied: X`; off: accept them and "
            "name every field without effect in the `x-meshllm-ignored-params` response header "
            "([strictness](frontend.md#strictness-and-ignored-fields))"
        ),
    )  # fmt: skip


# size: one flag after another, each with the text the docs' flag tables print (meshllm.flag_docs)
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
    g.add_argument(
        "--router-address", default="", help="router replicas `host:port[,...]`; empty = embed the routing core in the frontend"
    )
    g.add_argument(
        "--router-wait-s", type=float, default=DEFAULT_ROUTER_WAIT_S,
        help="seconds a request waits while no router replica can be reached (a restart) before a 503, 0..3600",
    )  # fmt: skip
    g.add_argument(
        "--router-mode",
        choices=ROUTER_MODES,
        default="kv",
        help="policy of the embedded routing core (ignored with `--router-address`)",
    )
    g.add_argument(
        "--max-inflight", type=int, default=4096, help="requests in flight before 429 with `Retry-After` (0 = unlimited)"
    )
    g.add_argument("--retry-after", type=float, default=1.0, help="seconds sent in `Retry-After` with a 429")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="largest request body accepted (413 beyond)")
    g.add_argument("--model-name", default=None, help="serve this model name (static mode: required)")
    g.add_argument(
        "--model-path",
        default=None,
        help="HF directory or `.gguf` file: tokenizer and chat template, overriding the model card's",
    )
    doc_default(
        g.add_argument("--tokenizer-cache-dir", default="", help="where fetched / converted tokenizers are cached"),
        "per-user cache",
    )
    g.add_argument(
        "--api-client-certs", choices=("required", "none"), default="required",
        help=(
            "with `--tls-ca`: `required` = the HTTP and Inference APIs want a client certificate from the CA too; `none` = "
            "public clients need only TLS (and an API key), while the calls to routers and workers stay mTLS"
        ),
    )  # fmt: skip
    g.add_argument(
        "--frontend-workers", "--workers", dest="workers", type=int, default=1,
        help="frontend processes on the same HTTP and gRPC ports (`SO_REUSEPORT`), each with its own routing core, "
        "1..256 ([several processes](frontend.md#several-processes---workers-n))",
    )  # fmt: skip
    g.add_argument(
        "--http-header-timeout", type=float, default=10.0,
        help="seconds a client has to send a request's headers (408 and close beyond), 0..3600",
    )  # fmt: skip
    g.add_argument(
        "--http-body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request body (408 and close beyond), 0..3600",
    )
    add_output_args(parser)
    add_coalesce_arg(parser)
    add_api_key_args(parser)
    add_tuning_args(parser)
    add_liveness_args(parser, health=True)
    s = parser.add_argument_group("static mode (no etcd, no NATS)")
    s.add_argument("--static-endpoint", default="", help="static mode: `namespace.component.endpoint` of the workers")
    s.add_argument("--static-workers", default=None, help="static mode: comma-separated worker `host:port` list")
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    add_security_args(
        parser,
        tls="HTTPS on the HTTP API, TLS on the Inference gRPC API and on the calls to routers and workers",
        tls_ca="both APIs require a client certificate from it; routers and workers are verified against it",
        mesh_token="the mesh token sent to routers and workers",
    )
    add_tracing_args(parser)
    return parser
