"""The worker's flags and typed configuration: `worker_arg_parser` (every engine adds its own flags to it) and
`WorkerConfig`, validated once at startup. Beside the engine contract because an engine's `from_args` parses
them; the engine itself never reads the planes or security flags they carry."""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    server_config,
)
from meshllm.plane.auth import MeshSecurity, add_security_args

__all__ = ["DisaggregationMode", "WorkerConfig", "worker_arg_parser"]


class DisaggregationMode(enum.StrEnum):
    """The role a worker plays (`--role`)."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """Everything the worker runtime needs, built once from flags and `MESHLLM_*`."""

    engine: str
    role: DisaggregationMode = DisaggregationMode.AGGREGATED
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    component: str = "worker"
    endpoint: str = "generate"
    static: bool = False
    advertise_host: str | None = None
    instance_id: str | None = None
    model_name: str | None = None
    migration_limit: int = 3
    health_check_payload: Mapping[str, Any] | None = None
    health_check_interval_s: float = 10.0
    grace_period_s: float = 1.0
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None
    otlp_endpoint: str | None = None
    validate_streams: bool = False
    coalesce: bool = True  # False: --no-coalesce (meshllm.protocol.chunks)
    security: MeshSecurity = field(default_factory=MeshSecurity)

    def __post_init__(self) -> None:
        for name in ("component", "endpoint"):
            value = getattr(self, name)
            if not value or "/" in value or "." in value:
                raise ConfigError(f"--{name} {value!r} must be a non-empty name without '/' or '.'")
        if self.grace_period_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError("--grace-period and --drain-timeout must be >= 0")
        if self.health_check_interval_s <= 0:
            raise ConfigError("--health-check-interval must be > 0")
        if self.migration_limit < 0:
            raise ConfigError("--migration-limit must be >= 0")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("--model-name must not be empty")

    @classmethod
    def from_namespace(cls, ns: Any, *, engine: str) -> WorkerConfig:
        """Build from the flags added by `worker_arg_parser`."""
        payload = None
        if ns.health_check_payload:
            try:
                payload = json.loads(ns.health_check_payload)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--health-check-payload is not JSON: {exc.msg}") from None
            if not isinstance(payload, dict) or not isinstance(payload.get("token_ids"), list):
                raise ConfigError('--health-check-payload must be a JSON object with "token_ids": [...]')
        plane = PlaneConfig.from_namespace(ns)
        static = bool(ns.static) or plane.discovery is DiscoveryKind.STATIC
        if static and plane.discovery is not DiscoveryKind.STATIC:
            plane = plane.static(events_flag=ns.events)
        return from_flags(
            cls, ns, engine=engine, role=DisaggregationMode(ns.role), plane=plane, server=server_config(ns),
            static=static, advertise_host=ns.advertise_host or None, instance_id=ns.instance_id or None,
            health_check_payload=payload, otlp_endpoint=ns.otlp_endpoint or None, coalesce=not ns.no_coalesce,
            security=MeshSecurity.from_namespace(ns),
        )  # fmt: skip


def worker_arg_parser(engine: str, *, env: Mapping[str, str] | None = None) -> EnvArgumentParser:
    """A parser with every common worker flag; engines add their own and parse.

    Defaults come from `MESHLLM_*` variables (`os.environ` unless `env` is given).
    """
    parser = EnvArgumentParser(
        prog=f"meshllm worker --engine {engine}",
        env=os.environ if env is None else env,
        description=f"meshllm worker running the {engine} engine",
    )
    g = parser.add_argument_group("worker")
    g.add_argument(
        "--role", choices=[m.value for m in DisaggregationMode], default="agg", help="`agg` (aggregated), `prefill` or `decode`"
    )
    g.add_argument("--component", default="worker", help="discovery component name")
    g.add_argument("--endpoint", default="generate", help="discovery endpoint name")
    g.add_argument("--host", default="127.0.0.1", help="gRPC (and metrics) listen host")
    g.add_argument("--port", type=int, default=0, help="gRPC listen port (0 = ephemeral)")
    add_stream_args(g)
    doc_default(g.add_argument("--advertise-host", default="", help="host registered in discovery"), "`--host`, or the hostname")
    g.add_argument("--static", action="store_true", help="do not register in discovery ([static mode](#static-mode))")
    doc_default(g.add_argument("--instance-id", default="", help="instance id"), "random")
    doc_default(g.add_argument("--model-name", default=None, help="public model name"), "the engine's")
    g.add_argument("--migration-limit", type=int, default=3, help="migrations allowed per request (published in the model card)")
    doc_default(
        g.add_argument("--health-check-payload", default="", help='canary request JSON, e.g. `{"token_ids": [1, 2]}`'),
        "a tiny prompt",
    )
    g.add_argument("--health-check-interval", type=float, default=10.0, help="idle seconds between canaries")
    g.add_argument("--grace-period", type=float, default=1.0, help="seconds between unregistering and refusing new requests")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="most seconds to wait for in-flight requests at shutdown")
    doc_default(g.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics HTTP port"), "off")
    g.add_argument(
        "--validate-streams", action="store_true", help="check every engine stream against the contract (engine development)"
    )
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    add_security_args(
        parser,
        tls="TLS on the Worker gRPC server and on KV pulls from other workers",
        tls_ca="callers need a certificate from it",
        mesh_token="shared secret of the mesh: Worker calls (Generate, Abort, Drain, ClearKvBlocks, GetKvSnapshot, "
        "PullKv, ...) without it are refused (UNAUTHENTICATED)",
    )
    add_tracing_args(parser)
    return parser
