"""The router's typed configuration (`RouterConfig`) and the flag parser that builds it.

Flags default to their `MESHLLM_*` variable (`--router-mode` reads
`MESHLLM_ROUTER_MODE`). Static mode (`--static-workers`) needs neither etcd
nor NATS: the router is told the worker addresses, their endpoint and the
model name, and bad values are refused with one line before anything starts.
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from meshllm.config import (
    ConfigError,
    DiscoveryKind,
    EnvArgumentParser,
    PlaneConfig,
    ServerConfig,
    add_plane_args,
    add_stream_args,
    add_tracing_args,
    doc_default,
    from_flags,
    parse_host_port,
    server_config,
)
from meshllm.plane.auth import MeshSecurity, add_security_args
from meshllm.plane.request.liveness import SessionLiveness

__all__ = [
    "RouterConfig",
    "RouterMode",
    "RoutingTuning",
    "StaticEndpoint",
    "add_liveness_args",
    "add_tuning_args",
    "check_health_flags",
    "check_model_and_static",
    "router_arg_parser",
]


class RouterMode(enum.StrEnum):
    """How a worker is chosen (`--router-mode`)."""

    KV = "kv"
    APPROXIMATE = "approximate"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingTuning:
    """How a routing core weighs, samples, disaggregates and retries: the router's tuning flags
    (`add_tuning_args`), the same in a `meshllm router` process and in the core a frontend or `meshllm run`
    embeds. Validated when built (one-line errors)."""

    FLAG_DESTS: ClassVar[Mapping[str, str]] = {
        "temperature": "router_temperature",
        "overlap_weight": "kv_overlap_weight",
        "capacity_weight": "kv_capacity_weight",
        "wait_weight": "kv_wait_weight",
        "ttl_s": "router_ttl",
    }

    temperature: float = 0.0
    overlap_weight: float = 1.0
    capacity_weight: float = 1.0
    wait_weight: float = 1.0
    ttl_s: float = 120.0
    migration_limit: int = 3
    disagg_min_prompt_tokens: int = 0
    disagg_max_local_hit: float = 0.9
    # Assumed network bandwidth of a peer KV pull, GB/s (router/kv/pull.py); 0 = never pull from a peer.
    kv_pull_gbps: float = 0.0

    def __post_init__(self) -> None:
        weights = (
            ("--router-temperature", self.temperature),
            ("--kv-overlap-weight", self.overlap_weight),
            ("--kv-capacity-weight", self.capacity_weight),
            ("--kv-wait-weight", self.wait_weight),
        )
        for name, value in weights:
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if not math.isfinite(self.ttl_s) or self.ttl_s <= 0:
            raise ConfigError(f"--router-ttl must be > 0 seconds, got {self.ttl_s}")
        if self.migration_limit < 0:
            raise ConfigError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.disagg_min_prompt_tokens < 0:
            raise ConfigError(f"--disagg-min-prompt-tokens must be >= 0, got {self.disagg_min_prompt_tokens}")
        if not 0.0 <= self.disagg_max_local_hit <= 1.0:
            raise ConfigError(f"--disagg-max-local-hit must be a fraction in [0, 1], got {self.disagg_max_local_hit}")
        if not math.isfinite(self.kv_pull_gbps) or self.kv_pull_gbps < 0:
            raise ConfigError(f"--kv-pull-gbps must be a finite number >= 0 (GB/s; 0 = no peer pulls), got {self.kv_pull_gbps}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> RoutingTuning:
        """Build from the flags of `add_tuning_args`."""
        return from_flags(cls, ns)


# size: one flag after another, each with the text the docs' flag tables print (meshllm.flag_docs)
def add_tuning_args(parser: argparse.ArgumentParser) -> None:
    """The routing core's tuning flags (`RoutingTuning`): on `meshllm router`, and on `meshllm frontend` and
    `meshllm run` for the core they embed."""
    g = parser.add_argument_group("routing")
    g.add_argument("--router-temperature", type=float, default=0.0, help="0 = lowest cost wins; > 0 = sample softmax(−cost / T)")
    g.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=1.0,
        help=(
            "weight of prefill blocks in the cost `overlap_weight × prefill_blocks + decode_blocks + capacity_weight × "
            "(pressure + evicted_hot_blocks)`"
        ),
    )
    g.add_argument(
        "--kv-capacity-weight",
        type=float,
        default=1.0,
        help=(
            "weight of the capacity terms: cache pressure and evicted reused blocks (0 = ignore capacity; [routing](routing.md))"
        ),
    )
    g.add_argument(
        "--kv-wait-weight",
        type=float,
        default=1.0,
        help=(
            "weight of the measured wait behind a busy worker's running requests, in prefill blocks (0 = ignore it; "
            "[routing](routing.md))"
        ),
    )
    g.add_argument("--router-ttl", type=float, default=120.0, help="approximate mode: seconds a routed prompt counts as cached")
    g.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a broken stream may move to another worker (the model card's limit applies when lower)",
    )
    g.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=0,
        help="shorter prompts are prefilled on the decode worker (no remote prefill)",
    )
    g.add_argument(
        "--disagg-max-local-hit",
        type=float,
        default=0.9,
        help=(
            "skip remote prefill when the decode worker already caches (on its device or in its own lower KV tiers) at least "
            "this fraction of the prompt"
        ),
    )
    g.add_argument(
        "--kv-pull-gbps",
        type=float,
        default=0.0,
        help=(
            "assumed GB/s of a peer KV pull: a prefill leg pulls a prompt prefix another worker holds (device or lower tier) "
            "through `PullKv` when restore + transfer beats recomputing it (0 = never; [routing](routing.md#peer-prefix-pulls))"
        ),
    )


@dataclass(frozen=True, slots=True)
class StaticEndpoint:
    """`ns.component.endpoint` of the static workers."""

    namespace: str
    component: str
    endpoint: str

    @classmethod
    def parse(cls, value: str) -> StaticEndpoint:
        parts = value.split(".")
        if len(parts) != 3 or not all(p and all(c.isalnum() or c in "-_" for c in p) for p in parts):
            raise ConfigError(f"--static-endpoint {value!r} is not namespace.component.endpoint")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterConfig:
    """Everything a router (process or embedded `RouterCore`) needs, validated when built."""

    FLAG_DESTS: ClassVar[Mapping[str, str]] = {
        "health_interval_s": "worker_health_interval",
        "health_timeout_s": "worker_health_timeout",
    }

    plane: PlaneConfig = field(default_factory=PlaneConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    mode: RouterMode = RouterMode.KV
    tuning: RoutingTuning = field(default_factory=RoutingTuning)  # how the core weighs, samples and retries
    static_endpoint: StaticEndpoint | None = None
    static_workers: tuple[str, ...] = ()
    model_name: str | None = None
    metrics_port: int | None = None
    otlp_endpoint: str | None = None
    coalesce: bool = True  # False: --no-coalesce (meshllm.protocol.chunks)
    router_id: str = field(default_factory=lambda: f"router-{uuid.uuid4().hex[:12]}")
    component: str = "router"
    # Resync: how long a snapshot call may take, and the first retry delay.
    snapshot_timeout_s: float = 10.0
    resync_backoff_s: float = 0.2
    # A worker that failed a call is skipped for this long (discovery may lag).
    failure_cooldown_s: float = 5.0
    # Stall detection (plane/request/channels.py SessionLiveness): a worker session with open streams
    # that is silent this long, or a started stream without a chunk this long, counts as broken.
    stall_timeout_s: float = 3.0
    stream_stall_timeout_s: float = 30.0
    # Health checks of every worker (router/workers.py); interval 0 = none.
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    security: MeshSecurity = field(default_factory=MeshSecurity)  # TLS and mesh token (plane/auth.py)

    def __post_init__(self) -> None:
        _ = self.liveness  # validates the stall flags
        check_health_flags(self.health_interval_s, self.health_timeout_s)
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port} is out of range 0..65535")
        if not self.component or not all(c.isalnum() or c in "-_" for c in self.component):
            raise ConfigError(f"--component {self.component!r} must be letters, digits, '-' or '_'")
        for address in self.static_workers:
            parse_host_port(address, what="--static-workers entry")
        check_model_and_static(self.model_name, self.static, self.static_endpoint, self.static_workers)

    @property
    def liveness(self) -> SessionLiveness:
        """How long the router's worker sessions and streams may stall."""
        return SessionLiveness(stall_timeout_s=self.stall_timeout_s, stream_stall_timeout_s=self.stream_stall_timeout_s)

    @property
    def static(self) -> bool:
        """True when the workers are given (no discovery)."""
        return bool(self.static_workers) or self.plane.discovery is DiscoveryKind.STATIC

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> RouterConfig:
        """Build from the flags of `router_arg_parser`."""
        workers = tuple(w.strip() for w in (ns.static_workers or "").split(",") if w.strip())
        endpoint = StaticEndpoint.parse(ns.static_endpoint) if ns.static_endpoint else None
        plane = PlaneConfig.from_namespace(ns)
        if workers or ns.static_endpoint:
            plane = plane.static(namespace=endpoint.namespace if endpoint is not None else None, events_flag=ns.events)
        return from_flags(
            cls, ns, plane=plane, server=server_config(ns), mode=RouterMode(ns.router_mode),
            tuning=RoutingTuning.from_namespace(ns), static_endpoint=endpoint, static_workers=workers,
            otlp_endpoint=ns.otlp_endpoint or None, coalesce=not ns.no_coalesce,
            router_id=ns.router_id or f"router-{uuid.uuid4().hex[:12]}", security=MeshSecurity.from_namespace(ns),
        )  # fmt: skip


def router_arg_parser(*, env: Mapping[str, str] | None = None) -> EnvArgumentParser:
    """Every `meshllm router` flag (defaults from `MESHLLM_*`, `os.environ` unless `env` is given)."""
    parser = EnvArgumentParser(
        prog="meshllm router",
        env=os.environ if env is None else env,
        description="KV-aware router: routes, disaggregates, proxies and migrates generation streams",
    )
    g = parser.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="gRPC (and metrics) listen host")
    g.add_argument("--port", type=int, default=0, help="gRPC listen port (0 = ephemeral)")
    add_stream_args(g)
    g.add_argument(
        "--router-mode",
        choices=[m.value for m in RouterMode],
        default="kv",
        help=(
            "routing policy: `kv` (KV overlap + load, fed by KV events), `approximate` (no events: what was routed counts as "
            "cached for `--router-ttl`), `round-robin`, `random`, `least-loaded`"
        ),
    )
    g.add_argument("--static-endpoint", default="", help="static mode: `namespace.component.endpoint` of the workers")
    g.add_argument("--static-workers", default="", help="static mode: comma-separated worker `host:port` list")
    g.add_argument("--model-name", default=None, help="static mode: the model the workers serve")
    doc_default(g.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics HTTP port"), "off")
    doc_default(g.add_argument("--router-id", default="", help="this replica's id in discovery and in replica sync"), "random")
    g.add_argument(
        "--component",
        default="router",
        help="discovery component, and the replica-sync subject `meshllm.<ns>.router.<component>`",
    )
    add_tuning_args(parser)
    add_liveness_args(parser, health=True)
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    add_security_args(
        parser,
        tls="TLS on the Router gRPC server and on the calls to workers",
        tls_ca="clients need a certificate from it; workers are verified against it",
        mesh_token="shared secret of the mesh: Router calls without it are refused (UNAUTHENTICATED), and it is sent to workers",
    )
    add_tracing_args(parser)
    return parser


def check_model_and_static(
    model_name: str | None, static: bool, static_endpoint: object | None, static_workers: Sequence[str]
) -> None:
    """A given --model-name is not empty; static mode (no discovery) names its endpoint, its workers and the model."""
    if model_name is not None and not model_name.strip():
        raise ConfigError("--model-name must not be empty")
    if static:
        if static_endpoint is None:
            raise ConfigError("static mode needs --static-endpoint namespace.component.endpoint")
        if not static_workers:
            raise ConfigError("static mode needs --static-workers host:port[,host:port...]")
        if not model_name:
            raise ConfigError("static mode needs --model-name")


def check_health_flags(interval_s: float, timeout_s: float) -> None:
    """One-line ConfigErrors for out-of-range worker health-check flags."""
    if not (interval_s == 0 or 0.1 <= interval_s <= 3600):  # also refuses NaN
        raise ConfigError(f"--worker-health-interval must be 0 (off) or between 0.1 and 3600 seconds, got {interval_s}")
    if not 0.1 <= timeout_s <= 600:
        raise ConfigError(f"--worker-health-timeout must be between 0.1 and 600 seconds, got {timeout_s}")


def add_liveness_args(parser: argparse.ArgumentParser, *, health: bool) -> None:
    """The stall-detection flags (router, frontend), and the worker health-check flags when `health`."""
    g = parser.add_argument_group("stall detection")
    g.add_argument(
        "--stall-timeout", type=float, default=3.0,
        help="seconds a Generate session with open streams (a frontend's to a router, a routing core's to a worker) may "
        "send nothing, not even a heartbeat, before its streams fail over; at least 5 of the session's observed steps; "
        "1..3600 ([stall detection](reliability.md#stall-detection))",
    )  # fmt: skip
    g.add_argument(
        "--stream-stall-timeout", type=float, default=30.0,
        help="seconds a stream may go without a token after its first before it fails over (0 = never)",
    )  # fmt: skip
    if health:
        g.add_argument(
            "--worker-health-interval", type=float, default=1.0,
            help="routing core: seconds between `grpc.health.v1` checks of each worker; a failed check takes the worker "
            "out of routing until one succeeds (0 = none)",
        )  # fmt: skip
        g.add_argument(
            "--worker-health-timeout", type=float, default=2.0, help="routing core: seconds a worker health check may take"
        )
